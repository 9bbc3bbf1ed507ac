"""One traced step of the model: what runs before, between and after its blocks, what each block costs, which
parameters are read where, and how every unit's output shapes follow its inputs (:mod:`.shapes`) — the facts the
stage split (:mod:`lightning_hybrid.pipeline.split`) and the stand-ins (:mod:`lightning_hybrid.pipeline.dispatch`)
are built from.

The step runs once for real (gradients off) under forward hooks on the blocks and on every module outside them
that holds parameters, a FLOP counter, and a ``TorchFunctionMode`` that notes each parameter a torch function
reads — how a weight tied to another module, or a table held by the model itself, shows where it is used.

Example::

    trace = trace_step(lightning_module, blocks, run_step=lambda: lightning_module.training_step(batch, 0))
    trace.outer_calls["model.tok_embeddings"]        # {"before the blocks"}
    trace.parameter_reads["model.output.weight"]     # {"after the blocks"}
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from lightning_hybrid.parallel.blocks import BlockList
from lightning_hybrid.parallel.dataflow import ParameterUses
from lightning_hybrid.pipeline.shapes import UnitShapes, describe_call, output_spec

BEFORE, TRUNK, AFTER = "before the blocks", "between blocks", "after the blocks"


@dataclass
class StepTrace:
    """What one step of the model did, as seen from its blocks and the modules around them."""

    block_flops: list[float]
    flops_before: float
    flops_after: float
    #: Every module outside the blocks that holds parameters (the largest such modules) → the phases it was called in.
    outer_calls: dict[str, set[str]]
    #: Every name of every parameter outside the blocks (a tied weight has several) → the phases it was read in.
    parameter_reads: dict[str, set[str]]
    #: Parameters held directly by a module that also contains the blocks (e.g. a ``pos_embed`` tensor).
    direct_parameters: list[str]
    #: How every unit's (block or outer module) output shapes follow its input shapes, from the calls traced.
    outputs: UnitShapes


def outer_modules(root: nn.Module, blocks: BlockList) -> tuple[dict[str, nn.Module], list[str]]:
    """Largest submodules with parameters that do not contain the blocks, and parameters held directly by the
    modules that do (the path from the root down to the block list)."""
    found: dict[str, nn.Module] = {}
    direct: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        direct.extend(prefix + name for name, _ in module.named_parameters(recurse=False))
        for name, child in module.named_children():
            if child is blocks.container:
                continue
            if any(m is blocks.container for m in child.modules()):
                visit(child, f"{prefix}{name}.")
            elif any(True for _ in child.parameters()):
                found[prefix + name] = child

    visit(root, "")
    return found, direct


def trace_step(root: nn.Module, blocks: BlockList, run_step: Callable[[], Any]) -> StepTrace:
    """Run ``run_step`` once (gradients off) and record what :class:`StepTrace` holds."""
    outer, direct = outer_modules(root, blocks)
    watch = _StepWatch(blocks, outer)
    names_of = _parameter_names(root, outer, direct)
    handles = watch.attach()
    try:
        with torch.no_grad(), watch.counter, ParameterUses(functools.partial(watch.note_read, names_of)):
            run_step()
    finally:
        for handle in handles:
            handle.remove()
    _check_block_calls(watch.calls)
    total = watch.counter.get_total_flops()
    return StepTrace(
        block_flops=watch.block_flops,
        flops_before=watch.marks.get("trunk", 0.0),
        flops_after=total - watch.marks.get("after", total),
        outer_calls=watch.calls_of,
        parameter_reads={name: watch.reads.get(name, set()) for names in names_of.values() for name in names},
        direct_parameters=direct,
        outputs=watch.outputs,
    )


def _parameter_names(root: nn.Module, outer: dict[str, nn.Module], direct: list[str]) -> dict[int, list[str]]:
    """``id(parameter)`` → every name it has among the outer modules' and the direct parameters (tied weights have
    several)."""
    names: dict[int, list[str]] = {}
    for module_name, module in outer.items():
        for name, parameter in module.named_parameters(remove_duplicate=False):
            names.setdefault(id(parameter), []).append(f"{module_name}.{name}")
    for name in direct:
        names.setdefault(id(root.get_parameter(name)), []).append(name)
    return names


class _StepWatch:
    """Forward hooks that follow one traced step: its phase (before, between, after the blocks), each block's calls
    and FLOPs, the phases in which each outer module runs, and what every unit returns."""

    def __init__(self, blocks: BlockList, outer: dict[str, nn.Module]) -> None:
        self.blocks, self.outer = blocks, outer
        self.phase = BEFORE
        self.calls_of: dict[str, set[str]] = {name: set() for name in outer}
        self.reads: dict[str, set[str]] = {}
        self.calls = [0] * len(blocks)
        self.block_flops = [0.0] * len(blocks)
        self.counter = FlopCounterMode(display=False)
        self.marks: dict[str, float] = {}
        self.outputs = UnitShapes()

    def attach(self) -> list[Any]:
        handles = []
        for index, block in enumerate(self.blocks):
            handles.append(block.register_forward_pre_hook(functools.partial(self._block_started, index)))
            handles.append(block.register_forward_hook(functools.partial(self._block_finished, index)))
            handles.append(self._record_outputs(self.blocks.name(index), block))
        for name, module in self.outer.items():
            handles.append(module.register_forward_pre_hook(functools.partial(self._outer_called, name)))
            handles.append(self._record_outputs(name, module))
        return handles

    def _record_outputs(self, name: str, module: nn.Module) -> Any:
        def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            self.outputs.observe(name, describe_call(args, kwargs), output_spec(output))

        return module.register_forward_hook(record, with_kwargs=True)

    def _block_started(self, index: int, module: nn.Module, args: Any) -> None:
        self.calls[index] += 1
        self.phase = TRUNK
        self.marks["block"] = self.counter.get_total_flops()
        if index == 0:
            self.marks["trunk"] = self.marks["block"]

    def _block_finished(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        self.block_flops[index] += self.counter.get_total_flops() - self.marks["block"]
        if index == len(self.blocks) - 1:
            self.phase = AFTER
            self.marks["after"] = self.counter.get_total_flops()

    def _outer_called(self, name: str, module: nn.Module, args: Any) -> None:
        self.calls_of[name].add(self.phase)

    def note_read(self, names_of: dict[int, list[str]], parameter: nn.Parameter) -> None:
        """A torch function used ``parameter``: the phase it happened in, under each of its names."""
        for name in names_of.get(id(parameter), ()):
            self.reads.setdefault(name, set()).add(self.phase)


def _check_block_calls(calls: list[int]) -> None:
    wrong = {index: count for index, count in enumerate(calls) if count != 1}
    if wrong:
        raise ValueError(
            "Pipeline parallelism cuts the model between its blocks, so each block must run exactly once per step;"
            f" in the traced step these blocks ran a different number of times (block: calls): {wrong}. Point"
            " HybridStrategy(blocks=...) at a block list whose blocks each run once, or use pp=1."
        )
