"""The token embedding and the language-model head sharded over the vocabulary (tensor parallelism outside the
blocks), found from one traced step, never from names.

At a large vocabulary they are the biggest matrices of the model (128k × 8192 is 1 B parameters each), and whole
on every tensor-parallel rank they make the first and last pipeline stages the memory bottleneck. Sharded:

* the **embedding** row-wise over the vocabulary (torch's ``RowwiseParallel(input_layouts=Replicate())``): each
  rank looks up the tokens of its rows, zeros for the others, and the outputs are all-reduced;
* the **head** column-wise (``ColwiseParallel(output_layouts=Replicate())``): each rank computes the logits of
  its rows and they are all-gathered, so the user's unmodified loss still receives full, plain logits; with
  ``loss_parallel=True`` they stay a DTensor sharded over the vocabulary (``Shard(-1)``), for torch's
  ``loss_parallel()`` (:mod:`lightning_hybrid.tensor_parallel.loss_parallel`);
* a **tied** pair (the head's weight *is* the embedding's) keeps one weight: both styles shard it ``Shard(0)``, so
  one DTensor serves both modules, and every other module that held the old parameter (a bias tied to a masked-LM
  decoder's) is given the new one. Under pipeline parallelism a tied weight lives on the first and the last stage,
  each holding the same shard; the sum of their gradients (:mod:`lightning_hybrid.pipeline.shared`) first lays the
  embedding's out like the weight (DTensor's embedding backward gives it ``Replicate()``, the head's is
  ``Shard(0)``).

Which modules: :func:`find_vocab_layers` reads the setup probe's record of the user's step
(:mod:`lightning_hybrid.probe.record`; on the meta device for a meta-device model): for the ``nn.Embedding`` and
``nn.Linear`` modules outside the blocks, whether they run before or after the blocks and whether any code outside
them reads their parameters (a head computing
``x @ embed.weight.T`` by hand would receive a DTensor it cannot mix with plain tensors). The embedding runs only
before the blocks, the head only after them, and the head's output width is the embedding's vocabulary (or its
weight is the embedding's). Anything ambiguous (two such pairs, a weight read by hand, a vocabulary tp does not
divide) stays whole, as before, with the reason logged.

Example::

    layers = find_vocab_layers(module, blocks, probe.record(), tp=2, tp_plan={})
    layers.embedding, layers.head, layers.tied     # "model.tok_emb", "model.head", False
    shard_vocab_layers(module, layers, mesh["tp"])  # {"model.tok_emb": "rowwise (vocab)", "model.head": ...}
    shard_vocab_layers(module, layers, mesh["tp"], keep_logits_sharded=True)  # head: "colwise (vocab, logits sharded)"
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Collection, Mapping, Optional

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module

from lightning_hybrid.probe.blocks import BlockList
from lightning_hybrid.probe.record import AFTER, BEFORE, SetupRecord
from lightning_hybrid.tensor_parallel.overrides import PlanEntry, resolve_overrides

@dataclass(frozen=True)
class VocabLayers:
    """What :func:`find_vocab_layers` found: the module names to shard (``None``: kept whole) and why any is
    kept whole (``""`` when both are sharded)."""

    embedding: Optional[str] = None
    head: Optional[str] = None
    tied: bool = False
    reason: str = ""


def find_vocab_layers(root: nn.Module, blocks: BlockList, record: SetupRecord, tp: int,
                      tp_plan: Mapping[str, PlanEntry]) -> VocabLayers:
    """The token embedding and the head of ``root`` that can be sharded over ``tp`` ranks, from the setup probe's
    ``record`` of the user's step on the first batch; modules the user's ``tp_plan`` names (or that contain or lie
    inside one it names) are the user's."""
    names = [name for name, _ in root.named_modules()]
    users = tuple(resolve_overrides(tp_plan, names))
    exclude = {name for name in names for user in users
               if name == user or name.startswith(user + ".") or user.startswith(name + ".")}
    candidates = _candidates(root, blocks, exclude)
    if not candidates:
        return VocabLayers(reason="no nn.Embedding or nn.Linear outside the blocks")
    read_outside = _read_outside(candidates, record)

    def only(name: str, phase: str) -> bool:
        return record.module_phases.get(name) == {phase} and name not in read_outside

    embeddings = [name for name, m in candidates.items() if isinstance(m, nn.Embedding) and only(name, BEFORE)]
    heads = [name for name, m in candidates.items() if isinstance(m, nn.Linear) and only(name, AFTER)]
    layers = _pair(candidates, embeddings, heads, tp, record.largest_first_input)
    unproven = _embeddings_with_own_forward(root, blocks, exclude)
    if layers.embedding is None and unproven:
        return replace(layers, reason=f"{layers.reason}; not considered: {', '.join(unproven)}, an nn.Embedding"
                       " subclass with a forward of its own, which the vocabulary-sharded lookup is not proven for")
    return layers


def _embeddings_with_own_forward(root: nn.Module, blocks: BlockList, exclude: Collection[str]) -> list[str]:
    """``'name' (Class)`` of each ``nn.Embedding`` subclass with its own forward outside the blocks (Gemma's scaled
    word embedding): why no token embedding was found, where one is."""
    return [f"'{name}' ({type(module).__name__})" for name, module in _outside_blocks(root, blocks, exclude)
            if isinstance(module, nn.Embedding) and type(module).forward is not nn.Embedding.forward]


def _outside_blocks(root: nn.Module, blocks: BlockList, exclude: Collection[str]) -> list[tuple[str, nn.Module]]:
    inside = {id(m) for m in blocks.modules()}
    return [(name, module) for name, module in root.named_modules() if id(module) not in inside and name not in exclude]


def _read_outside(candidates: dict[str, nn.Module], record: SetupRecord) -> set[str]:
    """Candidates whose parameters some code read while no module holding that parameter was the one running (a
    head computing ``x @ embed.weight.T`` by hand would receive a DTensor it cannot mix with plain tensors)."""
    holders: dict[int, set[str]] = {}
    for name, module in candidates.items():
        for parameter in module.parameters():
            holders.setdefault(id(parameter), set()).add(name)
    outside: set[str] = set()
    for name, module in candidates.items():
        for attribute, parameter in module.named_parameters():
            if record.parameter_readers.get(f"{name}.{attribute}", set()) - holders[id(parameter)]:
                outside.update(holders[id(parameter)])
    return outside


def _candidates(root: nn.Module, blocks: BlockList, exclude: Collection[str]) -> dict[str, nn.Module]:
    """Plain ``nn.Embedding`` / ``nn.Linear`` modules outside the blocks (a subclass with its own forward may use
    its weight in ways the styles do not shard)."""
    plain = {nn.Embedding: nn.Embedding.forward, nn.Linear: nn.Linear.forward}
    return {name: module for name, module in _outside_blocks(root, blocks, exclude)
            if any(isinstance(module, kind) and type(module).forward is forward for kind, forward in plain.items())}


def _pair(candidates: dict[str, nn.Module], embeddings: list[str], heads: list[str], tp: int,
          lookups: dict[str, int]) -> VocabLayers:
    """The one embedding/head pair (tied, or the head's width = the vocabulary), or the only embedding alone.
    Of embeddings that match one head equally, the one looking up the most indices per call is the token
    embedding (the batch's tokens, not a position table read with one ``arange`` for every sequence)."""
    pairs = [(e, h) for e in embeddings for h in heads
             if candidates[h].weight is candidates[e].weight
             or candidates[h].out_features == candidates[e].num_embeddings]
    most = max((lookups.get(e, 0) for e, _ in pairs), default=0)
    if sum(lookups.get(e, 0) == most for e, _ in pairs) == 1:
        pairs = [(e, h) for e, h in pairs if lookups.get(e, 0) == most]
    if len(pairs) > 1:
        return VocabLayers(reason=f"several embedding/head pairs {pairs}: which is the vocabulary is ambiguous")
    if pairs:
        embedding, head = pairs[0]
    elif len(embeddings) == 1:
        embedding, head = embeddings[0], None
    else:
        found = embeddings or "none"
        return VocabLayers(reason=f"no head of the vocabulary's width after the blocks, and embeddings {found}")
    vocab = candidates[embedding].num_embeddings
    if vocab % tp:
        return VocabLayers(reason=f"tp={tp} does not divide the vocabulary of '{embedding}' ({vocab})")
    unsupported = _unsupported_embedding(candidates[embedding])
    if unsupported:
        return VocabLayers(reason=f"'{embedding}' uses {unsupported}")
    tied = head is not None and candidates[head].weight is candidates[embedding].weight
    return VocabLayers(embedding, head, tied, "" if head else "no head of the vocabulary's width after the blocks")


def _unsupported_embedding(embedding: nn.Embedding) -> str:
    # max_norm renormalizes rows of the weight in place during the lookup, sparse gradients are not DTensors, and
    # scale_grad_by_freq counts tokens over the whole vocabulary: none is what the sharded lookup computes.
    options = {"max_norm": embedding.max_norm is not None, "sparse": embedding.sparse,
               "scale_grad_by_freq": embedding.scale_grad_by_freq}
    return ", ".join(name for name, used in options.items() if used)


def shard_vocab_layers(root: nn.Module, layers: VocabLayers, mesh: DeviceMesh,
                       keep_logits_sharded: bool = False) -> dict[str, str]:
    """Shard ``layers``' head column-wise (logits gathered, or with ``keep_logits_sharded`` a DTensor sharded on
    their last dimension) and embedding row-wise over the vocabulary on the tensor mesh, keeping tied parameters
    tied; returns ``{module name: style}`` for the applied plan."""
    applied: dict[str, str] = {}
    if layers.head is not None:  # first: a tied embedding then finds its weight already Shard(0)
        head_style = (ColwiseParallel(output_layouts=Shard(-1), use_local_output=False) if keep_logits_sharded
                      else ColwiseParallel(output_layouts=Replicate()))
        _parallelize_keeping_ties(root, layers.head, mesh, head_style)
        logits = "sharded" if keep_logits_sharded else "gathered"
        applied[layers.head] = f"colwise (vocab, logits {logits})" + (" tied" if layers.tied else "")
    if layers.embedding is not None:
        _parallelize_keeping_ties(root, layers.embedding, mesh, RowwiseParallel(input_layouts=Replicate()))
        applied[layers.embedding] = "rowwise (vocab)" + (" tied" if layers.tied else "")
        for name in _lookups_sharing(root, layers.embedding):
            _look_up_shared_weight(root.get_submodule(name), root.get_submodule(layers.embedding).weight, mesh)
            applied[name] = "rowwise (vocab) tied"
    return applied


def _lookups_sharing(root: nn.Module, embedding: str) -> list[str]:
    """Other ``nn.Embedding`` modules holding ``embedding``'s weight (an encoder-decoder's ``encoder.embed_tokens``
    and ``decoder.embed_tokens``, tied to ``shared``): they look up the same, now sharded, table."""
    weight = root.get_submodule(embedding).weight
    return [name for name, module in root.named_modules() if name != embedding and isinstance(module, nn.Embedding)
            and type(module).forward is nn.Embedding.forward and module.weight is weight]


def _look_up_shared_weight(module: nn.Module, weight: nn.Parameter, mesh: DeviceMesh) -> None:
    """Make ``module`` look up its rows of the sharded ``weight`` as the embedding does (the style's hooks), the
    parameter kept the one the tied modules share (the style wraps it anew)."""
    parallelize_module(module, mesh, RowwiseParallel(input_layouts=Replicate()))
    module.weight = weight


def _parallelize_keeping_ties(root: nn.Module, name: str, mesh: DeviceMesh, style: ParallelStyle) -> None:
    """Apply ``style`` to module ``name``; every module that held one of its replaced parameters gets the new one."""
    module = root.get_submodule(name)
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for holder in root.modules():
        for attribute, parameter in holder.named_parameters(recurse=False, remove_duplicate=False):
            holders.setdefault(id(parameter), []).append((holder, attribute))
    before = dict(module.named_parameters(recurse=False))
    parallelize_module(module, mesh, style)
    for attribute, old in before.items():
        new = getattr(module, attribute)
        for holder, held_as in holders.get(id(old), []):
            setattr(holder, held_as, new)
