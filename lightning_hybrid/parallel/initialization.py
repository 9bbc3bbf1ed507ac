"""Initialize a meta-device model after it is sharded: every rank fills only the shards it keeps, and the result
equals initializing the whole model on one device with the same seed.

How: deterministic per-module initialization. Modules are visited children first (the order Hugging Face's
``initialize_weights`` uses), each under a random seed derived from the run's seed and the module's name in the
LightningModule, and initialized by the first of these that writes any of its tensors:

1. the LightningModule's hook ``init_module_weights(module)``, if it defines one (see below);
2. Hugging Face's ``PreTrainedModel._init_weights(module)`` of the nearest Hugging Face model around it: its
   weights, norms, rotary ``inv_freq`` and ``position_ids`` buffers, and the writes it makes to children (GPT-2
   rescales its blocks' ``c_proj`` from the attention module);
3. the module's own ``reset_parameters()`` (torch's convention), for a module holding parameters or buffers.

An initializer that only fills tensors with random draws and element-wise operations (``normal_``, ``uniform_``,
``zero_``, ``mul_``, … — torch's and Hugging Face's initializers) is replayed on each rank's own shards, drawing a
sharded tensor in chunks of rows and keeping its part (:mod:`~lightning_hybrid.parallel.shard_init`): no full-size
tensor exists. Any other initializer runs on full-size temporary tensors; each rank then copies out the slices its
DTensor shards hold and drops the temporaries. Which tensors an initializer writes is learnt first by running it on
meta-device stand-ins under a dispatch mode that records every aten operator's written arguments — so an
initializer may write anything in its module's subtree, and only what it writes is ever allocated in full. So:

* the values do not depend on the layout, the rank, the pipeline stage or the order modules are visited in —
  dp, tp and pp runs, and a single device calling :func:`init_weights`, produce the same numbers;
* no rank ever holds the whole model: beyond its own shards, a rank holds one chunk of a replayed initializer, or
  the full tensors one other initializer writes (a tensor written by several, such as GPT-2's ``c_proj`` weight,
  stays in full until its last writer), and only for modules of its own pipeline stages;
* nothing is communicated (each rank computes the same full tensor and keeps its part).

Values recorded while the model was built on the meta device (``known``: buffers and constant parameters such
as a norm's ``torch.ones``, see :mod:`lightning_hybrid.parallel.construction`) need no initializer. Any other
tensor no initializer writes is named in an error before training, instead of training on uninitialized memory.

Why not a seed checkpoint (initialize once on one host, save, load sharded)? It needs one host that can hold the
whole model and an extra offline step; per-module seeds need neither. The price: a meta-device model's values
are not the draws an eager ``__init__`` would have made after ``torch.manual_seed(seed)`` (same distributions,
different draws). Models built eagerly in ``__init__`` are not re-initialized: they keep their own values.

The hook, for modules none of the above initializes (or to override them)::

    class MyModule(LightningModule):
        def init_module_weights(self, module: nn.Module) -> None:
            if isinstance(module, MyNorm):   # called for every module, children first, under the module's seed
                nn.init.ones_(module.scale)  # write nothing to leave a module to Hugging Face / reset_parameters()

Example::

    with torch.device("meta"):
        model = GPT(config)
    model.to_empty(device="cpu")
    init_weights(model, seed=42)     # what every HybridStrategy layout gives a meta-device GPT after seed 42
"""

from __future__ import annotations

import contextlib
import sys
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Collection, Iterator, Mapping, Optional, Union

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate
from torch.multiprocessing.reductions import StorageWeakRef

from lightning_hybrid.parallel.shard_init import ReplayRecorder, Write, replay, target_of

#: The LightningModule method :func:`init_weights` calls for every module first (see the module docstring).
HOOK = "init_module_weights"

Slot = tuple[nn.Module, str]  # a module and the attribute name of one of its own parameters or buffers


@dataclass
class _Step:
    """One initializer call: ``run()`` under ``seed`` writes ``writes`` (original tensors, each once)."""

    run: Callable[[], Any]
    seed: int
    slots: list[tuple[Slot, Tensor]]
    writes: list[Tensor]
    replayed: Optional[list[Write]]  # how it writes, if it can be replayed on shards (see shard_init)


def module_seed(seed: int, module_name: str) -> int:
    """The random seed module ``module_name`` is initialized with: a function of the run's seed and the name only,
    so no other module's size or position shifts it."""
    return (seed * 1_000_003 + zlib.crc32(module_name.encode())) % 2**63


@torch.no_grad()
def init_weights(root: nn.Module, seed: int, known: Collection[str] = (), skip: Collection[str] = ()) -> None:
    """Initialize every parameter and buffer under ``root`` per module (see the module docstring), except those
    named in ``known`` that no initializer writes. Works on plain tensors and on sharded DTensors (FSDP2, tensor
    parallel) alike; names are taken relative to ``root``.

    Raises:
        ValueError: naming each tensor (and its module's class) that nothing initializes.
    """
    steps = [step for name, module, owner in _post_order(root) if (step := _plan(root, name, module, owner, seed))]
    if skip:  # tensors loaded afterwards: an initializer writing nothing else is not run
        skipped = {id(t) for name, t in [*root.named_parameters(remove_duplicate=False),
                                         *root.named_buffers(remove_duplicate=False)] if name in skip}
        steps = [step for step in steps if not all(id(t) in skipped for t in step.writes)]
        known = {*known, *skip}
    written = {id(t) for step in steps for t in step.writes}
    missing = [f"{_join(name, key)} ({type(module).__name__})" for name, module, _ in _post_order(root)
               for key, t in _own_tensors(module) if id(t) not in written and _join(name, key) not in known]
    if missing:
        raise ValueError(
            f"The model was created on the meta device, but nothing recreates the initial values of {', '.join(missing)}:"
            f" their modules define no reset_parameters(), no Hugging Face _init_weights writes them, and no"
            f" LightningModule.{HOOK}(module) does. Give these classes a reset_parameters() that initializes their"
            f" own parameters and buffers (as torch.nn.Linear does), define {HOOK} on the LightningModule, or build"
            " the model eagerly in the LightningModule's __init__."
        )
    _keep_full_size_writers_whole(steps)
    last_writer = {id(t): index for index, step in enumerate(steps) for t in step.writes}
    full: dict[int, Tensor] = {}
    for index, step in enumerate(steps):
        if step.replayed is not None:
            _replay_on_shards(step)
            continue
        _run_on_full_tensors(step, full)
        for original in step.writes:
            if last_writer[id(original)] == index and (value := full.pop(id(original))) is not original:
                _local(original).copy_(_keep_local_part(value, original))


def materialize_meta_module(root: nn.Module, device: Union[str, torch.device], seed: int,
                            recorded: Optional[Mapping[str, Callable[[], Tensor]]] = None,
                            skip: Collection[str] = ()) -> bool:
    """Allocate ``root``'s meta-device parameters and buffers (each rank's shards only) on ``device``, give those
    named in ``recorded`` (functions returning full values on the CPU, e.g. from
    :func:`~lightning_hybrid.parallel.construction.recorded_values`) their values and initialize the others with
    :func:`init_weights`. Returns ``False`` (and does nothing) for a model without meta tensors."""
    if not any(t.is_meta for t in _tensors(root)):
        return False
    ties = _tie_groups(root)
    root.to_empty(device=device)
    for (first_module, first_key), *others in ties:  # to_empty gives each slot of a tied tensor its own copy
        for module, key in others:
            setattr(module, key, getattr(first_module, first_key))
    recorded = recorded or {}
    for name, tensor in [*root.named_parameters(), *root.named_buffers()]:
        if name in recorded:
            with torch.no_grad():
                _local(tensor).copy_(_keep_local_part(recorded[name]().to(_local(tensor).device, tensor.dtype), tensor))
    init_weights(root, seed, known=recorded.keys(), skip=skip)
    return True


def _tie_groups(root: nn.Module) -> list[list[Slot]]:
    """The slots of each tensor held in more than one place (tied embeddings), first slot first."""
    groups: dict[int, list[Slot]] = {}
    for slot, tensor in _subtree_slots(root):
        groups.setdefault(id(tensor), []).append(slot)
    return [slots for slots in groups.values() if len(slots) > 1]


def _post_order(root: nn.Module) -> Iterator[tuple[str, nn.Module, Optional[nn.Module]]]:
    """``(name, module, nearest Hugging Face model around or at it)`` for every module, children first."""
    pretrained = getattr(sys.modules.get("transformers"), "PreTrainedModel", ())  # only loaded if a model uses it
    seen: set[int] = set()

    def visit(name: str, module: nn.Module, owner: Optional[nn.Module]) -> Iterator[Any]:
        seen.add(id(module))
        owner = module if pretrained and isinstance(module, pretrained) else owner
        for child_name, child in module.named_children():
            if id(child) not in seen:
                yield from visit(_join(name, child_name), child, owner)
        yield name, module, owner

    yield from visit("", root, None)


def _initializers(root: nn.Module, module: nn.Module, owner: Optional[nn.Module]) -> Iterator[Callable[[], Any]]:
    """The initializers to try for ``module``, in order (see the module docstring)."""
    hook = getattr(root, HOOK, None)
    if callable(hook):
        yield lambda: hook(module)
    if owner is not None:
        yield lambda: owner._init_weights(module)  # Hugging Face's per-module initializer (their convention)
    if _holds_tensors(module) and callable(getattr(module, "reset_parameters", None)):
        yield module.reset_parameters


def _plan(root: nn.Module, name: str, module: nn.Module, owner: Optional[nn.Module], seed: int) -> Optional[_Step]:
    """The first initializer of ``module`` that writes any tensor, with what it writes (found on meta stand-ins)."""
    slots = list(_subtree_slots(module))
    if not slots:
        return None
    seed = module_seed(seed, name)
    for run in _initializers(root, module, owner):
        writes, replayed = _dry_run(run, seed, slots)
        if writes:
            return _Step(run, seed, slots, writes, replayed)
    return None


def _dry_run(run: Callable[[], Any], seed: int, slots: list[tuple[Slot, Tensor]]) -> tuple[list[Tensor], Any]:
    """The original tensors ``run`` writes, and how if it can be replayed on shards (else None), learnt by running
    it on meta-device stand-ins."""
    stand_ins: dict[int, Tensor] = {}
    for _, original in slots:
        stand_ins.setdefault(id(original), _stand_in(original, "meta"))
    originals = {id(original): original for _, original in slots}
    recorder = ReplayRecorder({StorageWeakRef(t.untyped_storage()): originals[key] for key, t in stand_ins.items()})
    with _swapped(slots, stand_ins), _seeded(seed, []), recorder:
        run()
    writes = [originals[key] for key, stand_in in stand_ins.items()
              if StorageWeakRef(stand_in.untyped_storage()) in recorder.storages]
    return writes, recorder.writes


def _keep_full_size_writers_whole(steps: list[_Step]) -> None:
    """A tensor that one initializer writes on full-size temporaries is written so by all its initializers (a later
    one may read what an earlier one wrote): their steps are not replayed."""
    while True:
        full_size = {id(t) for step in steps if step.replayed is None for t in step.writes}
        changed = [step for step in steps
                   if step.replayed is not None and any(id(t) in full_size for t in step.writes)]
        if not changed:
            return
        for step in changed:
            step.replayed = None


def _replay_on_shards(step: _Step) -> None:
    """Replay ``step`` on the parts of its tensors this rank holds; a strided shard is replayed on a full-size
    temporary of its own, then dealt (the same chunks, so the same values)."""
    targets, strided = {}, []
    for original in step.writes:
        target = target_of(original)
        if target is None:
            whole = _stand_in(original, _local(original).device)
            target = target_of(whole)
            strided.append((original, whole))
        targets[id(original)] = target
    with _seeded(step.seed, _cuda_devices(step)):
        replay(step.replayed, targets)
    for original, whole in strided:
        _local(original).copy_(_keep_local_part(whole, original))


@torch.no_grad()
def _run_on_full_tensors(step: _Step, full: dict[int, Tensor]) -> None:
    """Run ``step`` with full-size temporaries in place of the sharded tensors it writes (kept in ``full``, by
    original; a tensor held whole is its own)."""
    for original in step.writes:  # a tensor this rank holds whole is written in place: no temporary copy
        whole = original if not isinstance(original, DTensor) else _stand_in(original, _local(original).device)
        full.setdefault(id(original), whole)
    written = {id(t) for t in step.writes}
    slots = [(slot, original) for slot, original in step.slots if id(original) in written]
    with _swapped(slots, full), _seeded(step.seed, _cuda_devices(step)):
        step.run()


def _cuda_devices(step: _Step) -> list[int]:
    """The GPUs whose random streams ``step`` draws from (seeded with the CPU's)."""
    return [d.index for d in {_local(t).device for t in step.writes} if d.type == "cuda"]


def _stand_in(original: Tensor, device: Union[str, torch.device]) -> Tensor:
    tensor = torch.empty(original.shape, dtype=original.dtype, device=device)
    return nn.Parameter(tensor, original.requires_grad) if isinstance(original, nn.Parameter) else tensor


@contextlib.contextmanager
def _swapped(slots: list[tuple[Slot, Tensor]], replacements: dict[int, Tensor]) -> Iterator[None]:
    """Put ``replacements[id(original)]`` in each slot (setattr replaces a registered parameter or buffer in
    place: same name, same kind), and the originals back afterwards."""
    try:
        for (module, key), original in slots:
            setattr(module, key, replacements[id(original)])
        yield
    finally:
        for (module, key), original in slots:
            setattr(module, key, original)


@contextlib.contextmanager
def _seeded(seed: int, cuda_devices: list[int]) -> Iterator[None]:
    with torch.random.fork_rng(devices=cuda_devices), torch.no_grad():
        torch.manual_seed(seed)
        yield


def _subtree_slots(module: nn.Module) -> Iterator[tuple[Slot, Tensor]]:
    for owner in module.modules():
        for key, tensor in _own_tensors(owner):
            yield (owner, key), tensor


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _tensors(module: nn.Module) -> Iterator[Tensor]:
    yield from module.parameters()
    yield from module.buffers()


def _holds_tensors(module: nn.Module) -> bool:
    return any(True for _ in _own_tensors(module))


def _own_tensors(module: nn.Module) -> Iterator[tuple[str, Tensor]]:
    """The module's own (not its children's) parameters and buffers, by attribute name."""
    yield from module.named_parameters(recurse=False)
    yield from ((key, b) for key, b in module.named_buffers(recurse=False) if b is not None)


def _local(tensor: Tensor) -> Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _keep_local_part(full: Tensor, like: Tensor) -> Tensor:
    """The part of ``full`` that ``like`` holds on this rank (all of it for a plain tensor). Every rank holds the
    same ``full``, so going from replicated to ``like``'s placements only slices locally."""
    if not isinstance(like, DTensor):
        return full
    box = target_of(like)
    if box is not None:  # a view of full, no clone
        return full[tuple(slice(o, o + n) for o, n in zip(box.offset, box.local.shape))]
    mesh = like.device_mesh
    replicated = DTensor.from_local(full, mesh, [Replicate()] * mesh.ndim, run_check=False)
    return replicated.redistribute(mesh, like.placements).to_local()
