"""Hand-written single-process reference of the overlapped (delayed) outer step.

Every worker is simulated in one process, by hand, with plain tensors (nothing here uses
hvd_slowmo). The recurrence, for ``m`` workers, ``tau`` base steps per outer step and a delay
``d`` (``0 <= d < tau``), outer step ``t`` ending at global step ``n_t = (t + 1) tau``:

    s_i     = x_i at step n_t                      (snapshot; its average starts in flight)
    avg     = mean_i s_i
    gamma   = the lr of x's param group at step n_t (the lr the d = 0 algorithm would read)
    ... every worker takes d more base steps from its own x_i ...
    u       <- beta u + (x0 - avg) / gamma          (applied at step n_t + d)
    x0      <- x0 - alpha gamma u                   (Nesterov: x0 - alpha gamma (g + beta u))
    x_i     <- x0 + (x_i - s_i)                    (keep the progress made since the snapshot)

With ``d = 0`` the last line is ``x_i <- x0``: the non-overlapped algorithm. The model buffers
(BatchNorm statistics) and, with ``buffers="average"``, the base optimizer's per-element buffers
(momentum, Adam moments) follow the same rule with ``avg`` in place of ``x0``: their average at
the boundary replaces the snapshot, and the progress since the snapshot is kept.
``buffers="reset"`` clears the base optimizer's state at the landing. ``base="allreduce"`` (AR-SGD)
replaces every worker's gradients with their mean over workers before each base step.
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from reference import loss_at, make_model

Schedule = Callable[[int], float | Sequence[float]]
LossFn = Callable[[nn.Module, int, int], Tensor]


@dataclass
class Workers:
    """The simulated workers: their models, optimizers and the tensors the outer step touches."""

    models: list[nn.Module]
    opts: list[torch.optim.Optimizer]

    def params(self, i: int) -> list[Tensor]:
        return list(self.models[i].parameters())

    def model_buffers(self, i: int) -> list[Tensor]:
        return [b for b in self.models[i].buffers() if b.is_floating_point()]

    def opt_buffers(self, i: int) -> list[Tensor]:
        """Worker ``i``'s per-element optimizer buffers (shaped like their parameter), in
        parameter order then key order."""
        out = []
        for p in self.params(i):
            entry = self.opts[i].state.get(p, {})
            for key in sorted(entry):
                v = entry[key]
                if torch.is_tensor(v) and v.is_floating_point() and v.shape == p.shape:
                    out.append(v)
        return out

    def lr_of_each_param(self) -> list[float]:
        """The lr of each parameter's param group (worker 0's: every worker has the same)."""
        return [float(g["lr"]) for g in self.opts[0].param_groups for _ in g["params"]]


@dataclass
class Flight:
    """An outer step between its boundary and its landing."""

    land_at: int
    gamma: list[float]
    # Per kind ("params", "model", "opt"): each worker's snapshot, and their mean.
    snapshots: dict[str, list[list[Tensor]]]
    means: dict[str, list[Tensor]]


def _mean(per_worker: list[list[Tensor]]) -> list[Tensor]:
    m = len(per_worker)
    return [sum(ts[j] for ts in per_worker) / m for j in range(len(per_worker[0]))]


def _set_lrs(workers: Workers, lrs: float | Sequence[float]) -> None:
    for opt in workers.opts:
        for g, group in enumerate(opt.param_groups):
            group["lr"] = lrs[g] if isinstance(lrs, Sequence) else lrs


def _base_step(workers: Workers, k: int, base: str, loss_fn: LossFn) -> None:
    for i, (model, opt) in enumerate(zip(workers.models, workers.opts)):
        opt.zero_grad()
        loss_fn(model, i, k).backward()
    if base == "allreduce":
        with torch.no_grad():
            grads = [[p.grad for p in workers.params(i)] for i in range(len(workers.models))]
            for j, mean in enumerate(_mean(grads)):
                for g in grads:
                    g[j].copy_(mean)
    for opt in workers.opts:
        opt.step()


def _boundary(workers: Workers, land_at: int, average_opt_buffers: bool) -> Flight:
    m = len(workers.models)
    kinds = {"params": workers.params, "model": workers.model_buffers}
    if average_opt_buffers:
        kinds["opt"] = workers.opt_buffers
    snapshots = {
        kind: [[t.detach().clone() for t in get(i)] for i in range(m)]
        for kind, get in kinds.items()
    }
    means = {kind: _mean(snaps) for kind, snaps in snapshots.items()}
    return Flight(land_at, workers.lr_of_each_param(), snapshots, means)


def _slow_step(
    anchor: list[Tensor],
    slow: list[Tensor],
    flight: Flight,
    slow_lr: float,
    slow_momentum: float,
    nesterov: bool,
) -> None:
    for j, gamma in enumerate(flight.gamma):
        g = (anchor[j] - flight.means["params"][j]) / gamma
        slow[j] = slow_momentum * slow[j] + g
        step = g + slow_momentum * slow[j] if nesterov else slow[j]
        anchor[j] = anchor[j] - slow_lr * gamma * step


def _land(workers: Workers, flight: Flight, anchor: list[Tensor], buffers: str) -> None:
    new = {"params": anchor, **{k: v for k, v in flight.means.items() if k != "params"}}
    getters = {"params": workers.params, "model": workers.model_buffers, "opt": workers.opt_buffers}
    for i in range(len(workers.models)):
        for kind, values in new.items():
            for live, value, snap in zip(getters[kind](i), values, flight.snapshots[kind][i]):
                live.copy_(value + (live - snap))
        if buffers == "reset":
            workers.opts[i].state.clear()


def reference_overlapped(
    m: int,
    steps: int,
    tau: int,
    delay: int,
    slow_lr: float,
    slow_momentum: float,
    make_opt: Callable[[Iterable[Tensor]], torch.optim.Optimizer],
    buffers: str = "reset",
    lr_schedule: Schedule | None = None,
    model_fn: Callable[[], nn.Module] = make_model,
    base: str = "localsgd",
    nesterov: bool = False,
    loss_fn: LossFn = loss_at,
) -> list[nn.Module]:
    """Replay overlapped SlowMo for ``m`` workers; returns each worker's model.

    Args:
        m: the number of workers.
        steps: base steps per worker.
        tau: base steps per outer step.
        delay: ``d``, the base steps between an outer step's boundary and its landing.
        slow_lr: ``alpha``.
        slow_momentum: ``beta``.
        make_opt: builds a worker's base optimizer over its model's parameters (param groups
            are allowed).
        buffers: ``"reset"``, ``"maintain"`` or ``"average"`` (the base optimizer's buffers).
        lr_schedule: the lr at base step ``k``: one for every group, or one per param group.
        model_fn: builds a worker's model (called once per worker).
        base: ``"localsgd"`` or ``"allreduce"`` (gradients averaged before every base step).
        nesterov: Nesterov slow momentum.
        loss_fn: ``loss_fn(model, rank, k)``, worker ``rank``'s loss at base step ``k``.
    """
    assert 0 <= delay < tau and buffers in ("reset", "maintain", "average")
    assert base in ("localsgd", "allreduce")
    models = [model_fn() for _ in range(m)]
    workers = Workers(models, [make_opt(mod.parameters()) for mod in models])
    anchor = [p.detach().clone() for p in workers.params(0)]
    slow = [torch.zeros_like(p) for p in anchor]
    flight = None
    for k in range(steps):
        if lr_schedule is not None:
            _set_lrs(workers, lr_schedule(k))
        _base_step(workers, k, base, loss_fn)
        n = k + 1
        with torch.no_grad():
            if n % tau == 0:
                flight = _boundary(workers, n + delay, buffers == "average")
            if flight is not None and flight.land_at == n:
                _slow_step(anchor, slow, flight, slow_lr, slow_momentum, nesterov)
                _land(workers, flight, anchor, buffers)
                flight = None
    return models
