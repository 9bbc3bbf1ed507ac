"""The pipeline verified before training: the pipelined step on the first batch against the unsplit step.

Cutting an unmodified model into stages rests on what one recorded step showed (:mod:`.split`,
:mod:`.dispatch`): which modules run where, what crosses each boundary. A model whose step does something the
record cannot show — a value computed from another stage's output outside any block call, code that reads a
stand-in's values — would train to wrong numbers without any error. So, as the tensor-parallel plan is checked,
the whole pipeline is checked at setup, before any optimizer step, on the batch training starts with:

1. :func:`unsplit_step`, before the split: the user's step on the whole batch with the whole model (the setup
   probe's, isolated) — its loss and the gradients of the parameters this rank's stages will hold; and the same
   step's loss over the schedule's microbatches (forward only). When those two losses differ, microbatching
   itself changes the step (BatchNorm's batch statistics, a loss that couples a batch's samples): the model is
   named at setup with what to do, before anything is split.
2. :func:`check_pipeline`, after every parallelism is applied: one pipelined step on the same batch (all
   microbatches, forward and backward, its logs and metric calls dropped, random streams and buffers restored);
   its loss and every gradient are compared with the unsplit step's, over all ranks. A difference stops the run
   on every rank with one message naming the stage and the value.
3. :func:`check_stand_ins`, also where no unsplit step exists (a meta-device model, pretrained weights loaded
   into the shards): the pipelined step once more with NaN in everything that stands in for another stage's
   units. A correct split never computes with a stand-in (what a stage needs from earlier stages arrives in its
   messages), so its loss and gradients stay finite; a stage whose step reads a value that does not reach it
   turns NaN, whatever the weights (a zero-initialized gate would hide a zero stand-in from step 2, not NaN).
4. :func:`check_regrouped`, only where no unsplit step exists (it replaces step 1's microbatching check): the
   pipelined step on the same batch with its samples dealt to other microbatches. A step on independent samples
   gives the same loss however they are grouped; BatchNorm's statistics or a loss coupling a microbatch's samples
   give another. Microbatches of one sample cannot be regrouped: there the check is skipped, and says so.

Dropout is switched off in both runs (each stage draws its own masks: :class:`NoDropout`). The cost (one unsplit
step with its backward, one forward per microbatch, one pipelined step) is logged; ``verify_pipeline=False``
turns the check off.

Example::

    reference = unsplit_step(probe, split, stage_ids, accumulation=1, microbatches=4)   # before the split
    ...                                                                                # every parallelism applied
    check_pipeline(pipeline, probe, reference, data_group=None, tolerance=1e-4)
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Collection, Mapping, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.overrides import TorchFunctionMode

from lightning_hybrid.pipeline.microbatches import counting_loss_terms, regrouped, samples, split_microbatches
from lightning_hybrid.pipeline.split import StageSplit
from lightning_hybrid.probe.step_probe import StepProbe

_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout, torch.dropout,
             torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout}


def tolerance(precision: str) -> float:
    """The relative difference a correct pipeline stays under at Lightning's ``precision``: microbatch sums taken
    in another order (32 and 64 bit), or rounded in a 16-bit compute dtype."""
    return 1e-4 if precision.startswith(("32", "64")) else 5e-2


class PipelineMismatch(RuntimeError):
    """The pipelined step computes another loss or other gradients than the unsplit step."""


class NoDropout(TorchFunctionMode):
    """Every dropout an identity and attention's ``dropout_p`` zero: runs that draw their masks in another order
    (each pipeline stage from its own rank's generator) compute the same numbers."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _DROPOUTS:
            return args[0] if args else kwargs["input"]
        if func is F.scaled_dot_product_attention:
            if len(args) > 4:  # dropout_p is the fifth positional argument
                args = (*args[:4], 0.0, *args[5:])
            if "dropout_p" in kwargs:
                kwargs["dropout_p"] = 0.0
        return func(*args, **kwargs)


@dataclass
class UnsplitStep:
    """The unsplit step on the first batch: what the pipelined step must reproduce."""

    loss: float
    #: Name (every name of a tied weight) → its gradient, for the parameters this rank's stages hold.
    gradients: dict[str, Tensor]
    seconds: float


def step_loss(output: Any) -> Tensor:
    """The loss a training step returned (a tensor, or a dict with ``"loss"``)."""
    loss = output.get("loss") if isinstance(output, Mapping) else output
    if not isinstance(loss, Tensor):
        raise RuntimeError(f"With pp > 1, training_step must return the loss; it returned {type(output).__name__}.")
    return loss


def unsplit_step(probe: StepProbe, split: StageSplit, stage_ids: Collection[int], accumulation: int,
                 microbatches: int) -> UnsplitStep:
    """The whole model's step on the probe's batch, with its backward (see the module docstring); refuses a step
    that microbatching changes. Gradients are scaled by ``1 / accumulation`` as the pipeline's are."""
    start = time.perf_counter()
    with probe.isolated(), torch.enable_grad(), NoDropout():
        loss = step_loss(probe.run_on(lambda batch: probe.step(batch)))
        loss.backward()
    names = held_parameter_names(probe.root, split, stage_ids)
    gradients = {}
    for name, parameter in probe.root.named_parameters(remove_duplicate=False):
        if parameter.grad is not None and name in names:
            gradients[name] = parameter.grad.detach().float() / accumulation
    for parameter in probe.root.parameters():
        parameter.grad = None
    _check_microbatching(probe, float(loss.detach()), microbatches)
    return UnsplitStep(float(loss.detach()), gradients, time.perf_counter() - start)


def _check_microbatching(probe: StepProbe, whole: float, microbatches: int) -> None:
    """Refuse a step whose loss over the microbatches (each weighted by its loss terms) is not the whole batch's."""
    if microbatches == 1:
        return
    losses, weights = [], []
    with probe.isolated(), torch.no_grad(), NoDropout():
        for part in probe.run_on(lambda batch: split_microbatches(batch, microbatches)):
            with counting_loss_terms() as terms:
                losses.append(float(step_loss(probe.run_on(lambda _: probe.step(part)))))
            weights.append(terms.count if terms.count is not None else float(samples(part)))
    combined = sum(w * loss for w, loss in zip(weights, losses)) / sum(weights)
    if not math.isclose(combined, whole, rel_tol=1e-4, abs_tol=1e-6):
        raise PipelineMismatch(
            f"HybridStrategy(pp > 1) splits each batch into {microbatches} microbatches, and this model's step gives"
            f" another loss on them than on the whole batch ({combined:.6g} vs {whole:.6g} on the first batch):"
            f" {_COUPLED}"
        )


_COUPLED = ("layers whose statistics depend on the batch (BatchNorm), a loss that couples the samples of a batch, or"
            " random draws other than dropout (a class label dropped at random), which microbatches draw in other"
            " pieces. Pass pp_microbatches=1 (or pp=1); or verify_pipeline=False to train with per-microbatch"
            " semantics.")


def checkable(probe: StepProbe) -> bool:
    """Whether setup runs a training step the pipeline can be checked on (:func:`check_stand_ins`)."""
    return probe.can_run_on and probe.step_name == "training_step"


def verifiable(probe: StepProbe) -> bool:
    """Whether the pipeline can also be verified against the unsplit step: a model that has values (not on the
    meta device)."""
    return checkable(probe) and not any(p.is_meta for p in probe.root.parameters())


def held_parameter_names(root: nn.Module, split: StageSplit, stage_ids: Collection[int]) -> set[str]:
    """Names of the parameters the stages ``stage_ids`` hold (blocks and outer units by their stages, the rest by
    where the record saw them read)."""
    local = set(stage_ids)
    prefixes = [unit.name + "." for unit in split.units if local & set(unit.stages)]
    names = {name for name, _ in root.named_parameters(remove_duplicate=False) if name.startswith(tuple(prefixes))}
    return names | {name for name, stages in split.parameter_stages.items() if local & set(stages)}


def check_pipeline(pipeline: Any, probe: StepProbe, reference: UnsplitStep, data_group: Optional[dist.ProcessGroup],
                   tolerance: float) -> float:
    """Run one pipelined training step on the probe's batch and compare its loss and gradients with
    ``reference`` (see the module docstring); ``data_group``: the data-parallel ranks FSDP2 averages gradients
    over (``None``: none). Raises :class:`PipelineMismatch` on every rank; returns the largest relative
    difference."""
    with probe.isolated(), NoDropout():
        output, gradients = probe.run_on(lambda batch: pipeline.check_step(batch))
    differences = [("loss", _relative(torch.tensor(float(step_loss(output))), torch.tensor(reference.loss), 0.0))]
    held = dict(gradients)
    # A gradient that is zero in exact arithmetic (a key bias under softmax) is rounding noise on both sides:
    # differences are measured against at least a hundredth of the typical gradient's norm.
    norms = [float(g.norm()) for g in reference.gradients.values()]
    floor = 1e-2 * math.sqrt(sum(n * n for n in norms) / len(norms)) if norms else 0.0
    local = dict(pipeline.module.named_parameters(remove_duplicate=False))
    # Every rank of the data group reduces the same names, in one order: those its stages held before the split,
    # held here now or not (expert parallelism leaves each rank some of a layer's experts only).
    for name in sorted(reference.gradients):
        expected = reference.gradients[name]
        if data_group is not None:
            expected = expected.clone()
            dist.all_reduce(expected, group=data_group)
            expected /= dist.get_world_size(data_group)
        parameter = local.get(name)
        if parameter is None or not parameter.requires_grad:
            continue
        got = held.get(parameter)
        got = got.full_tensor() if isinstance(got, DTensor) else got
        differences.append((name, _relative(torch.zeros_like(expected) if got is None else got.float(), expected,
                                            floor)))
    worst = max(differences, key=lambda item: item[1])
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (pipeline.stage_ids, [d for d in differences if d[1] > tolerance], worst[1]))
    wrong = [(stages, bad) for stages, bad, _ in everyone if bad]
    if wrong:
        raise PipelineMismatch(_mismatch_message(pipeline, wrong, tolerance))
    return max(largest for _, _, largest in everyone)


def check_stand_ins(pipeline: Any, probe: StepProbe) -> float:
    """One pipelined training step on the probe's batch with NaN in every stand-in (see the module docstring);
    raises :class:`PipelineMismatch` on every rank if the loss or a gradient is not finite on some rank, else
    returns the step's loss."""
    with probe.isolated(), NoDropout():
        output, gradients = probe.run_on(lambda batch: pipeline.check_step(batch, stand_in=float("nan")))
    names = {id(p): name for name, p in pipeline.module.named_parameters(remove_duplicate=False)}
    bad = [] if bool(torch.isfinite(step_loss(output).detach()).all()) else ["loss"]
    for parameter, gradient in gradients:
        local = gradient.to_local() if isinstance(gradient, DTensor) else gradient
        if local is not None and not bool(torch.isfinite(local).all()):
            bad.append(names.get(id(parameter), "?"))
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (pipeline.stage_ids, bad))
    wrong = [(stages, names) for stages, names in everyone if names]
    if not wrong:
        return float(step_loss(output))
    stages, values = max(wrong, key=lambda item: max(item[0]))  # the latest: NaN flows back to earlier stages
    raise PipelineMismatch(
        f"HybridStrategy(pp={pipeline.schedule.pp}) verification: the pipelined step on {_stage_named(pipeline, max(stages))}"
        f" computes with a value that stands in for another stage's blocks (NaN put there reaches"
        f" {_value_named(values[0])}). The step uses a value computed on another stage that does not reach this one"
        f" through a block's arguments (compute it inside a block or pass it to the blocks). {_CUT_ELSEWHERE}"
    )


def check_regrouped(pipeline: Any, probe: StepProbe, loss: float, tolerance: float) -> bool:
    """The pipelined step on the probe's batch regrouped into other microbatches (:func:`regrouped`) against its
    ``loss`` on the batch as it is (see the module docstring); raises :class:`PipelineMismatch` on every rank
    (the loss is the same on all) if they differ; ``False`` where the batch cannot be regrouped."""
    microbatches = pipeline.schedule.microbatches
    with probe.isolated(), NoDropout():
        output = probe.run_on(lambda batch: _step_regrouped(pipeline, batch, microbatches))
    if output is None:
        return False
    other = float(step_loss(output))
    if not math.isclose(other, loss, rel_tol=tolerance, abs_tol=1e-6):
        raise PipelineMismatch(
            f"HybridStrategy(pp > 1) splits each batch into {microbatches} microbatches, and this model's step gives"
            f" another loss when the batch's samples are grouped into other microbatches ({other:.6g} vs {loss:.6g}"
            f" on the first batch): {_COUPLED}"
        )
    return True


def _step_regrouped(pipeline: Any, batch: Any, microbatches: int) -> Any:
    other = regrouped(batch, microbatches)
    return None if other is None else pipeline.check_step(other)[0]


def _relative(got: Tensor, expected: Tensor, floor: float) -> float:
    scale = max(float(expected.norm()), floor)
    return float((got - expected).norm()) / scale if scale > 0 else float(got.norm())


def _mismatch_message(pipeline: Any, wrong: list, tolerance: float) -> str:
    """The latest stage that differs (the closest to the cause: a wrong value there makes its own gradients and
    every earlier stage's wrong) and the value that differs most on it."""
    stages, bad = max(wrong, key=lambda item: max(item[0]))
    name, difference = max(bad, key=lambda item: item[1])
    return (
        f"HybridStrategy(pp={pipeline.schedule.pp}) verification: the pipelined step on the first batch differs from"
        f" the unsplit step on {_stage_named(pipeline, max(stages))}: {_value_named(name)}"
        f" differs by {difference:.3g} (relative; tolerance {tolerance:g}); {sum(len(b) for _, b in wrong)} values differ on stages"
        f" {sorted({s for st, _ in wrong for s in st})}. The step uses a value computed on another stage that does not"
        " reach this one through a block's arguments (compute it inside a block or pass it to the blocks), or"
        f" reads values outside its blocks that the pipeline cannot know. {_CUT_ELSEWHERE}"
    )


_CUT_ELSEWHERE = "Cut elsewhere with HybridStrategy(pp_split=[...]), or use pp=1; verify_pipeline=False trains without this check."


def _stage_named(pipeline: Any, stage: int) -> str:
    """``stage 1 ('model.blocks.2' .. 'model.blocks.3')``: a stage by its first and last block."""
    blocks = pipeline.split.block_range(stage)
    names = {unit.block_index: unit.name for unit in pipeline.split.units if unit.block_index is not None}
    return f"stage {stage} ('{names[blocks.start]}' .. '{names[blocks.stop - 1]}')"


def _value_named(name: str) -> str:
    return "the loss" if name == "loss" else f"the gradient of '{name}'"
