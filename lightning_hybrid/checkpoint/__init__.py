"""Checkpoints: sharded DCP state of any layout (:mod:`~.dcp_io`), asynchronous saves (:mod:`~.async_save`), file
integrity (:mod:`~.integrity`), consolidation into one file (:mod:`~.export`) or a Hugging Face directory
(:mod:`~.hf_export`, the module rebuilt by :mod:`~.module_class`), pretrained weights read into the shards
(:mod:`~.hf_load`) and the data position for exact mid-epoch resume (:mod:`~.data_position`). Lightning's save and
load hooks: :mod:`lightning_hybrid.glue.checkpoint_io`. Import from the modules: this package imports none of them."""
