"""Seeing what a parallel run does: the :class:`~.monitor.ParallelMonitor` callback (:mod:`~.monitor`) and its
progress-bar figures (:mod:`~.progress`), model FLOPs and collective bytes of a step (:mod:`~.counting`), the time
in collectives (:mod:`~.profiling`), the pipeline's timeline picture (:mod:`~.timeline`), and the model summary of
the whole model (:mod:`~.summary`)."""
