"""The setup probe's record: what one run of the user's step shows about the model, taken once for every part of
the strategy that plans from it.

:func:`record_step` runs the step once (gradients off) under forward hooks on the blocks and on every module
outside them, a FLOP counter, and a ``TorchFunctionMode`` that notes each parameter (and block output) a torch function reads. It
records, in one :class:`SetupRecord`:

* what the first block of each block structure is called with (tensor-parallel planning and its check, the auto
  layout's model measurement), and which of its outputs the step goes on to compute with (a decoder layer
  returning its attention probabilities next to the hidden states, which the model drops);
* the phase (before, between, after the blocks) in which every module outside the blocks runs, and the largest
  first argument it is given (the vocabulary search: an embedding reading the batch's tokens);
* every parameter outside the blocks: the phases it is read in and the module running when it is read (the stage
  split places a weight tied to another module, or a table the model holds itself, where it is read; the
  vocabulary search keeps whole a weight that code outside its module reads);
* each block's FLOPs and the FLOPs before and after the blocks (the stage split's balance), how often each block
  ran, and how every unit's output shapes follow its inputs (:mod:`.shapes`, the pipeline's stand-ins).

How the step is run — which batch, converted how, isolated from the run's random streams and buffers — is the
caller's (:class:`~lightning_hybrid.probe.step_probe.StepProbe`).

Example::

    record = record_step(lightning_module, blocks, run_step=lambda: lightning_module.training_step(batch, 0))
    args, kwargs = record.block_calls[0]                 # the first block's inputs
    record.outer_calls["model.tok_embeddings"]           # {"before the blocks"}
    record.parameter_reads["model.output.weight"]        # {"after the blocks"}
"""

from __future__ import annotations

import contextlib
import copy
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Mapping, Optional

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_hybrid._compat import total_flop_counter, tree_leaves, tree_map
from lightning_hybrid.probe.blocks import BlockList, block_structures
from lightning_hybrid.probe.meta_step import meta_step
from lightning_hybrid.probe.shapes import UnitShapes, describe_call, output_spec

BEFORE, TRUNK, AFTER = "before the blocks", "between blocks", "after the blocks"
#: A block's call: its positional and keyword arguments.
BlockCall = tuple[tuple, dict]


@dataclass
class SetupRecord:
    """What one run of the step did, as seen from its blocks and the modules around them."""

    #: Block index → the call it received (tensors cloned, other values copied where they can be), for the first
    #: block of each block structure.
    block_calls: dict[int, BlockCall]
    #: How many times each block ran.
    block_runs: list[int]
    block_flops: list[float]
    flops_before: float
    flops_after: float
    #: Every module outside the blocks (that does not contain them) → the phases it was called in.
    module_phases: dict[str, set[str]]
    #: Such a module → the most elements of a tensor it was given as its first argument in one call.
    largest_first_input: dict[str, int]
    #: Every name of every parameter outside the blocks (a tied weight has several) → the phases it was read in.
    parameter_reads: dict[str, set[str]]
    #: The same names → the modules outside the blocks running innermost when it was read (``""``: none, e.g. the
    #: LightningModule's own code).
    parameter_readers: dict[str, set[str]]
    #: The largest modules outside the blocks that hold parameters: the units a pipeline places besides the blocks.
    outer_units: list[str]
    #: Parameters held directly by a module that also contains the blocks (e.g. a ``pos_embed`` tensor).
    direct_parameters: list[str]
    #: A module inside a block that the step calls from outside any block (diffusers' DiT calls
    #: ``transformer_blocks[0].norm1.emb`` after the trunk) → the phases it was called in (outermost such calls).
    block_module_calls: dict[str, set[str]] = field(default_factory=dict)
    #: How every unit's (block or outer unit) output shapes follow its input shapes, from the calls seen.
    outputs: UnitShapes = field(default_factory=UnitShapes)
    #: For the blocks of ``block_calls``: which leaves of the output (``tree_flatten`` order) the step computed
    #: with afterwards.
    block_outputs_used: dict[int, tuple[bool, ...]] = field(default_factory=dict)

    @property
    def outer_calls(self) -> dict[str, set[str]]:
        """Each outer unit → the phases it was called in."""
        return {name: self.module_phases[name] for name in self.outer_units}


def record_step(root: nn.Module, blocks: BlockList, run_step: Callable[[], Any],
                capture: Optional[Collection[int]] = None) -> SetupRecord:
    """Run ``run_step`` once (gradients off) and return what it showed (see the module docstring). ``capture``: the
    blocks whose calls to keep (default: the first block of each structure)."""
    if capture is None:
        capture = [indices[0] for indices in block_structures(blocks)] if len(blocks) else []
    units, direct = outer_modules(root, blocks)
    recorder = _Recorder(root, blocks, units, set(capture))
    handles = recorder.attach()
    on_meta = meta_step() if any(p.is_meta for p in root.parameters()) else contextlib.nullcontext()
    try:
        with torch.no_grad(), recorder.counter, TensorUses(recorder.note_use), on_meta:
            run_step()
    finally:
        for handle in handles:
            handle.remove()
    return recorder.record(list(units), direct)


def first_block_call(record: SetupRecord) -> BlockCall:
    """The first block's call (tensor-parallel planning and the auto layout read it)."""
    return block_call(record.block_calls, 0)


def block_call(calls: Mapping[int, BlockCall], index: int) -> BlockCall:
    """Block ``index``'s call among the recorded ``calls`` (the first block of each structure); an error naming the
    fix if the step never called it."""
    if index not in calls:
        raise RuntimeError(
            f"The model's step never called its block {index}, so its inputs are unknown. Tensor-parallel planning"
            " needs one call of the first block of each block structure; pass HybridStrategy(blocks=...) to name"
            " the block list the forward actually uses."
        )
    return calls[index]


def outer_modules(root: nn.Module, blocks: BlockList) -> tuple[dict[str, nn.Module], list[str]]:
    """Largest submodules with parameters that do not contain the blocks, and parameters held directly by the
    modules that do (the path from the root down to the block list)."""
    found: dict[str, nn.Module] = {}
    direct: list[str] = []

    def visit(module: nn.Module, prefix: str) -> None:
        direct.extend(prefix + name for name, _ in module.named_parameters(recurse=False))
        for name, child in module.named_children():
            if blocks.is_container(child):
                continue
            if any(blocks.is_container(m) for m in child.modules()):
                visit(child, f"{prefix}{name}.")
            elif any(True for _ in child.parameters()):
                found[prefix + name] = child

    visit(root, "")
    return found, direct


class TensorUses(TorchFunctionMode):
    """Calls ``on_use(tensor)`` for every tensor (parameters included) a torch function computes a tensor from while
    the mode is active. Only uses that compute a tensor count: reading metadata (``p.dtype``, ``p.numel()``) is not."""

    def __init__(self, on_use: Callable[[torch.Tensor], None]) -> None:
        super().__init__()
        self._on_use = on_use

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        result = func(*args, **(kwargs or {}))
        if any(isinstance(v, torch.Tensor) for v in tree_leaves(result)):
            for value in tree_leaves((args, kwargs or {})):
                if isinstance(value, torch.Tensor):
                    self._on_use(value)
        return result


def kept_call(args: tuple, kwargs: dict) -> BlockCall:
    """A block call as it was when the block was entered: tensors detached and cloned (later code may write to them
    in place), other values copied where they can be (a key/value cache the later blocks fill), else kept."""
    def keep(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.detach().clone()
        try:
            return copy.deepcopy(value)
        except Exception:  # noqa: BLE001 - an object that cannot be copied is kept as it is
            return value

    return tree_map(keep, (args, kwargs))


class _Recorder:
    """The hooks of one recorded step: the phase it is in, the modules running outside the blocks, and every
    figure :class:`SetupRecord` holds."""

    def __init__(self, root: nn.Module, blocks: BlockList, units: dict[str, nn.Module], capture: set[int]) -> None:
        self.blocks, self.units, self.capture = blocks, units, capture
        inside = {id(m) for m in blocks.modules()}
        # Modules that hold parameters: the units, the vocabulary's candidates, whatever may read a weight. Not a
        # torchmetrics metric, which its own code copies (deep copies reach this recorder through the hooks).
        self.outside = {name: m for name, m in root.named_modules() if id(m) not in inside
                        and not any(blocks.is_container(c) for c in m.modules()) and any(True for _ in m.parameters())}
        self.names_of = _parameter_names(root, inside)
        self.phase = BEFORE
        self.running: list[str] = []
        self.copying = False
        self.block_calls: dict[int, BlockCall] = {}
        self.block_runs = [0] * len(blocks)
        self.block_flops = [0.0] * len(blocks)
        self.module_phases: dict[str, set[str]] = {name: set() for name in self.outside}
        self.first_inputs: dict[str, int] = {}
        self.reads: dict[str, set[str]] = {}
        self.readers: dict[str, set[str]] = {}
        self.counter = total_flop_counter()
        self.marks: dict[str, float] = {}
        self.outputs = UnitShapes()
        self.blocks_running = 0
        self.called_from_outside: dict[str, set[str]] = {}
        self.outside_call: Optional[str] = None  # the block module called from outside that is running
        # The captured blocks' output tensors (kept alive, so that their ids stay theirs) → (block, leaf index).
        self.block_outputs: dict[int, tuple[int, int, torch.Tensor]] = {}
        self.outputs_used: dict[int, list[bool]] = {}

    def __deepcopy__(self, memo: dict) -> "_Recorder":
        # A hooked module the step deep-copies (an EMA copy, a metric's clone) copies its hooks: they share this
        # recorder instead of copying it, and with it the whole model.
        return self

    def attach(self) -> list[Any]:
        handles = []
        for index, block in enumerate(self.blocks):
            handles.append(block.register_forward_pre_hook(functools.partial(self._block_started, index),
                                                           with_kwargs=True))
            handles.append(block.register_forward_hook(functools.partial(self._block_finished, index)))
            handles.append(self._record_outputs(self.blocks.name(index), block))
            handles.extend(self._watch_block_modules(self.blocks.name(index), block))
        for name, module in self.outside.items():
            handles.append(module.register_forward_pre_hook(functools.partial(self._entered, name)))
            handles.append(module.register_forward_hook(self._left))
        handles.extend(self._record_outputs(name, module) for name, module in self.units.items())
        return handles

    def _record_outputs(self, name: str, module: nn.Module) -> Any:
        def record(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
            self.outputs.observe(name, describe_call(args, kwargs), output_spec(output))

        return module.register_forward_hook(record, with_kwargs=True)

    def _watch_block_modules(self, block_name: str, block: nn.Module) -> list[Any]:
        """Hooks noting a module of the block called while no block runs (outermost calls only)."""
        def entered(name: str, module: nn.Module, args: tuple) -> None:
            if self.blocks_running == 0 and self.outside_call is None:
                self.outside_call = name
                self.called_from_outside.setdefault(name, set()).add(self.phase)

        def left(name: str, *_: Any) -> None:
            if self.outside_call == name:
                self.outside_call = None

        handles = []
        for relative, module in block.named_modules():
            if relative and any(True for _ in module.parameters()):
                name = f"{block_name}.{relative}"
                handles.append(module.register_forward_pre_hook(functools.partial(entered, name)))
                handles.append(module.register_forward_hook(functools.partial(left, name)))
        return handles

    def _block_started(self, index: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if index in self.capture and index not in self.block_calls:
            self.copying = True  # copying a value that holds weights reads them for no step's sake
            try:
                self.block_calls[index] = kept_call(args, kwargs)
            finally:
                self.copying = False
        self.block_runs[index] += 1
        self.blocks_running += 1
        self.phase = TRUNK
        self.marks["block"] = self.counter.get_total_flops()
        if index == 0:
            self.marks["trunk"] = self.marks["block"]

    def _block_finished(self, index: int, module: nn.Module, args: Any, output: Any) -> None:
        if index in self.capture and index not in self.outputs_used:
            leaves = tree_leaves(output)
            self.outputs_used[index] = [False] * len(leaves)
            self.block_outputs.update({id(leaf): (index, position, leaf) for position, leaf in enumerate(leaves)
                                       if isinstance(leaf, torch.Tensor)})
        self.blocks_running -= 1
        self.block_flops[index] += self.counter.get_total_flops() - self.marks["block"]
        if index == len(self.blocks) - 1:
            self.phase = AFTER
            self.marks["after"] = self.counter.get_total_flops()

    def _entered(self, name: str, module: nn.Module, args: tuple) -> None:
        self.module_phases[name].add(self.phase)
        self.running.append(name)
        if args and isinstance(args[0], torch.Tensor):
            self.first_inputs[name] = max(self.first_inputs.get(name, 0), args[0].numel())

    def _left(self, *_: Any) -> None:  # returns None: a forward hook's result would replace the module's output
        self.running.pop()

    def note_use(self, tensor: torch.Tensor) -> None:
        """A torch function computed with ``tensor``: a parameter read (:meth:`note_read`), or a captured block's
        output used."""
        if self.copying:
            return
        if isinstance(tensor, nn.Parameter):
            self.note_read(tensor)
        elif id(tensor) in self.block_outputs:
            index, position, _ = self.block_outputs[id(tensor)]
            self.outputs_used[index][position] = True

    def note_read(self, parameter: nn.Parameter) -> None:
        """A torch function used ``parameter``: the phase and the running module, under each of its names."""
        reader = self.running[-1] if self.running else ""
        for name in self.names_of.get(id(parameter), ()):
            self.reads.setdefault(name, set()).add(self.phase)
            self.readers.setdefault(name, set()).add(reader)

    def record(self, units: list[str], direct: list[str]) -> SetupRecord:
        total = self.counter.get_total_flops()
        names = [name for aliases in self.names_of.values() for name in aliases]
        return SetupRecord(
            block_calls=self.block_calls, block_runs=self.block_runs, block_flops=self.block_flops,
            flops_before=self.marks.get("trunk", 0.0), flops_after=total - self.marks.get("after", total),
            module_phases=self.module_phases, largest_first_input=self.first_inputs,
            parameter_reads={name: self.reads.get(name, set()) for name in names},
            parameter_readers={name: self.readers.get(name, set()) for name in names},
            outer_units=units, direct_parameters=direct, outputs=self.outputs,
            block_module_calls=self.called_from_outside,
            block_outputs_used={index: tuple(used) for index, used in self.outputs_used.items()},
        )


def _parameter_names(root: nn.Module, inside: set[int]) -> dict[int, list[str]]:
    """``id(parameter)`` → every name of it held outside the blocks (``inside``: the ids of the blocks' modules): by
    a module outside them, or directly by a module that contains them (tied weights have several names)."""
    names: dict[int, list[str]] = {}
    for module_name, module in root.named_modules():
        if id(module) in inside:
            continue
        for name, parameter in module.named_parameters(recurse=False, remove_duplicate=False):
            names.setdefault(id(parameter), []).append(f"{module_name}.{name}" if module_name else name)
    return names
