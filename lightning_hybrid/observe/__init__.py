"""Seeing what a parallel run does: the :class:`~.monitor.ParallelMonitor` callback (:mod:`~.monitor`), model FLOPs
and collective bytes of a step (:mod:`~.counting`), and the pipeline's timeline picture (:mod:`~.timeline`)."""
