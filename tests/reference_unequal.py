"""Hand-written single-process reference of SlowMo with unequal workers: per-worker step counts
in each period and the outer step's merge weighted by the samples each worker processed.

Every worker is simulated in one process, by hand (nothing here uses hvd_slowmo). Worker ``i``
takes ``counts[p][i]`` base steps in period ``p``, on its own batches and its own lr schedule
(both indexed by its own step count ``k_i``). At the end of each period, with ``w_i`` the samples
it processed in the period and ``gamma_i`` its lr at the boundary::

    avg   = sum_i w_i x_i / sum_i w_i                  (merge="samples"; "mean": plain mean)
    gamma = sum_i w_i gamma_i / sum_i w_i              (the same weights)
    u    <- beta u + (x0 - avg) / gamma ;  x0 <- x0 - alpha gamma u
    x_i  <- x0 ;  the model buffers <- their plain mean ;  buffers="reset": optimizer state goes

The real-valued arithmetic; the library rounds differently (a ratio per worker and one
division), so the comparison has a tolerance (ranks are compared bitwise among themselves).
"""

from collections.abc import Callable, Iterable

import torch
from torch import nn

from reference import loss_at, make_model


def time_plan(seconds_per_step: list[float], period: float, periods: int, first: int):
    """The counts of time-based periods, by hand: ``first`` steps each in the first period,
    then ``floor(period / t_i)`` for every later one."""
    later = [int(period // t) for t in seconds_per_step]
    return [[first] * len(seconds_per_step)] + [later] * (periods - 1)


def reference_unequal(
    counts: list[list[int]],
    samples: Callable[[int, int], float],
    slow_lr: float,
    slow_momentum: float,
    make_opt: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer],
    lr_schedule: Callable[[int], float],
    weighted: bool = True,
) -> tuple[list[nn.Module], list[list[torch.Tensor]]]:
    """Replay the periods ``counts`` (``counts[p][i]``: worker ``i``'s steps in period ``p``).

    Args:
        counts: the steps per period and worker.
        samples: ``samples(i, k)``, the samples worker ``i`` reports at its step ``k``.
        slow_lr, slow_momentum: ``alpha``, ``beta``.
        make_opt: the base optimizer over a model's parameters.
        lr_schedule: the lr of a worker's step ``k`` (its own count).
        weighted: the weighted merge (False: the plain mean, the weighted lr still).

    Returns:
        Each worker's model, and the anchor after every outer step.
    """
    m = len(counts[0])
    models = [make_model() for _ in range(m)]
    opts = [make_opt(mod.parameters()) for mod in models]
    params = [list(mod.parameters()) for mod in models]
    bufs = [[b for b in mod.buffers() if b.is_floating_point()] for mod in models]
    anchor = [p.detach().clone().double() for p in params[0]]
    slow = [torch.zeros_like(a) for a in anchor]
    steps = [0] * m
    anchors = []
    for plan in counts:
        work, lrs = [0.0] * m, [0.0] * m
        for i in range(m):
            for _ in range(plan[i]):
                k = steps[i]
                for g in opts[i].param_groups:
                    g["lr"] = lr_schedule(k)
                opts[i].zero_grad()
                loss_at(models[i], i, k).backward()
                opts[i].step()
                work[i] += samples(i, k)
                steps[i] += 1
            lrs[i] = opts[i].param_groups[0]["lr"]
        weights = work if weighted else [1.0] * m
        total = sum(weights)
        gamma = sum(w * lr for w, lr in zip(weights, lrs)) / total
        with torch.no_grad():
            for j, a in enumerate(anchor):
                avg = sum(w * params[i][j].double() for i, w in enumerate(weights)) / total
                slow[j] = slow_momentum * slow[j] + (a - avg) / gamma
                anchor[j] = a - slow_lr * gamma * slow[j]
                for i in range(m):
                    params[i][j].copy_(anchor[j])
            for j in range(len(bufs[0])):
                mean = sum(bufs[i][j] for i in range(m)) / m
                for i in range(m):
                    bufs[i][j].copy_(mean)
            for o in opts:
                o.state.clear()
        anchors.append([a.float() for a in anchor])
    return models, anchors
