"""Context parallelism on CPU: peak activation memory per rank against sequence length and cp, next to the theory;
the collectives' bytes against the minimum of the exchange; step time at cp2 against cp1.

The main recipe's GPT (``recipes/gpt.py``: learned positions, ``F.scaled_dot_product_attention``, 2 blocks of width
64 and 4 heads, vocabulary 64), or with ``--model hf_llama`` an unmodified Hugging Face ``LlamaForCausalLM`` of the
same sizes (2 key/value heads, rotary positions, its sdpa attention through its attention interface), trains one
sequence per step on one process (cp1, ``HybridStrategy()``) and on ``cp`` processes (``HybridStrategy(cp=N)``) at
each ``--lengths``. Measured on the third step of each run:

* **activation peak** per rank (``benchmarks/memory.py``'s ``ActivationTracker``: every byte autograd and the step
  allocate besides parameters, gradients and optimizer state), against the theory: the blocks' activations divide
  by cp (each rank saves its ``S / cp`` positions; its attention's queries, keys, values and output are held for
  ``heads / cp`` heads at all ``S`` positions: as many), the embedding's output, the head's logits and the loss
  stay whole on every rank;
* **bytes** the collectives are handed (:class:`~lightning_hybrid.observe.counting.StepCounter`, forward and
  backward): ``all_to_all`` against the exchange's minimum (per block, q, k, v and the attention output, each
  ``S/cp × width`` floats — keys and values ``kv_heads / heads`` of that when cp divides their heads — forward and
  backward: ``8 × S/cp × width × 4`` bytes for the GPT), ``all_gather`` against the
  blocks' outputs gathered and their inputs' gradients gathered in backward (``2 × S × width × 4`` per block) plus
  FSDP2's parameter gathers (ZeRO-3 over the cp ranks: the blocks' in forward and again in backward, the rest once);
* the **step time** (median of the steps after the first two), and its ratio to cp1 at the same length.

Usage::

    python benchmarks/context_parallel.py                               # 1k..16k positions, cp 1 and 2
    python benchmarks/context_parallel.py --lengths 1024,4096 --cp 2,4 --json results.json
    python benchmarks/context_parallel.py --model hf_llama --lengths 4096,16384     # theory: the GPT's only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness import launch_ranks, markdown_table, save_rank_result  # noqa: E402

WIDTH, HEADS, LAYERS, VOCAB = 64, 4, 2, 64
STEPS, MEASURED = 5, 2  # the third step is measured (AdamW's state exists); steps 3..5 timed
FP32, MiB = 4, 2**20


def theory(length: int, cp: int) -> dict[str, float]:
    """Analytic activation bytes per rank at ``cp``: blocks (autograd's saved tensors of a GPT block, the
    ``benchmarks/memory.py`` formula at ``S / cp`` positions: attention saves its queries, keys, values and output
    in the exchanged head layout instead, as many elements) and what stays whole (the embedding's output, the head's
    input, output and statistics, the logits and their log-softmax)."""
    local = length // cp
    block = local * (16 * WIDTH + 4 + HEADS) * FP32
    whole = length * (3 * WIDTH + 2 + 2 * VOCAB) * FP32
    return {"blocks": LAYERS * block, "whole": whole, "total": LAYERS * block + whole}


def minimum_bytes(length: int, cp: int, gathered_parameters: int, kv_heads: int = HEADS) -> dict[str, int]:
    """What the collectives must be handed per step (module docstring); ``gathered_parameters``: FSDP2's share, the
    parameters outside the blocks gathered once (the root stays gathered for backward), the blocks' twice; keys and
    values are ``kv_heads`` wide, repeated to the query heads when cp does not divide them."""
    if cp == 1:
        return {"all_to_all": 0, "all_gather": 0}
    kv_width = WIDTH * (kv_heads if kv_heads % cp == 0 else HEADS) // HEADS
    per_position = 2 * WIDTH + 2 * kv_width  # q and the output, k and v
    return {"all_to_all": LAYERS * 2 * (length // cp) * per_position * FP32,
            "all_gather": LAYERS * 2 * length * WIDTH * FP32 + gathered_parameters * FP32}


def measure(model: str, length: int, cp: int) -> dict[str, Any]:
    """One rank of a fit of ``model`` at ``length`` positions and ``cp``: the measured step's figures."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return _measure(model, length, cp)


def _module(model: str, length: int) -> Any:
    import torch

    torch.manual_seed(0)
    if model == "gpt":
        from recipes.gpt import GPTConfig, GPTLightning

        return GPTLightning(GPTConfig(vocab_size=VOCAB, block_size=length, n_layer=LAYERS, n_head=HEADS,
                                      n_embd=WIDTH), warmup_steps=1, max_steps=STEPS)
    import lightning.pytorch as pl
    import torch.nn.functional as F
    from transformers import LlamaConfig, LlamaForCausalLM

    class Llama(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = LlamaForCausalLM(LlamaConfig(
                vocab_size=VOCAB, hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS,
                num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=length,
                attn_implementation="sdpa", use_cache=False))

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            inputs, targets = batch
            return F.cross_entropy(self.model(inputs).logits.flatten(0, 1), targets.flatten())

        def configure_optimizers(self) -> Any:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Llama()


def _measure(model: str, length: int, cp: int) -> dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks.memory import make_probe
    from lightning_hybrid import HybridStrategy
    from lightning_hybrid.observe.counting import StepCounter

    module = _module(model, length)
    tokens = torch.randint(0, VOCAB, (STEPS, length + 1))
    memory: list[dict[str, Any]] = []
    timer = _Timer(StepCounter(module))
    trainer = pl.Trainer(accelerator="cpu", devices=cp, strategy=HybridStrategy(cp=cp, monitor=False),
                         max_steps=STEPS, logger=False, enable_progress_bar=False, enable_checkpointing=False,
                         enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                         callbacks=[make_probe(memory.append), timer])
    trainer.fit(module, DataLoader(TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()),
                                   batch_size=1))
    blocks = module.model.blocks if model == "gpt" else module.model.model.layers
    in_blocks = sum(p.numel() for p in blocks.parameters())  # global sizes (DTensors under FSDP2)
    outside = sum(p.numel() for p in module.parameters()) - in_blocks
    return {"activation_peak": memory[0]["activation_peak"], "bytes": timer.bytes,
            "gathered_parameters": outside + 2 * in_blocks, "step_s": statistics.median(timer.seconds[MEASURED:])}


class _Timer:
    """Lightning callback: each step's seconds, and the collectives' bytes of the measured step."""

    def __new__(cls, counter: Any) -> Any:
        import lightning.pytorch as pl

        class Timer(pl.Callback):
            def __init__(self) -> None:
                self.seconds: list[float] = []
                self.bytes: dict[str, int] = {}

            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                self.start = time.perf_counter()
                if batch_idx == MEASURED:
                    counter.__enter__()

            def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
                if trainer.global_step == MEASURED:
                    counter.__exit__(None, None, None)
                    self.bytes = dict(counter.comm_bytes)

            def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
                self.seconds.append(time.perf_counter() - self.start)

        return Timer()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="1024,2048,4096,8192,16384")
    parser.add_argument("--cp", default="2", help="context-parallel degrees besides 1")
    parser.add_argument("--model", choices=("gpt", "hf_llama"), default="gpt")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--worker", help="MODEL,LENGTH,CP: one rank's measurement (internal)")
    parser.add_argument("--devices", type=int)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if args.worker:
        model, length, cp = args.worker.split(",")
        save_rank_result(args.out, measure(model, int(length), int(cp)))
        return
    lengths, degrees = [int(v) for v in args.lengths.split(",")], [1, *(int(v) for v in args.cp.split(","))]
    results = {(length, cp): launch_ranks(Path(__file__), ["--worker", f"{args.model},{length},{cp}"], world=cp).ranks
               for length in lengths for cp in degrees}
    print(report(results, lengths, degrees, theory_known=args.model == "gpt"))
    if args.json:
        args.json.write_text(json.dumps({f"{length},{cp}": ranks for (length, cp), ranks in results.items()}))


def report(results: dict[tuple[int, int], list[dict[str, Any]]], lengths: list[int], degrees: list[int],
           theory_known: bool = True) -> str:
    """The Markdown table: per length and cp, rank 0's figures next to the theory (the GPT's) and the minimum."""
    rows = []
    for length in lengths:
        base = results[(length, 1)][0]
        for cp in degrees:
            rank = results[(length, cp)][0]
            expected = theory(length, cp)
            minimum = minimum_bytes(length, cp, rank["gathered_parameters"], 4 if theory_known else 2)
            known = lambda text: text if theory_known else "-"  # noqa: E731
            rows.append([length, cp, f"{rank['activation_peak'] / MiB:.1f}", known(f"{expected['total'] / MiB:.1f}"),
                         f"{rank['activation_peak'] / base['activation_peak']:.2f}",
                         known(f"{expected['total'] / theory(length, 1)['total']:.2f}"),
                         f"{rank['bytes'].get('all_to_all', 0) / MiB:.2f} / {minimum['all_to_all'] / MiB:.2f}",
                         f"{rank['bytes'].get('all_gather', 0) / MiB:.2f} / {minimum['all_gather'] / MiB:.2f}",
                         f"{rank['step_s']:.3f}", f"{rank['step_s'] / base['step_s']:.2f}"])
    return markdown_table(["positions", "cp", "activation peak MiB", "theory MiB", "vs cp1", "theory vs cp1",
                           "all_to_all MiB (measured / minimum)", "all_gather MiB (measured / minimum)",
                           "step s", "step vs cp1"], rows)


if __name__ == "__main__":
    main()
