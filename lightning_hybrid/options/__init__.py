"""The strategy's arguments, validated once: :class:`~.hybrid_options.HybridOptions` (:mod:`~.hybrid_options`, every
argument declared there), the keyword arguments and documentation of ``HybridStrategy`` generated from it
(:mod:`~.keywords`), the single-feature checks (:mod:`~.feature_checks`), the pipeline schedule (:mod:`~.schedules`)
and the blocks activation checkpointing covers (:mod:`~.recompute`). Plain values, no parallelism: every layer above
reads them. Import from the modules: this package imports none of them."""
