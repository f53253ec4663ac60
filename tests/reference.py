"""Hand-written single-process references: every worker simulated in one process, by hand.

Shared by the in-process tests and the horovodrun tests, so both compare against the same
replay. Nothing here uses hvd_slowmo.
"""

from collections.abc import Callable, Iterable

import torch
from torch import nn


def make_model(seed: int = 0) -> nn.Module:
    """A tiny MLP with a BatchNorm layer (its running stats are model buffers)."""
    torch.manual_seed(seed)
    # BatchNorm after the nonlinearity: right after a Linear it would make that bias's gradient
    # pure rounding noise, which Adam amplifies into arbitrary steps.
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.BatchNorm1d(5), nn.Linear(5, 2))


def batch(rank: int, step: int):
    """Worker ``rank``'s deterministic batch at ``step`` (different on every worker)."""
    g = torch.Generator().manual_seed(1000 * rank + step)
    x = torch.randn(8, 4, generator=g) + rank
    y = torch.randn(8, 2, generator=g)
    return x, y


def loss_at(model: nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = batch(rank, step)
    return ((model(x) - y) ** 2).mean()


def lr_at(step: int, base_lr: float = 0.05) -> float:
    """A schedule that changes between outer steps (so the 1/lr scaling is really exercised)."""
    return base_lr * (1.0 + 0.5 * (step // 4))


def reference_slowmo(
    m: int,
    steps: int,
    tau: int,
    slow_lr: float,
    slow_momentum: float,
    make_opt: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer],
    buffers: str = "reset",
    lr_schedule: Callable[[int], float] | None = lr_at,
    average_model_buffers: bool = True,
    outer_nesterov: bool = False,
) -> list[nn.Module]:
    """Replay SlowMo over Local SGD/Adam for ``m`` workers; returns each worker's model.

    The slow update is replayed as ``torch.optim.SGD(lr=slow_lr * lr, momentum=slow_momentum)`` on
    the pseudo-gradient ``(x0 - x_avg) / lr``.
    """
    models = [make_model() for _ in range(m)]
    opts = [make_opt(mod.parameters()) for mod in models]
    anchor = [p.detach().clone().requires_grad_(True) for p in models[0].parameters()]
    slow = torch.optim.SGD(anchor, lr=1.0, momentum=slow_momentum, nesterov=outer_nesterov)
    for k in range(steps):
        _local_steps(models, opts, k, lr_schedule(k) if lr_schedule else None)
        if (k + 1) % tau:
            continue
        with torch.no_grad():
            plist = [list(mod.parameters()) for mod in models]
            new = _mean(plist)  # without a slow update the average is the new start
            if (slow_lr, slow_momentum) != (1.0, 0.0):
                new = _slow_step(slow, anchor, new, opts[0].param_groups[0]["lr"], slow_lr)
            for w in range(m):
                for p, v in zip(plist[w], new):
                    p.copy_(v)
            if average_model_buffers:
                _replace_by_mean(
                    [[b for b in mod.buffers() if b.is_floating_point()] for mod in models]
                )
            if buffers == "reset":
                for o in opts:
                    o.state.clear()
            elif buffers == "average":
                _average_optimizer_buffers(opts, plist)
    return models


def _slow_step(
    slow: torch.optim.Optimizer,
    anchor: list[torch.Tensor],
    avg: list[torch.Tensor],
    lr: float,
    slow_lr: float,
) -> list[torch.Tensor]:
    """The slow step as SGD over the anchor on the pseudo-gradient ``(x0 - x_avg) / lr``; returns
    the new anchor."""
    for a, x in zip(anchor, avg):
        a.grad = (a - x) / lr
    slow.param_groups[0]["lr"] = slow_lr * lr
    slow.step()
    return anchor


def _local_steps(models: list[nn.Module], opts: list, k: int, lr: float | None) -> None:
    """Every worker's base step ``k`` on its own batch (at ``lr`` when given)."""
    for w, (model, opt) in enumerate(zip(models, opts)):
        if lr is not None:
            for g in opt.param_groups:
                g["lr"] = lr
        opt.zero_grad()
        loss_at(model, w, k).backward()
        opt.step()


def _mean(per_worker: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """The mean over workers of each tensor (one list of tensors per worker)."""
    m = len(per_worker)
    return [sum(ts[i] for ts in per_worker) / m for i in range(len(per_worker[0]))]


def _replace_by_mean(per_worker: list[list[torch.Tensor]]) -> None:
    """Every worker's tensors become their mean over workers."""
    for i, mean in enumerate(_mean(per_worker)):
        for ts in per_worker:
            ts[i].copy_(mean)


def _average_optimizer_buffers(opts: list, plist: list[list[torch.Tensor]]) -> None:
    """Average the per-element optimizer buffers (shaped like their parameter) over workers."""
    for i, p0 in enumerate(plist[0]):
        for key, v in opts[0].state[p0].items():
            if torch.is_tensor(v) and v.shape == p0.shape:
                _replace_by_mean([[o.state[ps[i]][key]] for o, ps in zip(opts, plist)])


def reference_allreduce(
    m: int,
    steps: int,
    make_opt: Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer],
    lr_schedule: Callable[[int], float] | None = lr_at,
) -> list[nn.Module]:
    """Replay AR-SGD for ``m`` workers (base='allreduce', tau=1, slow update off, buffers
    'maintain'): every step each worker's gradients are replaced by their mean over workers
    before its own optimizer step, and the floating-point model buffers are averaged after it
    (the outer step at every step); returns each worker's model."""
    models = [make_model() for _ in range(m)]
    opts = [make_opt(mod.parameters()) for mod in models]
    for k in range(steps):
        for w in range(m):
            if lr_schedule:
                for g in opts[w].param_groups:
                    g["lr"] = lr_schedule(k)
            opts[w].zero_grad()
            loss_at(models[w], w, k).backward()
        with torch.no_grad():
            plist = [list(mod.parameters()) for mod in models]
            for i in range(len(plist[0])):
                mean = sum(plist[w][i].grad for w in range(m)) / m
                for w in range(m):
                    plist[w][i].grad.copy_(mean)
        for o in opts:
            o.step()
        with torch.no_grad():
            blist = [[b for b in mod.buffers() if b.is_floating_point()] for mod in models]
            for i in range(len(blist[0])):
                mean = sum(blist[w][i] for w in range(m)) / m
                for w in range(m):
                    blist[w][i].copy_(mean)
    return models


def params_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def state_summary(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}
