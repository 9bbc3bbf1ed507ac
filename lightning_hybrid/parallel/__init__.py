"""The driver and what it applies besides tensor and pipeline parallelism: :mod:`~.parallelize` (the one driver: every
parallelism in a fixed, commented order), activation checkpointing (:mod:`~.activation_checkpointing`),
``torch.compile`` per block (:mod:`~.compile`), FSDP2 and ZeRO levels (:mod:`~.fsdp`), meta-device initialization
(:mod:`~.initialization`, :mod:`~.construction`) and the gradient norm over every mesh and stage
(:mod:`~.grad_norm`). Import from the modules: this package imports none of them."""
