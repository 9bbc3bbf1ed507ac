"""Lightning glue: what connects the strategy to Lightning's Trainer, loops and hooks — the setup probe's batch
(:mod:`~.setup_batch`), how steps run (:mod:`~.steps`), precision plugins (:mod:`~.precision`), checkpoint hooks
(:mod:`~.checkpoint_io`, :mod:`~.checkpoint_records`), the model summary callbacks (:mod:`~.model_summary`) and
modules written for ``ModelParallelStrategy`` (:mod:`~.model_parallel_compat`). Import from the modules: this package
imports none of them."""
