"""Pipeline parallelism: the stage split (:mod:`~.split`, by FLOPs or by time: :mod:`~.timed_split`), stand-ins for
other ranks' units (:mod:`~.dispatch`), parameters shared by stages (:mod:`~.shared`), the runtime
(:mod:`~.runtime`), microbatches of changing shapes (:mod:`~.microbatches`), Lightning's step semantics
(:mod:`~.semantics`, :mod:`~.metric_calls`) and per-action timestamps (:mod:`~.step_recorder`). Which schedule and
its rules: :mod:`lightning_hybrid.options.schedules`. Import from the modules: this package imports none of them."""
