"""Hierarchical SlowMo (worker = node) on in-process thread workers."""

import pytest
import torch

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.hierarchy import Hierarchy, node_groups
from hvd_slowmo.comm.local import run_threads

from hierarchy_cases import CASES, flat_reference, loss, mlp
from reference import batch


def test_node_groups():
    layout = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert node_groups(layout) == ([[0, 1], [2, 3], [4, 5]], [[0, 2, 4], [1, 3, 5]])
    assert node_groups([(1, 1), (0, 0), (1, 0), (0, 1)]) == ([[1, 3], [2, 0]], [[1, 2], [3, 0]])
    with pytest.raises(ValueError, match="same number of processes"):
        node_groups([(0, 0), (0, 1), (1, 0)])
    with pytest.raises(ValueError, match="both claim"):
        node_groups([(0, 0), (0, 0)])


def _assert_equal_after_averages(got: list, tau: int, steps: int) -> None:
    """After each exact average (every ``tau``-th step) every rank holds the same bits."""
    for k in range(tau - 1, steps, tau):
        for r in range(1, len(got)):
            assert all(torch.equal(a, b) for a, b in zip(got[r][k], got[0][k])), (r, k)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_node_workers_equal_flat_run_over_nodes(case):
    """4 ranks as 2 nodes x 2 equals 2 flat workers fed each node's concatenated batches."""
    kwargs, steps, nodes, local = CASES[case], 7, 2, 2
    models = [mlp() for _ in range(nodes * local)]
    groups_nodes = [[n * local + i for i in range(local)] for n in range(nodes)]
    groups_peers = [[n * local + i for n in range(nodes)] for i in range(local)]

    def hier(comm):
        r = comm.rank
        h = Hierarchy(
            node=comm.world.split(groups_nodes)[r], cross=comm.world.split(groups_peers)[r]
        )
        model = models[r]
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True),
            named_parameters=model.named_parameters(),
            communicator=comm,
            worker=h,
            **kwargs,
        )
        if kwargs.get("hierarchical"):  # each rank sends its share, no reduce-scatter
            assert opt.exchanges[0].name == "hierarchical" and opt.exchanges[0].replicated
        per_step = []
        for k in range(steps):
            opt.zero_grad()
            loss(model, *batch(r, k)).backward()
            opt.step()
            per_step.append([p.detach().clone() for p in model.parameters()])
        return per_step

    got = run_threads(nodes * local, hier)
    want = flat_reference(case, groups_nodes, steps)
    _assert_equal_after_averages(got, kwargs["tau"], steps)
    for n, ranks in enumerate(groups_nodes):
        for k in range(steps):  # ranks of one node are bitwise identical at every step
            for r in ranks[1:]:
                assert all(torch.equal(a, b) for a, b in zip(got[r][k], got[ranks[0]][k])), (r, k)
        for a, b in zip(got[ranks[0]][-1], want[n]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_worker_argument_is_checked():
    model = mlp()
    from hvd_slowmo.comm.local import ThreadWorld

    with pytest.raises(ValueError, match="worker must be"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            communicator=ThreadWorld(1).communicator(0),
            worker="gpu",
        )
    with pytest.raises(ValueError, match="Hierarchy"):
        DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1),
            communicator=ThreadWorld(1).communicator(0),
            worker="node",
        )
