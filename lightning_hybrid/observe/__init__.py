"""Seeing what a parallel run does: the :class:`~.monitor.ParallelMonitor` callback (:mod:`~.monitor`) and its
progress-bar figures (:mod:`~.progress`), model FLOPs and collective bytes of a step (:mod:`~.counting`), the time
in collectives (:mod:`~.profiling`), the pipeline's timeline picture (:mod:`~.timeline`), the whole model's
parameters per stage and rank (:mod:`~.parameter_counts`) and the run described in TensorBoard (:mod:`~.run_record`).
Import from the modules: this package imports none of them."""
