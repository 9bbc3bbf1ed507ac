"""The compatibility module (``lightning_hybrid._compat``): what it must do whatever the torch build."""

from __future__ import annotations

import torch

from lightning_hybrid._compat import existing_ops


def test_ops_a_build_lacks_are_skipped_not_fatal() -> None:
    found = existing_ops(["aten.mm.default", "aten._no_such_kernel.default", "no_such_namespace.op.default"])
    assert found == {torch.ops.aten.mm.default}
