"""One training run with AMP overflows, shared by the thread tests and the horovodrun worker.

An overflow is forced by writing inf into one rank's gradient at chosen iterations. The
reference is the same run without a GradScaler in which those iterations never happen (their
batches are never seen). Loss scales are powers of two, so scaling and unscaling are exact and
the two runs can be compared bitwise.
"""

from typing import Any

import torch
from torch import nn

import hvd_slowmo

from reference import batch

#: Recipes: "reference" (no scaler; the skipped iterations are left out), "manual" (the issue's
#: sequence without a scaler: backward, synchronize(), no step() on every rank), "scaler"
#: (scaler.step(opt)), "horovod" (synchronize(), unscale_(), skip_synchronize(): scaler.step(opt)),
#: "unskipped" (a test of the test: the manual recipe's overflow injected, then step() taken).
RECIPES = ("reference", "manual", "scaler", "horovod", "unskipped")


def mlp() -> nn.Module:
    """No BatchNorm: a forward pass in an overflowed iteration must leave no trace."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 2))


def snapshot(model: nn.Module):
    return [p.detach().clone() for p in model.parameters()]


def _overflow(value: float | None):
    """A gradient hook writing ``value`` (None: inf) into element [0, 0]."""
    bad = torch.tensor(float("inf") if value is None else value)
    at = (torch.tensor(0), torch.tensor(0))
    return lambda g: g.index_put(at, bad)


def run(
    model: nn.Module,
    recipe: str,
    skipped: set[int],
    bad_rank: int,
    steps: int,
    rank: int,
    communicator: Any = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """Train one worker; returns its parameters after every outer step, final state and counters.

    Args:
        model: this worker's model, from :func:`mlp` (the same on every worker).
        recipe: one of :data:`RECIPES`.
        skipped: the iterations that overflow (on ``bad_rank``; every rank skips them).
        bad_rank: the rank whose gradients overflow (scaler recipes).
        steps: iterations, skipped ones included.
        rank: this worker's rank (selects its batches).
        communicator: the communicator (None: Horovod's).
        **kwargs: DistributedOptimizer arguments (base, tau, worker, ...).
    """
    opt = hvd_slowmo.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True),
        named_parameters=model.named_parameters(),
        communicator=communicator,
        **kwargs,
    )
    scaler: torch.amp.GradScaler | None = None
    if recipe in ("scaler", "horovod"):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    snaps, unchanged_by_skip = [], True
    outer = 0
    for k in range(steps):
        if recipe == "reference" and k in skipped:
            continue
        before = snapshot(model)
        opt.zero_grad()
        x, y = batch(rank, k)
        loss = ((model(x) - y) ** 2).mean()
        hook = None
        if k in skipped and (recipe in ("manual", "unskipped") or rank == bad_rank):
            # Overflow: on every rank for the manual recipe (the caller decides to skip everywhere),
            # on bad_rank only under a scaler (the library must spread the decision). It happens
            # inside backward, where a real overflow does, before any gradient is communicated.
            hook = next(model.parameters()).register_hook(
                _overflow(1e6 if scaler is None else None)
            )
        (scaler.scale(loss) if scaler else loss).backward()
        if hook is not None:
            hook.remove()
        _step(opt, scaler, recipe, skip=k in skipped)
        if k in skipped:
            unchanged_by_skip &= all(torch.equal(a, b) for a, b in zip(before, snapshot(model)))
        if opt.outer_steps != outer:
            outer = opt.outer_steps
            snaps.append(snapshot(model))
    return {
        "snaps": snaps,
        "final": snapshot(model),
        "unchanged_by_skip": unchanged_by_skip,
        "counters": (opt.num_steps, opt.inner_step, opt.outer_steps),
        "skipped_steps": opt.skipped_steps,
    }


def _step(
    opt: torch.optim.Optimizer, scaler: torch.amp.GradScaler | None, recipe: str, skip: bool
) -> None:
    """The optimizer step of one iteration, as ``recipe`` takes it.

    Args:
        opt: the DistributedOptimizer.
        scaler: the GradScaler of the scaler recipes, else None.
        recipe: one of :data:`RECIPES`.
        skip: whether this iteration overflowed (the manual recipe then takes no step).
    """
    if recipe == "manual":
        opt.synchronize()
        if not skip:  # else the next backward must be communicated afresh
            with opt.skip_synchronize():
                opt.step()
    elif recipe == "scaler":
        scaler.step(opt)
        scaler.update()
    elif recipe == "horovod":
        opt.synchronize()
        scaler.unscale_(opt)
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
    else:
        opt.step()
