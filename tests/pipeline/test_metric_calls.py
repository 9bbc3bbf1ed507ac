"""torchmetrics objects in pipelined steps (``lightning_hybrid.pipeline.metric_calls``): recorded calls leave the metric as it
was, and replaying the step's calls merged over microbatches gives the states of one full-batch call. (Trained
with every layout against single-process Lightning in ``tests/test_zoo.py``.)"""

from __future__ import annotations

import torch
from torch import nn
from torchmetrics.classification import MulticlassAccuracy

from lightning_hybrid.pipeline.metric_calls import combine_metric_calls, recording_metric_calls, replay_metric_calls, sync_over


def _module() -> nn.Module:
    module = nn.Module()
    module.acc = MulticlassAccuracy(num_classes=4, average="micro")
    return module


def test_recorded_calls_leave_the_metric_unchanged_and_return_the_microbatch_value() -> None:
    module = _module()
    preds, target = torch.tensor([0, 1, 2, 3]), torch.tensor([0, 1, 0, 0])
    calls: list = []
    with recording_metric_calls(module, calls):
        assert module.acc(preds, target) == 0.5
        module.acc.update(preds, target)
    assert [(name, method) for name, method, _, _ in calls] == [("acc", "forward"), ("acc", "update")]
    assert module.acc.update_count == 0  # untouched, and its own methods are back
    module.acc.update(preds, target)
    assert module.acc.compute() == 0.5


def test_replaying_the_merged_microbatch_calls_equals_one_full_batch_call() -> None:
    preds, target = torch.tensor([0, 1, 2, 3, 3, 3]), torch.tensor([0, 1, 0, 0, 3, 2])
    per_microbatch = []
    recorder = _module()
    for part in range(3):
        calls: list = []
        with recording_metric_calls(recorder, calls):
            recorder.acc(preds[2 * part: 2 * part + 2], target[2 * part: 2 * part + 2])
        per_microbatch.append(calls)
    merged = combine_metric_calls(per_microbatch)
    assert len(merged) == 1 and torch.equal(merged[0][2][0], preds)
    replayed, single = _module(), _module()
    replay_metric_calls(replayed, merged, torch.device("cpu"))
    single.acc(preds, target)
    assert replayed.acc._forward_cache == single.acc._forward_cache == 0.5  # the step's on_step value
    assert replayed.acc.compute() == single.acc.compute()


def test_metrics_sync_over_the_given_group() -> None:
    module = _module()
    sync_over(module, "data-parallel group")
    assert module.acc.process_group == "data-parallel group"
