"""lightning-hybrid: data × tensor × pipeline parallelism for unmodified LightningModules.

Example::

    from lightning.pytorch import Trainer
    from lightning_hybrid import HybridStrategy

    trainer = Trainer(accelerator="gpu", devices=8, strategy=HybridStrategy(tp=4))   # dp=2 × tp=4
    trainer = Trainer(accelerator="gpu", devices=8, num_nodes=4, strategy=HybridStrategy(tp=4, pp=8))
    trainer = Trainer(accelerator="gpu", devices=8, strategy=HybridStrategy(tp="auto", pp="auto"))  # planned
    trainer.fit(MyLightningModule())

Importing the package registers the strategy as ``Trainer(strategy="hybrid")``.
"""

from lightning_hybrid.mesh import ParallelDims
from lightning_hybrid.monitoring import ParallelMonitor
from lightning_hybrid.pipeline import PipelineSchedule
from lightning_hybrid.planning import Cluster
from lightning_hybrid.strategy import HybridStrategy

__all__ = ["Cluster", "HybridStrategy", "ParallelDims", "ParallelMonitor", "PipelineSchedule"]
__version__ = "0.1.0"
