"""AR-SGD's per-step gradient average, for the thread tests and the horovodrun worker: one run
through hvd_slowmo (buckets started during backward) and a hand-written reference.

The reference simulates every worker in one process and averages the gradients by hand, each
element summed in rank order and divided by the number of workers (the arithmetic of the thread
communicator, and of the single grouped average that ``base="allreduce"`` ran in ``step()``
before the buckets); ``nodes`` averages inside each node first, then across nodes. Nothing in the
reference uses hvd_slowmo.
"""

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from reference import batch

#: Scenario options: ``passes`` backward passes per step; ``clip``: ``synchronize()``, clip the
#: gradient norm to this value, then ``step()`` under ``skip_synchronize()``; ``unused``: the
#: ``extra`` head is used only in some passes on some ranks (on some ranks not at all);
#: ``set_to_none``: ``zero_grad``'s argument.
CASES: dict[str, dict[str, Any]] = {
    "plain": dict(passes=1, clip=None, unused=False, set_to_none=True),
    "accumulate": dict(passes=2, clip=None, unused=False, set_to_none=True),
    "clip": dict(passes=1, clip=0.05, unused=False, set_to_none=True),
    "unused": dict(passes=1, clip=None, unused=True, set_to_none=True),
    "unused-keep": dict(passes=1, clip=None, unused=True, set_to_none=False),
    "accumulate-unused": dict(passes=2, clip=None, unused=True, set_to_none=False),
}
#: The scenarios the horovodrun tier runs with worker="node" (four processes: a few, for speed).
NODE_CASES = ("plain", "clip", "accumulate-unused")
STEPS = 5
#: Small buckets, so a step has several (the model's gradients are about 2 KB).
BUCKET_MB = 300 / 2**20
LR, MOMENTUM = 0.05, 0.9


class Net(nn.Module):
    """Two hidden layers, an output head and an ``extra`` head that may go unused."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh())
        self.out = nn.Linear(8, 2)
        self.extra = nn.Linear(8, 2)

    def forward(self, x: Tensor, use_extra: bool) -> Tensor:
        h = self.body(x)
        return self.out(h) + self.extra(h) if use_extra else self.out(h)


def loss(model: Net, case: str, rank: int, step: int, p: int) -> Tensor:
    """Worker ``rank``'s loss in backward pass ``p`` of ``step``."""
    use_extra = not CASES[case]["unused"] or (rank + step + p) % 3 == 0
    x, y = batch(rank, 10 * step + p)
    return ((model(x, use_extra) - y) ** 2).mean()


def train(
    model: Net,
    case: str,
    rank: int,
    communicator: Any = None,
    opts: list | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """One worker through hvd_slowmo's ``base="allreduce"``.

    Args:
        model: a fresh :class:`Net` (built outside worker threads: torch's global RNG is not
            thread-safe).
        opts: if given, the optimizer is appended to it (for tests that inspect it).

    Returns:
        ``grads``: the gradients right after each step's last backward pass (averaged, since
        the backward pass waits for its buckets); ``params``: the parameters after each step.
    """
    import hvd_slowmo

    c = CASES[case]
    opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM),
        named_parameters=model.named_parameters(),
        base="allreduce",
        tau=1000,  # no outer step: the gradient average alone
        communicator=communicator,
        backward_passes_per_step=c["passes"],
        **{"bucket_mb": BUCKET_MB, **kwargs},
    )
    if opts is not None:
        opts.append(opt)
    out: dict[str, list] = {"grads": [], "params": []}
    for k in range(STEPS):
        opt.zero_grad(set_to_none=c["set_to_none"])
        for p in range(c["passes"]):
            loss(model, case, rank, k, p).backward()
        out["grads"].append([_grad(t) for t in model.parameters()])
        if c["clip"] is not None:
            opt.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), c["clip"])
            with opt.skip_synchronize():
                opt.step()
        else:
            opt.step()
        out["params"].append([t.detach().clone() for t in model.parameters()])
    return out


def _grad(t: Tensor) -> Tensor | None:
    return None if t.grad is None else t.grad.clone()


def _mean(tensors: Sequence[Tensor]) -> Tensor:
    total = tensors[0].clone()
    for t in tensors[1:]:
        total += t
    return total / len(tensors)


def reference(case: str, m: int, nodes: Sequence[Sequence[int]] | None = None) -> dict[str, Any]:
    """The same run replayed by hand for ``m`` workers (all identical: they step one average).

    Args:
        case: a key of :data:`CASES`.
        m: the number of workers.
        nodes: groups of ranks averaged first (``worker="node"``), then across groups.
    """
    c = CASES[case]
    model = Net()
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    out: dict[str, list] = {"grads": [], "params": []}
    for k in range(STEPS):
        per_rank = []
        for r in range(m):
            total: list[Tensor | None] = [None] * len(params)
            for p in range(c["passes"]):
                model.zero_grad(set_to_none=True)
                loss(model, case, r, k, p).backward()
                for i, t in enumerate(params):
                    if t.grad is not None:
                        total[i] = t.grad.clone() if total[i] is None else total[i] + t.grad
            # A parameter without a gradient joins the average with zeros.
            per_rank.append(
                [torch.zeros_like(t) if g is None else g for t, g in zip(params, total)]
            )
        groups = nodes or [list(range(m))]
        level1 = [[_mean([per_rank[r][i] for r in g]) for i in range(len(params))] for g in groups]
        avg = [_mean([n[i] for n in level1]) for i in range(len(params))] if nodes else level1[0]
        out["grads"].append([g.clone() for g in avg])
        for t, g in zip(params, avg):
            t.grad = g
        if c["clip"] is not None:
            torch.nn.utils.clip_grad_norm_(params, c["clip"])
        opt.step()
        out["params"].append([t.detach().clone() for t in params])
    return out
