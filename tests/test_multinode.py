"""A two-node job on this host trains exactly as one device does: the multi-node code path, not just several processes.

Two nodes × two processes, tensor parallelism 2 × pipeline parallelism 2 (``Trainer(num_nodes=2, devices=2)``):

* torchrun: two ``torch.distributed.run`` agents, one per "node", meet through a c10d rendezvous as agents on two
  machines would; Lightning's ``TorchElasticEnvironment`` reads the ranks torchrun gives (the node's from
  ``GROUP_RANK``).
* srun: four processes started with the variables ``srun --nodes 2 --ntasks-per-node 2`` sets; Lightning's
  ``SLURMEnvironment`` reads them (and the main address from the node list) and checks them against
  ``devices`` and ``num_nodes``.

Both must equal the single-device reference, and the mesh must lie on the nodes as its order intends: tensor-parallel
groups inside one node (the fastest links), pipeline stages across the nodes.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ReferenceFn
from tests.helpers import assert_equivalent, launch_env, rank_environment, run_script, run_torchrun

NODES, PER_NODE = 2, 2
TWO_NODES_TP2_PP2 = ["--model", "gpt", "--tp", 2, "--pp", 2, "--devices", PER_NODE, "--num-nodes", NODES]


def assert_placed_on_two_nodes(result: dict[str, Any], environment: str) -> None:
    """Lightning saw two nodes through ``environment``, ranks numbered node by node, and each rank's
    tensor-parallel group is its node's two ranks while its pipeline group holds one rank of each node."""
    assert (result["world_size"], result["num_nodes"]) == (NODES * PER_NODE, NODES)
    assert result["cluster_environment"] == environment
    placement = result["rank_placement"]
    assert [(rank["global_rank"], rank["node_rank"], rank["local_rank"]) for rank in placement] == [
        (0, 0, 0), (1, 0, 1), (2, 1, 0), (3, 1, 1)]
    for rank in placement:
        node, local = rank["node_rank"], rank["local_rank"]
        assert rank["tp_ranks"] == [node * PER_NODE, node * PER_NODE + 1], rank
        assert rank["pp_ranks"] == [local, PER_NODE + local], rank
        assert {placement[peer]["node_rank"] for peer in rank["tp_ranks"]} == {node}
        assert {placement[peer]["node_rank"] for peer in rank["pp_ranks"]} == {0, 1}


@pytest.mark.slow
def test_two_torchrun_agents_as_two_nodes_train_tp2_pp2_as_one_device(
    reference_run: ReferenceFn, tmp_path: Path
) -> None:
    out = tmp_path / "two_nodes.pt"
    agents, seconds = run_torchrun([*TWO_NODES_TP2_PP2, "--out", out], nnodes=NODES, nproc_per_node=PER_NODE)
    print(f"2 torchrun agents x {PER_NODE} workers (tp2 x pp2): {seconds:.1f} s")
    for node, agent in enumerate(agents):
        assert agent.returncode == 0, f"agent of node {node}:\n{agent.stdout[-6000:]}"
    result = torch.load(out, map_location="cpu", weights_only=False)
    assert_placed_on_two_nodes(result, "TorchElasticEnvironment")
    assert_equivalent(reference_run("gpt", 1), result, rtol=1e-5)


@pytest.mark.slow
def test_srun_tasks_of_two_nodes_train_tp2_pp2_as_one_device(reference_run: ReferenceFn, tmp_path: Path) -> None:
    result = run_script([*TWO_NODES_TP2_PP2, "--out", tmp_path / "srun.pt"], launcher="srun")
    print(f"4 srun-style tasks on 2 nodes (tp2 x pp2): {result['run_s']:.1f} s")
    assert_placed_on_two_nodes(result, "SLURMEnvironment")
    assert_equivalent(reference_run("gpt", 1), result, rtol=1e-5)


def test_srun_variables_of_the_test_are_the_ones_slurm_environment_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the srun case gives its tasks: each task's ranks as ``SLURMEnvironment`` reads them, the main address
    taken from the node list, and ``devices`` / ``num_nodes`` checked against the tasks per node and the nodes."""
    from lightning.fabric.plugins.environments import SLURMEnvironment

    seen = []
    for rank in range(NODES * PER_NODE):
        with monkeypatch.context() as patched:
            # A copy as the environment: SLURMEnvironment writes MASTER_ADDR into it, which must not stay here.
            task_environment = {**launch_env(), **rank_environment(rank, PER_NODE, NODES, 29123, "srun")}
            patched.setattr(os, "environ", task_environment)
            assert SLURMEnvironment.detect()
            environment = SLURMEnvironment()
            environment.validate_settings(num_devices=PER_NODE, num_nodes=NODES)
            with pytest.raises(ValueError, match="num_nodes=1"):
                environment.validate_settings(num_devices=PER_NODE, num_nodes=1)
            seen.append((environment.world_size(), environment.global_rank(), environment.node_rank(),
                         environment.local_rank(), environment.main_address, environment.main_port))
    assert seen == [(4, 0, 0, 0, "127.0.0.1", 29123), (4, 1, 0, 1, "127.0.0.1", 29123),
                    (4, 2, 1, 0, "127.0.0.1", 29123), (4, 3, 1, 1, "127.0.0.1", 29123)]
