"""Tensor parallelism: a block's data flow traced (:mod:`~.dataflow`), its plan (:mod:`~.block_plan`: column/row pairs,
heads dealt to ranks by :mod:`~.heads`, experts by :mod:`~.experts`), the plan checked and applied with DTensor
(:mod:`~.apply`, sharded layers torch lacks in :mod:`~.layers`), the embedding and head over the vocabulary
(:mod:`~.vocab`) and ``loss_parallel`` (:mod:`~.loss_parallel`). Import from the modules: this package imports none of
them."""
