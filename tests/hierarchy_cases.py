"""The cases of worker="node" shared by the in-process, horovodrun and torchrun tests.

A model without BatchNorm (a node's gradient must equal its concatenated batch's), the loss, the
settings per case, and the flat reference: the same run over ``m = nodes`` thread workers, each
fed its node's concatenated batches, which every hierarchical run must equal.
"""

import torch
from torch import nn

from hvd_slowmo import DistributedOptimizer
from hvd_slowmo.comm.local import run_threads

from reference import batch

CASES = {
    "localsgd-slowmo": dict(base="localsgd", tau=3, slow_lr=1.0, slow_momentum=0.6),
    "sgp-slowmo": dict(base="sgp", tau=3, slow_lr=1.0, slow_momentum=0.6),
    "allreduce": dict(base="allreduce", tau=1, slow_lr=1.0, slow_momentum=0.0),
    # Each rank of a node sends its half of the model across nodes, then the node gathers them.
    "localsgd-hierarchical": dict(
        base="localsgd", tau=3, slow_lr=1.0, slow_momentum=0.6, hierarchical=True
    ),
}


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)  # no BatchNorm: a node's gradient must equal its concatenated batch's
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def flat_reference(case: str, nodes=((0, 1), (2, 3)), steps: int = 7) -> list[list[torch.Tensor]]:
    """Each flat worker's parameters after ``steps`` steps, worker ``n`` fed the concatenated
    batches of the ranks in ``nodes[n]``.

    Args:
        case: a key of CASES.
        nodes: the ranks of each node.
        steps: how many optimizer steps.
    """
    models = [mlp() for _ in nodes]

    def flat(comm):
        model = models[comm.rank]
        opt = DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True),
            named_parameters=model.named_parameters(),
            communicator=comm,
            **{k: v for k, v in CASES[case].items() if k != "hierarchical"},  # one level
        )
        for k in range(steps):
            xs, ys = zip(*[batch(r, k) for r in nodes[comm.rank]])
            opt.zero_grad()
            loss(model, torch.cat(xs), torch.cat(ys)).backward()
            opt.step()
        return [p.detach().clone() for p in model.parameters()]

    return run_threads(len(nodes), flat)
