"""Checkpoints: sharded DCP state of any layout (:mod:`~.sharded`), Lightning's save and load of it
(:mod:`~.lightning_io`), consolidation into one file (:mod:`~.export`) and exact data order on resume
(:mod:`~.resume`)."""
