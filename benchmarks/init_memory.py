"""Host memory of initializing a meta-device model under ``HybridStrategy(tp=2, pp=2)`` from scratch.

A ``LlamaForCausalLM`` with Llama-3.2-1B's dimensions (:data:`CONFIG`: 1.24 B parameters, a tied 128,256 × 2,048
embedding of 1 GiB in fp32) is built on the meta device by each of 4 ranks (``benchmarks/harness.py``, gloo, CPU),
and ``trainer.validate`` runs setup: split, shard, materialize. Each rank samples its anonymous resident memory
(``hf_load_memory.PeakRSS``) around step 6 of the driver (materialization: shards allocated and initialized) and
reports the peak growth next to the bytes of the parameters and buffers it holds (its share, each storage once). Run
twice, side by side: initializers replayed on the shards (what HybridStrategy does, ``parallel/shard_init.py``) and
every initializer on full-size temporaries (the ``full-size`` run: how it was before; the values are the same).

Run: ``python benchmarks/init_memory.py`` (about 3 minutes on 2 cores, ~8 GB of RAM).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks.harness import launch_ranks, markdown_table, save_rank_result  # noqa: E402
from benchmarks.hf_load_memory import WORLD, MiB, PeakRSS, _measured, validate_meta_llama  # noqa: E402

CONFIG = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
              num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=64, tie_word_embeddings=True,
              attn_implementation="eager")


def run_rank(full_size: bool, out: Path) -> None:
    """One rank: set up tp2 × pp2 on a meta-device model; write this rank's share and materialization peak."""
    from lightning_hybrid.parallel import initialization, parallelize

    if full_size:  # every initializer on full-size temporaries, as before the replay existed
        initialization._keep_full_size_writers_whole = lambda steps: [setattr(s, "replayed", None) for s in steps]
    peaks: dict[str, PeakRSS] = {}
    parallelize.apply_materialization = _measured(parallelize.apply_materialization, peaks, "materialize")
    trainer, module = validate_meta_llama(CONFIG)
    held = [t.to_local() if hasattr(t, "to_local") else t for t in module.state_dict().values()]
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held if not t.is_meta}
    share = sum(storages.values())  # a tied table counted once
    made = peaks["materialize"]
    save_rank_result(out, {"rank": trainer.global_rank, "share": share, "growth": made.peak - made.start},
                     trainer.global_rank)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", choices=["replayed", "full-size"], help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)  # set by the harness: WORLD
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_rank(args.worker == "full-size", args.out)
        return
    import torch

    runs = {mode: launch_ranks(Path(__file__), ["--worker", mode], world=WORLD, timeout_s=1800).ranks
            for mode in ("full-size", "replayed")}
    print(f"LlamaForCausalLM with Llama-3.2-1B's dimensions, fp32, tp2 x pp2 on {WORLD} ranks,"
          f" torch {torch.__version__}")
    rows = []
    for full, replayed in zip(runs["full-size"], runs["replayed"]):
        share = replayed["share"]
        rows.append([replayed["rank"], f"{share / MiB:.0f}", f"{full['growth'] / MiB:.0f}",
                     f"{full['growth'] / share:.2f}", f"{replayed['growth'] / MiB:.0f}",
                     f"{replayed['growth'] / share:.2f}"])
    print(markdown_table(["rank", "share MiB", "full-size: peak growth MiB", "ratio", "replayed: peak growth MiB",
                          "ratio"], rows))


if __name__ == "__main__":
    main()
