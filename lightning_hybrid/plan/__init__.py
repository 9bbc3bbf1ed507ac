"""Planning layouts: a model's sizes (:mod:`~.model`), the hardware (:mod:`~.hardware`, measured by :mod:`~.probe`),
the cost model of one layout (:mod:`~.cost`), the ranking of every layout (:mod:`~.search`, behind
``lightning-hybrid plan``) and the choice at setup for ``tp="auto"``/``pp="auto"`` (:mod:`~.auto_layout`). Import from
the modules: this package imports none of them, so ``lightning-hybrid plan --help`` loads only the presets."""
