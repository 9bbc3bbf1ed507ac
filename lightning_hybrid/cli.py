"""The ``lightning-hybrid`` command.

Usage::

    lightning-hybrid export CHECKPOINT_FOLDER OUTPUT [--safetensors]
    lightning-hybrid export CHECKPOINT_FOLDER OUTPUT_DIR --hf
    python -m lightning_hybrid export CHECKPOINT_FOLDER OUTPUT      # the same without the installed script
    lightning-hybrid plan --params 7e9 --seq-len 4096 --gpu h100-sxm --nodes 4 --global-batch 256 [--json]
    lightning-hybrid plan ... --layout "tp8 pp8 interleaved_1f1b m96 ac"     # one layout's breakdown and rank
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, replace
from typing import TYPE_CHECKING, Any, Optional, Sequence

from lightning_hybrid.hardware import A100_MATMUL_EFFICIENCY, GIB, GPU_PRESETS, H100_MATMUL_EFFICIENCY, Cluster
from lightning_hybrid.planner.syntax import LAYOUT_SYNTAX

# The planner and the checkpoint reader need torch; they load once a command runs, so --help answers at once.
if TYPE_CHECKING:
    from lightning_hybrid.planner.layout import Estimate
    from lightning_hybrid.planner.model import ModelShape


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(prog="lightning-hybrid", description="Tools for HybridStrategy runs.")
    commands = parser.add_subparsers(dest="command", required=True)
    _add_export_command(commands)
    _add_plan_command(commands)
    args = parser.parse_args(argv)
    if args.command == "plan":
        _plan(args, parser)
        return
    try:
        path = _export(args)
    except (ValueError, ImportError) as error:
        parser.exit(2, f"lightning-hybrid export: error: {error}\n")
    print(f"wrote {path}")


# ------------------------------------------------------------------------------------------------------ export
def _add_export_command(commands: Any) -> None:
    export = commands.add_parser(
        "export",
        help="consolidate a sharded checkpoint into one file with the unmodified module's state dict",
        description="Consolidate a sharded checkpoint folder (any layout) into one Lightning checkpoint file"
        " (loadable with YourModule.load_from_checkpoint), with --safetensors a .safetensors state dict, or with"
        " --hf a Hugging Face model directory of the PreTrainedModel inside the module (from_pretrained loads it).",
    )
    export.add_argument("checkpoint", help="sharded checkpoint folder written by HybridStrategy")
    export.add_argument("output", help="file to write (--hf: a new directory)")
    export.add_argument("--safetensors", action="store_true", help="write the state dict in safetensors format")
    hf = export.add_argument_group("Hugging Face directory (--hf)")
    hf.add_argument("--hf", action="store_true", help="write sharded safetensors, their index and config.json")
    hf.add_argument("--module", help="package.module:LightningModuleClass of the checkpoint, built on the meta"
                    " device from its saved hyperparameters to find the PreTrainedModel (default: the class the"
                    " checkpoint recorded)")
    hf.add_argument("--module-kwargs", default="{}", help="JSON object of constructor arguments added to the saved"
                    " hyperparameters")
    hf.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, bytes or 500MB-style"
                    " (default 5GB); about what the export holds in memory")
    hf.add_argument("--config-from", help="Hugging Face directory whose config.json to copy instead of the model's")


def _export(args: argparse.Namespace) -> Any:
    if not args.hf:
        hf_only = [flag for flag, value in (("--module", args.module), ("--config-from", args.config_from)) if value]
        if hf_only:
            raise ValueError(f"{' and '.join(hf_only)} only apply to --hf")
        from lightning_hybrid.checkpoint.export import export_checkpoint

        return export_checkpoint(args.checkpoint, args.output, safetensors=args.safetensors)
    if args.safetensors:
        raise ValueError("--hf writes safetensors already: drop --safetensors")
    from lightning_hybrid.checkpoint.hf_export import export_hugging_face

    kwargs = _json_object(args.module_kwargs)
    _importable_from_here()
    size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    return export_hugging_face(args.checkpoint, args.output, args.module, module_kwargs=kwargs, max_shard_size=size,
                               config_from=args.config_from)


def _json_object(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"--module-kwargs is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise ValueError("--module-kwargs must be a JSON object of constructor arguments")
    return value


def _importable_from_here() -> None:
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # import the user's package from where they run, as `python -m` does


# ------------------------------------------------------------------------------------------------------ plan
#: The model flags of a mixture of experts, and of a block the dimensions do not describe.
_EXPERT_FLAGS = {
    "--experts": "mixture of experts: routed experts per MoE block", "--experts-per-token": "each token's routed"
    " experts (top-k)", "--expert-ffn-hidden": "one expert's MLP width (default --ffn-hidden)", "--moe-layers": "MoE"
    " blocks (default all, with --experts)", "--shared-experts": "experts every token goes through",
    "--parameters-per-block": "exact parameters per block (averaged), where the dimensions do not give them"
    " (attention wider than the model)"}


def _add_plan_command(commands: Any) -> None:
    plan = commands.add_parser(
        "plan",
        help="rank dp × tp × pp layouts of a model on a cluster by predicted step time and memory",
        description="Predict per-GPU memory and step time of every HybridStrategy layout of a model on a cluster"
        " (formulas: lightning_hybrid/planner/cost.py) and rank the ones that fit. Describe the model by --params, by"
        " its dimensions (--layers --hidden --heads --vocab --seq-len), or by --module; the cluster by --gpu"
        " and/or the four hardware numbers.",
    )
    model = plan.add_argument_group("model")
    model.add_argument("--params", type=_count, help="parameter count (7e9, 7B, 350M): a GPT-3-shaped model")
    model.add_argument("--module", help="package.module:LightningModuleClass, measured on the meta device")
    model.add_argument("--module-kwargs", default="{}", help="JSON object of the module's constructor arguments")
    sizes = {"--layers": "number of blocks", "--hidden": "model width", "--heads": "attention heads",
             "--kv-heads": "key/value heads (default: --heads; read from --module)",
             "--ffn-hidden": "MLP width (default 4 × hidden)", "--vocab": "vocabulary (default 32000 with --params)",
             "--seq-len": "tokens per sequence", **_EXPERT_FLAGS}
    for flag, meaning in sizes.items():
        model.add_argument(flag, type=int, help=meaning)
    model.add_argument("--gated-mlp", action="store_true", help="SwiGLU-style MLP (three matrices)")
    model.add_argument("--tied-embeddings", action="store_true", help="head shares the embedding's weight")
    model.add_argument("--dropout", action="store_true", help="count dropout masks in the activations")
    model.add_argument("--eager-attention", action="store_true",
                       help="attention scores are materialized (no flash/memory-efficient SDPA)")
    model.add_argument("--fused-kernels", action="store_true", help="the blocks' element-wise chains run as fused"
                       " kernels (Megatron-style); without it they are timed as eager PyTorch runs them")
    cluster = plan.add_argument_group("cluster")
    cluster.add_argument("--gpu", help="preset: " + ", ".join(GPU_PRESETS))
    cluster.add_argument("--gpu-memory-gib", type=float, help="memory per GPU, GiB")
    cluster.add_argument("--peak-tflops", type=float, help="dense peak per GPU in the training dtype, TFLOP/s")
    cluster.add_argument("--intra-node-gbps", type=float, help="GB/s per GPU and direction inside a node")
    cluster.add_argument("--inter-node-gbps", type=float, help="GB/s per GPU and direction between nodes")
    cluster.add_argument("--latency-us", type=float,
                         help="µs every collective or message costs whatever its size (presets 20, else 0)")
    cluster.add_argument("--memory-gbps", type=float, help="GPU memory bandwidth, GB/s: times the memory-bound"
                         " kernels apart from the matmuls (presets: the datasheet's; else not charged apart)")
    cluster.add_argument("--nodes", type=int, default=1)
    cluster.add_argument("--gpus-per-node", type=int, default=8)
    cluster.add_argument("--efficiency", type=float, help="achievable share of peak: of a large aligned GEMM with"
                         f" a preset (A100 {A100_MATMUL_EFFICIENCY}, H100 {H100_MATMUL_EFFICIENCY}; the shapes give"
                         " the rest), else of all compute (default 0.5)")
    _add_strategy_options(plan)
    plan.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    plan.add_argument("--precision", default="bf16-mixed", help="32-true, bf16-mixed (default), bf16-true or 16-true")
    plan.add_argument("--layout", help="show this layout's breakdown and rank instead of the ranking, e.g. 'tp8 pp8"
                      " interleaved_1f1b m96 ac' (dp: the GPUs left; words: " + LAYOUT_SYNTAX + ")")
    plan.add_argument("--top", type=int, default=10, help="layouts to show, of each kind (default 10)")
    plan.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _add_strategy_options(plan: argparse.ArgumentParser) -> None:
    strategy = plan.add_argument_group("HybridStrategy options applied to every layout")
    strategy.add_argument("--compile", action="store_true", help="compile=True: element-wise chains fused")
    strategy.add_argument("--offload", action="store_true", help="offload=True: model states in CPU memory")
    strategy.add_argument("--reduce-dtype", choices=("fp32", "bf16"), help="reduce_dtype= of the gradients")
    strategy.add_argument("--loss-parallel", action="store_true", help="loss_parallel=True (tp > 1, no pipeline)")


def _count(text: str) -> float:
    scale = {"k": 1e3, "m": 1e6, "b": 1e9, "t": 1e12}.get(text[-1:].lower(), 1.0)
    try:
        return float(text[:-1] if scale != 1.0 else text) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a parameter count: {text!r} (e.g. 7e9, 7B, 350M)") from None


def _plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> None:
    from lightning_hybrid.planner.search import plan

    try:
        if args.top < 1:
            raise ValueError(f"--top must be positive, got {args.top}")
        model = _model_from(args)
        cluster = _cluster_from(args)
        options = _strategy_options(args)
        asked = _asked_layout(args, model, cluster, options)
        estimates = plan(model, cluster, args.global_batch, args.precision, options=options)
    except ValueError as error:
        parser.exit(2, f"lightning-hybrid plan: error: {error}\n")
    feasible = [e for e in estimates if e.feasible]
    infeasible = [e for e in estimates if not e.feasible]
    shown_feasible, shown_infeasible = feasible[: args.top], infeasible[: args.top]
    if args.json:
        report = {
            "model": {**asdict(model), "total_parameters": model.total_parameters}, "cluster": asdict(cluster),
            "global_batch": args.global_batch, "precision": args.precision, "layouts_considered": len(estimates),
            "feasible": [e.to_dict() for e in shown_feasible], "infeasible": [e.to_dict() for e in shown_infeasible],
        }
        if asked is not None:
            report["layout"] = {**asked.to_dict(), "rank": _rank(asked, estimates)}
        print(json.dumps(report, indent=2))
        return
    print(_describe(model, cluster, args, len(feasible), len(estimates)))
    if asked is not None:
        print(_layout_report(asked, estimates))
        return
    print(_table(shown_feasible + shown_infeasible))


def _strategy_options(args: argparse.Namespace) -> dict[str, Any]:
    """The Layout fields the HybridStrategy flags set on every candidate."""
    given = {"compile": args.compile, "offload": args.offload, "loss_parallel": args.loss_parallel,
             "reduce_dtype": args.reduce_dtype}
    return {name: value for name, value in given.items() if value}


def _asked_layout(args: argparse.Namespace, model: ModelShape, cluster: Cluster,
                  options: dict[str, Any]) -> Optional[Estimate]:
    """The estimate of ``--layout`` (the strategy flags added to its own words), or None without it."""
    if args.layout is None:
        return None
    from lightning_hybrid.planner.cost import estimate
    from lightning_hybrid.planner.layout import parse_layout

    layout = replace(parse_layout(args.layout, cluster.gpus), **options)
    return estimate(model, cluster, layout, args.global_batch, args.precision)


def _rank(asked: Estimate, estimates: list[Estimate]) -> Optional[int]:
    from lightning_hybrid.planner.search import rank_of

    return rank_of(asked, estimates)


def _layout_report(asked: Estimate, estimates: list[Estimate]) -> str:
    """One layout's table row, its breakdown line by line, and where it ranks."""
    feasible = [e for e in estimates if e.feasible]
    memory, time = asked.memory, asked.time
    lines = [_table([asked]), "",
             f"Memory on the fullest GPU ({memory.stage} stage): parameters {memory.parameters / GIB:.2f} GiB,"
             f" gradients {memory.gradients / GIB:.2f}, optimizer state {memory.optimizer_state / GIB:.2f},"
             f" gathered parameters {memory.gathered_parameters / GIB:.2f}, activations {memory.activations / GIB:.2f}"
             f" (of which pipeline receive buffers {memory.receive_buffers / GIB:.2f}), logits"
             f" {memory.logits / GIB:.2f}: {memory.total / GIB:.2f} GiB"
             + (f"; in CPU memory {memory.offloaded / GIB:.2f} GiB" if memory.offloaded else ""),
             f"Seconds per step on the busiest rank: compute {time.compute:.3f} (matmuls"
             f" {time.compute - time.memory_bound:.3f}, memory-bound kernels {time.memory_bound:.3f}), tensor parallel"
             f" {time.tensor_parallel:.3f}, pipeline messages {time.pipeline:.3f}, expert all-to-all"
             f" {time.experts:.3f}, context-parallel exchange {time.context:.3f}, bubble {time.bubble:.3f},"
             f" data parallel {time.data_parallel:.3f} ({time.data_parallel_exposed:.3f} exposed), optimizer"
             f" {time.optimizer:.3f}: {time.step:.3f} s, {asked.tokens_per_second:,.0f} tokens/s, MFU {asked.mfu:.1%}"]
    rank = _rank(asked, estimates)
    fastest = f"the fastest, {feasible[0].layout}, takes {feasible[0].time.step:.3f} s" if feasible else "none fits"
    if rank is None:
        lines.append(f"It does not fit ({'; '.join(asked.reasons)}). Of {len(estimates)} layouts {len(feasible)} fit;"
                     f" {fastest}.")
    else:
        lines.append(f"Rank {rank} of {len(feasible)} layouts that fit ({len(estimates)} considered); {fastest}"
                     f" ({time.step / feasible[0].time.step - 1:+.1%} for this one).")
    return "\n".join(lines)


def _model_from(args: argparse.Namespace) -> ModelShape:
    from lightning_hybrid.planner.model import ModelShape

    dimensions_given = args.layers is not None or args.hidden is not None
    ways = [flag for flag, given in (("--params", args.params is not None), ("--module", args.module is not None),
                                     ("--layers/--hidden", dimensions_given)) if given]
    if len(ways) != 1:
        raise ValueError("describe the model one way: --params N --seq-len S, --module package.module:Class"
                         " --heads H --seq-len S, or --layers --hidden --heads --vocab --seq-len"
                         + (f" (got {' and '.join(ways)})" if ways else ""))
    if args.params is not None:
        _refuse_unused(args, "--params (a GPT-3-shaped model)", "--heads", "--kv-heads", "--ffn-hidden", "--gated-mlp",
                       "--tied-embeddings")
        if args.seq_len is None:
            raise ValueError("--params needs --seq-len (activation memory and attention FLOPs depend on it)")
        vocab = {"vocab": args.vocab} if args.vocab else {}
        shape = ModelShape.from_parameter_count(args.params, args.seq_len, **vocab)
    elif args.module is not None:
        _refuse_unused(args, "--module (read from the module)", "--vocab", "--ffn-hidden", "--gated-mlp",
                       "--tied-embeddings")
        kwargs = _json_object(args.module_kwargs)
        _importable_from_here()
        shape = ModelShape.from_module(args.module, kwargs, seq_len=args.seq_len, heads=args.heads,
                                       kv_heads=args.kv_heads)
    else:
        required = {"--layers": args.layers, "--hidden": args.hidden, "--heads": args.heads, "--vocab": args.vocab,
                    "--seq-len": args.seq_len}
        missing = [flag for flag, value in required.items() if value is None]
        if missing:
            raise ValueError(f"a model given by its dimensions also needs {' '.join(missing)}")
        experts = {name: getattr(args, name) for name in ("experts", "experts_per_token", "expert_ffn_hidden",
                                                           "moe_layers", "shared_experts", "parameters_per_block")
                   if getattr(args, name) is not None}
        shape = ModelShape(layers=args.layers, hidden=args.hidden, heads=args.heads, vocab=args.vocab,
                           seq_len=args.seq_len, kv_heads=args.kv_heads, ffn_hidden=args.ffn_hidden,
                           gated_mlp=args.gated_mlp, tied_embeddings=args.tied_embeddings, **experts)
    return replace(shape, dropout=args.dropout, flash_attention=not args.eager_attention,
                   fused_elementwise=args.fused_kernels)


def _refuse_unused(args: argparse.Namespace, way: str, *flags: str) -> None:
    given = [flag for flag in flags if getattr(args, flag[2:].replace("-", "_")) not in (None, False)]
    if given:
        raise ValueError(f"{way} does not use {' '.join(given)}")


def _cluster_from(args: argparse.Namespace) -> Cluster:
    numbers = {"--gpu-memory-gib": ("memory_bytes", args.gpu_memory_gib, GIB),
               "--peak-tflops": ("peak_flops", args.peak_tflops, 1e12),
               "--intra-node-gbps": ("intra_node_bandwidth", args.intra_node_gbps, 1e9),
               "--inter-node-gbps": ("inter_node_bandwidth", args.inter_node_gbps, 1e9)}
    given = {name: value * unit for name, value, unit in numbers.values() if value is not None}
    optional = {"latency": (args.latency_us, 1e-6), "memory_bandwidth": (args.memory_gbps, 1e9),
                "efficiency": (args.efficiency, 1)}
    given.update({name: value * unit for name, (value, unit) in optional.items() if value is not None})
    common = dict(nodes=args.nodes, gpus_per_node=args.gpus_per_node)
    if args.gpu is not None:
        return Cluster.preset(args.gpu, precision=args.precision, **common, **given)
    missing = [flag for flag, (name, _, _) in numbers.items() if name not in given]
    if missing:
        raise ValueError(f"describe the GPUs with --gpu PRESET ({', '.join(GPU_PRESETS)}) or give {' '.join(missing)}")
    return Cluster(**common, **given)


def _describe(model: ModelShape, cluster: Cluster, args: argparse.Namespace, fitting: int, considered: int) -> str:
    mlp = f"ffn {model.ffn_hidden}{' gated' if model.gated_mlp else ''}"
    compute = f"{cluster.peak_flops / 1e12:g} TFLOP/s peak at {cluster.efficiency:.0%} efficiency"
    details = []
    if cluster.streaming_multiprocessors:  # planner/kernels.py: GEMMs by their shapes, attention by its kernel
        attention = cluster.attention_efficiency or cluster.efficiency
        details.append(f"large GEMMs, by their shapes; flash attention at {attention:.0%}")
    elif cluster.memory_bandwidth:
        details.append("matmuls")
    if cluster.memory_bandwidth:
        details.append(f"memory-bound kernels at {cluster.memory_bandwidth / 1e9:g} GB/s")
    compute += f" ({'; '.join(details)})" if details else ""
    return "\n".join([
        f"Model: {model.total_parameters:,} parameters ({model.layers} layers, hidden {model.hidden},"
        f" {model.heads} heads, {model.kv_heads} kv heads, {mlp}, vocab {model.vocab}, sequence {model.seq_len})",
        f"Cluster: {cluster.nodes} × {cluster.gpus_per_node} GPUs of {cluster.memory_bytes / GIB:g} GiB"
        f" ({cluster.usable_memory / GIB:.1f} usable), {compute}, {cluster.intra_node_bandwidth / 1e9:g} GB/s in a"
        f" node, {cluster.inter_node_bandwidth / 1e9:g} GB/s between nodes, {cluster.latency * 1e6:g} µs per message",
        f"Global batch {args.global_batch} sequences, {args.precision}: {fitting} of {considered} layouts fit.",
        "GiB per GPU on the fullest pipeline stage (states: parameters + gradients + AdamW moments; activ.: with"
        " pipeline buffers); seconds per step on the busiest rank (ep: expert all-to-all; cp: context-parallel exchange; dp: exposed data-parallel"
        " traffic; opt: the optimizer step). accN: Trainer(accumulate_grad_batches=N); mN: pipeline microbatches; ac: activation"
        " checkpointing.",
    ])


def _table(estimates: list[Estimate]) -> str:
    header = ["#", "layout", "states", "gathered", "activ.", "logits", "total", "compute", "tp", "pp", "ep", "cp", "dp",
              "bubble", "opt", "step s", "tokens/s", "MFU", "fits"]
    rows = []
    for index, e in enumerate(estimates, 1):
        memory = [e.memory.model_states, e.memory.gathered_parameters, e.memory.activations, e.memory.logits,
                  e.memory.total]
        time = [e.time.compute, e.time.tensor_parallel, e.time.pipeline, e.time.experts, e.time.context,
                e.time.data_parallel_exposed, e.time.bubble, e.time.optimizer, e.time.step]
        rows.append([str(index), str(e.layout)] + [f"{value / GIB:.1f}" for value in memory]
                    + [f"{value:.3f}" for value in time]
                    + [f"{e.tokens_per_second:,.0f}", f"{e.mfu:.1%}"]
                    + ["yes" if e.feasible else "NO: " + "; ".join(e.reasons)])
    widths = [max(len(row[i]) for row in rows + [header]) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(width) if column == 1 else cell.rjust(width)  # the layout left-aligned
                       for column, (cell, width) in enumerate(zip(row, widths))) + "  " + row[-1]
             for row in [header] + rows]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
