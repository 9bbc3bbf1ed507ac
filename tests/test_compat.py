"""The compatibility module (``lightning_hybrid._compat``): what it must do whatever the torch build."""

from __future__ import annotations

import torch

from lightning_hybrid._compat import existing_ops


def test_ops_a_build_lacks_are_skipped_not_fatal() -> None:
    found = existing_ops(["aten.mm.default", "aten._no_such_kernel.default", "no_such_namespace.op.default"])
    assert found == {torch.ops.aten.mm.default}


def test_the_total_flop_counter_counts_and_tolerates_a_leaf_view_taken_without_gradients() -> None:
    import torch
    from torch import nn

    from lightning_hybrid._compat import total_flop_counter

    class ViewsItsWeight(nn.Module):  # Hugging Face Mamba hands conv1d.weight.view(...) to a module
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.randn(4, 1, 3))
            self.inner = nn.Identity()

        def forward(self, x):
            return x @ self.inner(self.weight.view(4, 3)).T

    model, x = ViewsItsWeight(), torch.randn(2, 3)
    counter = total_flop_counter()
    with torch.no_grad(), counter:
        model(x)
    assert counter.get_total_flops() == 2 * 2 * 3 * 4
