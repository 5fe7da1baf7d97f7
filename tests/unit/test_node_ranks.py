"""--nnodes/--node-rank: how one replica's tensor-parallel ranks split over servers, and what is refused."""

from __future__ import annotations

import pytest

from tokenmill_service.contract.config import Settings, load_settings


def test_ranks_split_over_nodes_in_order() -> None:
    assert Settings(tensor_parallel=3).node_ranks() == [0, 1, 2]
    assert [Settings(tensor_parallel=3, nnodes=2, node_rank=r).node_ranks() for r in (0, 1)] == [[0, 1], [2]]
    assert [Settings(tensor_parallel=4, nnodes=2, node_rank=r).node_ranks() for r in (0, 1)] == [[0, 1], [2, 3]]
    assert [Settings(tensor_parallel=3, nnodes=3, node_rank=r).node_ranks() for r in range(3)] == [[0], [1], [2]]


def test_a_replica_over_nodes_is_one_replica_on_a_fixed_port() -> None:
    settings = load_settings(["--tensor-parallel", "3", "--nnodes", "2", "--node-rank", "1", "--master-addr", "n0"], {})
    assert (settings.resolved_workers(), settings.resolved_master_port(), settings.master_addr) == (1, 29500, "n0")
    assert load_settings([], {}).resolved_master_port() == 0  # one node: free ports


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--nnodes", "2", "--node-rank", "2", "--tensor-parallel", "3"], "--node-rank between 0"),
        (["--nnodes", "0"], "--nnodes must be at least 1"),
        (["--nnodes", "2"], "--tensor-parallel must be at least 2"),
        (["--nnodes", "2", "--tensor-parallel", "3", "--workers", "2"], "--workers must be 1"),
    ],
)
def test_impossible_splits_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_settings(argv, {})
