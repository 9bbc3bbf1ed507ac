"""Pipeline parallelism: schedules (:mod:`~.schedules`), the stage split (:mod:`~.split`), stand-ins for other
ranks' units (:mod:`~.dispatch`), the runtime (:mod:`~.runtime`), Lightning's step semantics (:mod:`~.semantics`)
and step timing (:mod:`~.timing`). Import from the modules: this package imports none of them, so the planner can
read :mod:`~.schedules` without loading ``torch.distributed.pipelining``."""
