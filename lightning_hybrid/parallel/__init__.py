"""The parallelisms applied to a module, one concern per module, and the one driver that applies them in order
(:mod:`~.parallelize`): finding the blocks (:mod:`~.blocks`), tracing a block's data flow (:mod:`~.dataflow`),
tensor parallelism planned (:mod:`~.tp_plan`) and applied (:mod:`~.tensor_parallel`), activation checkpointing
(:mod:`~.activation_checkpointing`), FSDP2 (:mod:`~.sharding`), meta-device initialization
(:mod:`~.initialization`) and precision and clipping (:mod:`~.precision`)."""
