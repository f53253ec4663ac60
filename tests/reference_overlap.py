"""Hand-written single-process reference of the overlapped (delayed) outer step.

Every worker is simulated in one process, by hand, with plain tensors (nothing here uses
hvd_slowmo). The recurrence, for ``m`` workers, ``tau`` base steps per outer step and a delay
``d`` (``0 <= d < tau``), outer step ``t`` ending at global step ``n_t = (t + 1) tau``:

    s_i     = x_i at step n_t                      (snapshot; its average starts in flight)
    avg     = mean_i s_i
    gamma   = the lr at step n_t                    (the lr the d = 0 algorithm would read)
    ... every worker takes d more base steps from its own x_i ...
    u       <- beta u + (x0 - avg) / gamma          (applied at step n_t + d)
    x0      <- x0 - alpha gamma u
    x_i     <- x0 + (x_i - s_i)                    (keep the progress made since the snapshot)
    reset   the base optimizer's buffers (buffers="reset")

With ``d = 0`` the last line is ``x_i <- x0``: the non-overlapped algorithm.
"""

from collections.abc import Callable, Iterable

import torch
from torch import nn

from reference import loss_at, make_model


def reference_overlapped(
    m: int,
    steps: int,
    tau: int,
    delay: int,
    slow_lr: float,
    slow_momentum: float,
    make_opt: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer],
    buffers: str = "reset",
    lr_schedule: Callable[[int], float] | None = None,
    model_fn: Callable[[], nn.Module] = make_model,
) -> list[nn.Module]:
    """Replay overlapped SlowMo over Local SGD for ``m`` workers; returns each worker's model.

    Model buffers (BatchNorm statistics) follow the parameters' rule: their average replaces
    the snapshot, and the progress since the snapshot is kept.
    """
    assert 0 <= delay < tau and buffers in ("reset", "maintain")
    models = [model_fn() for _ in range(m)]
    opts = [make_opt(mod.parameters()) for mod in models]
    params = [list(mod.parameters()) for mod in models]
    bufs = [[b for b in mod.buffers() if b.is_floating_point()] for mod in models]
    anchor = [p.detach().clone() for p in params[0]]
    slow = [torch.zeros_like(p) for p in params[0]]
    pending = None  # (apply at step, gamma, averaged params, averaged buffers, snapshots)
    for k in range(steps):
        if lr_schedule is not None:
            for opt in opts:
                for g in opt.param_groups:
                    g["lr"] = lr_schedule(k)
        for i in range(m):
            opts[i].zero_grad()
            loss_at(models[i], i, k).backward()
            opts[i].step()
        n = k + 1
        with torch.no_grad():
            if n % tau == 0:
                snap_p = [[p.detach().clone() for p in params[i]] for i in range(m)]
                snap_b = [[b.clone() for b in bufs[i]] for i in range(m)]
                avg_p = [sum(ps[j] for ps in snap_p) / m for j in range(len(anchor))]
                avg_b = [sum(bs[j] for bs in snap_b) / m for j in range(len(bufs[0]))]
                gamma = opts[0].param_groups[0]["lr"]
                pending = (n + delay, gamma, avg_p, avg_b, snap_p, snap_b)
            if pending is not None and pending[0] == n:
                _, gamma, avg_p, avg_b, snap_p, snap_b = pending
                for j in range(len(anchor)):
                    slow[j] = slow_momentum * slow[j] + (anchor[j] - avg_p[j]) / gamma
                    anchor[j] = anchor[j] - slow_lr * gamma * slow[j]
                for i in range(m):
                    for j, p in enumerate(params[i]):
                        p.copy_(anchor[j] + (p - snap_p[i][j]))
                    for j, b in enumerate(bufs[i]):
                        b.copy_(avg_b[j] + (b - snap_b[i][j]))
                    if buffers == "reset":
                        opts[i].state.clear()
                pending = None
    return models
