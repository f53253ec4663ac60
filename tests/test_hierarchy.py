"""Hierarchical SlowMo (worker = node) on in-process thread workers."""

import pytest
import torch
from torch import nn

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.hierarchy import Hierarchy, node_groups
from hvd_slowmo.comm.local import run_threads

from reference import batch


def mlp(seed=0):
    torch.manual_seed(seed)  # no BatchNorm: a node's gradient must equal its concatenated batch's
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def loss(model, x, y):
    return ((model(x) - y) ** 2).mean()


def test_node_groups():
    layout = [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert node_groups(layout) == ([[0, 1], [2, 3], [4, 5]], [[0, 2, 4], [1, 3, 5]])
    assert node_groups([(1, 1), (0, 0), (1, 0), (0, 1)]) == ([[1, 3], [2, 0]], [[1, 2], [3, 0]])
    with pytest.raises(ValueError, match="same number of processes"):
        node_groups([(0, 0), (0, 1), (1, 0)])
    with pytest.raises(ValueError, match="both claim"):
        node_groups([(0, 0), (0, 0)])


CASES = {
    "localsgd-slowmo": dict(base="localsgd", tau=3, slow_lr=1.0, slow_momentum=0.6),
    "sgp-slowmo": dict(base="sgp", tau=3, slow_lr=1.0, slow_momentum=0.6),
    "allreduce": dict(base="allreduce", tau=1, slow_lr=1.0, slow_momentum=0.0),
}


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
        per_step = []
        for k in range(steps):
            opt.zero_grad()
            loss(model, *batch(r, k)).backward()
            opt.step()
            per_step.append([p.detach().clone() for p in model.parameters()])
        return per_step

    flat_models = [mlp() for _ in range(nodes)]

    def flat(comm):
        n = comm.rank
        model = flat_models[n]
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True),
            named_parameters=model.named_parameters(),
            communicator=comm,
            **kwargs,
        )
        for k in range(steps):
            xs, ys = zip(*[batch(r, k) for r in groups_nodes[n]])
            opt.zero_grad()
            loss(model, torch.cat(xs), torch.cat(ys)).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    got = run_threads(nodes * local, hier)
    want = run_threads(nodes, flat)
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
