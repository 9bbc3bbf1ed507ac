"""Planning layouts: a model's sizes (:mod:`~.model`), the cost model of one layout (:mod:`~.cost`, with
:mod:`~.step`, :mod:`~.memory`, :mod:`~.step_time`, :mod:`~.traffic`), its words (:mod:`~.layout`,
:mod:`~.syntax`), the ranking of every layout (:mod:`~.search`, behind ``lightning-hybrid plan``) and the choice at
setup for ``tp="auto"``/``pp="auto"`` (:mod:`~.auto_layout`) from the live model (:mod:`~.live_model`) and hardware
(:mod:`~.hardware_probe`; presets in :mod:`lightning_hybrid.hardware`). Import from the modules: this package imports
none of them, so ``lightning-hybrid plan --help`` loads only the presets."""
