"""Hand-written single-process reference of SlowMo under a straggler quorum: each outer step
averages only its members' parameters.

Every worker is simulated in one process, by hand (nothing here uses hvd_slowmo). In outer step
``t`` each member ``r`` of ``members[t]`` starts from the common state (the anchor and the model
buffers), with its base optimizer's state reset, and takes ``tau`` base steps on its batches
``(r, t * tau + i)``; then::

    avg  = (sum over the members, in rank order) / |members|   (the model buffers likewise)
    u   <- beta u + (x0 - avg) / lr ;  x0 <- x0 - alpha lr u

A worker left out of a step contributes nothing to it and starts the next one it takes part in
from the common state (the library's resync). The slow step is replayed as SGD over the anchor,
so the comparison has a tolerance; ranks are compared bitwise among themselves.
"""

import copy

import torch
from torch import nn

from reference import _slow_step, loss_at, make_model


def _floating_buffers(model: nn.Module) -> list[torch.Tensor]:
    return [b for b in model.buffers() if b.is_floating_point()]


def _mean(per_member: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    return [sum(ts[i] for ts in per_member) / len(per_member) for i in range(len(per_member[0]))]


def reference_quorum(
    members: list[list[int]],
    tau: int,
    lr: float,
    momentum: float,
    slow_lr: float,
    slow_momentum: float,
    counts: list[list[int]] | None = None,
) -> nn.Module:
    """The common model after ``len(members)`` outer steps (parameters: the anchor).

    ``counts[t][r]``: the base steps worker ``r`` takes in outer step ``t`` (time-based periods;
    default ``tau`` each); its batches are still ``(r, t * tau + i)``."""
    common = make_model()
    anchor = [p.detach().clone().requires_grad_(True) for p in common.parameters()]
    slow = torch.optim.SGD(anchor, lr=1.0, momentum=slow_momentum)
    for t, who in enumerate(members):
        finals = []
        for r in who:
            model = copy.deepcopy(common)
            opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum)
            for i in range(tau if counts is None else counts[t][r]):
                opt.zero_grad()
                loss_at(model, r, t * tau + i).backward()
                opt.step()
            finals.append(model)
        with torch.no_grad():
            avg = _mean([[p.detach() for p in m.parameters()] for m in finals])
            new = _slow_step(slow, anchor, avg, lr, slow_lr)
            for p, v in zip(common.parameters(), new):
                p.copy_(v)
            for b, v in zip(
                _floating_buffers(common), _mean([_floating_buffers(m) for m in finals])
            ):
                b.copy_(v)
    return common
