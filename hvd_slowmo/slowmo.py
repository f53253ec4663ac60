"""The slow momentum update of SlowMo (Algorithm 1, lines 7-8; arXiv 1910.00643), the
provisional step of eager updates (arXiv 2502.12996; recurrences in :mod:`hvd_slowmo.fragments`)
and the landing of an overlapped outer step with its mixing factor (arXiv 2501.18512), as pure
tensor math.

No communication happens here: the caller has already put the exact average into ``params``.
"""

import torch
from torch import Tensor

from .divide import div_

__all__ = [
    "eager_anchor_",
    "eager_landed_",
    "land_",
    "local_anchor_",
    "local_gradient",
    "slow_momentum_step_",
]


def slow_momentum_step_(
    params: list[Tensor],
    anchor: list[Tensor],
    slow_buffer: list[Tensor],
    lr: float,
    slow_lr: float,
    slow_momentum: float,
    nesterov: bool = False,
) -> None:
    """One slow momentum step, in place, fused over a list of tensors.

    Computes ``u <- beta * u + (x0 - x_avg) / lr`` and ``x0 <- x0 - alpha * lr * u``, then writes
    the new anchor into ``params`` so every worker starts the next outer step from it.
    The pseudo-gradient is divided by the base learning rate so that the slow buffer does not
    change scale when a schedule changes ``lr`` (Section 2 of the paper).

    Args:
        params: the exact average ``x_avg`` on entry; the new anchor ``x0`` on return. Used as
            scratch space, so no temporary of the parameters' size is allocated.
        anchor: ``x0``, the parameters at the start of the outer step; updated in place.
        slow_buffer: ``u``, the slow momentum buffer; updated in place.
        lr: the base optimizer's current learning rate ``gamma_t`` (must be > 0).
        slow_lr: ``alpha``.
        slow_momentum: ``beta``.
        nesterov: Nesterov slow momentum (as in DiLoCo-style training):
            ``x0 <- x0 - alpha * lr * (g + beta * u)`` with ``g = (x0 - x_avg) / lr``, the form of
            ``torch.optim.SGD(nesterov=True)``.
    """
    if not params:
        return
    if not lr > 0:
        raise ValueError(
            f"slow_momentum_step_: lr must be > 0 to scale the pseudo-gradient, got {lr}"
        )
    # params <- x_avg - x0 = -lr * pseudo-gradient (exact when the two are close: Sterbenz).
    torch._foreach_sub_(params, anchor)
    torch._foreach_mul_(slow_buffer, slow_momentum)
    torch._foreach_add_(slow_buffer, params, alpha=-1.0 / lr)
    if nesterov:
        # -alpha * lr * g == alpha * params, so no temporary is needed for the gradient term.
        torch._foreach_add_(anchor, slow_buffer, alpha=-slow_lr * lr * slow_momentum)
        torch._foreach_add_(anchor, params, alpha=slow_lr)
    else:
        torch._foreach_add_(anchor, slow_buffer, alpha=-slow_lr * lr)
    torch._foreach_copy_(params, anchor)


def _provisional_anchor_(
    snapshot: list[Tensor],
    anchor: list[Tensor],
    slow_buffer: list[Tensor] | None,
    estimate: list[Tensor],
    lr: float,
    slow_lr: float,
    slow_momentum: float,
    nesterov: bool,
) -> None:
    """``snapshot <- x0 - alpha lr u^`` with ``u^ = beta u + G^`` (Nesterov: ``G^ + beta u^``).
    ``estimate`` (``G^``) is overwritten under Nesterov."""
    if slow_buffer is None:  # no slow update (alpha = 1, beta = 0): x^0 = x0 - lr G^
        step = estimate
    else:
        step = list(torch._foreach_mul(slow_buffer, slow_momentum))
        torch._foreach_add_(step, estimate)  # u^
    if nesterov:
        torch._foreach_add_(estimate, step, alpha=slow_momentum)
        step = estimate
    torch._foreach_copy_(snapshot, anchor)
    torch._foreach_add_(snapshot, step, alpha=-slow_lr * lr)


def eager_anchor_(
    snapshot: list[Tensor],
    anchor: list[Tensor],
    slow_buffer: list[Tensor] | None,
    others: list[Tensor],
    lr: float,
    slow_lr: float,
    slow_momentum: float,
    workers: int,
    nesterov: bool = False,
) -> None:
    """The provisional slow step of an eager update (``eager="shares"``), in place: with
    ``g = (x0 - s) / lr``, ``G^ = c + g / m``, ``u^ = beta u + G^``, ``x^0 = x0 - alpha lr u^``
    (Nesterov: ``x0 - alpha lr (G^ + beta u^)``), then ``c <- -g / m``. The anchor and the slow
    buffer are not changed: the exact step replaces this one when the average lands.

    Args:
        snapshot: ``s``, this worker's parameters at the boundary on entry; ``x^0`` on return.
        anchor: ``x0``.
        slow_buffer: ``u``; None without a slow update (``alpha = 1, beta = 0``).
        others: ``c``, the other workers' shares of the previous outer gradient (zeros before
            the first landing); ``-g / m`` on return (:func:`eager_landed_` completes it).
        lr: the base learning rate ``gamma`` at the boundary (must be > 0).
        slow_lr: ``alpha``.
        slow_momentum: ``beta``.
        workers: ``m``.
        nesterov: Nesterov slow momentum.
    """
    if not snapshot:
        return
    if not lr > 0:
        raise ValueError(f"eager_anchor_: lr must be > 0 to scale the outer gradient, got {lr}")
    own = torch._foreach_sub(anchor, snapshot)  # g / m
    torch._foreach_mul_(own, 1.0 / (lr * workers))
    torch._foreach_add_(others, own)  # others holds the estimate G^ now
    _provisional_anchor_(
        snapshot, anchor, slow_buffer, others, lr, slow_lr, slow_momentum, nesterov
    )
    torch._foreach_neg_(own)
    torch._foreach_copy_(others, own)


def local_anchor_(
    snapshot: list[Tensor],
    anchor: list[Tensor],
    slow_buffer: list[Tensor] | None,
    lr: float,
    slow_lr: float,
    slow_momentum: float,
    nesterov: bool = False,
) -> None:
    """The provisional slow step of ``eager="local"``, in place: the worker's own fresh outer
    gradient ``g = (x0 - s) / lr`` stands in for the average, ``u^ = beta u + g``,
    ``x^0 = x0 - alpha lr u^`` (Nesterov: ``x0 - alpha lr (g + beta u^)``). Nothing is kept
    for the next outer step; the anchor and the slow buffer are not changed.

    Args:
        snapshot: ``s``, this worker's parameters at the boundary on entry; ``x^0`` on return.
        anchor: ``x0``.
        slow_buffer: ``u``; None without a slow update (``alpha = 1, beta = 0``).
        lr: the base learning rate ``gamma`` at the boundary (must be > 0).
        slow_lr: ``alpha``.
        slow_momentum: ``beta``.
        nesterov: Nesterov slow momentum.
    """
    if not snapshot:
        return
    if not lr > 0:
        raise ValueError(f"local_anchor_: lr must be > 0 to scale the outer gradient, got {lr}")
    own = list(torch._foreach_sub(anchor, snapshot))
    torch._foreach_mul_(own, 1.0 / lr)  # g
    _provisional_anchor_(snapshot, anchor, slow_buffer, own, lr, slow_lr, slow_momentum, nesterov)


def local_gradient(
    provisional: Tensor,
    anchor: Tensor,
    slow_buffer: Tensor | None,
    lr: float,
    slow_lr: float,
    slow_momentum: float,
    nesterov: bool = False,
) -> Tensor:
    """``lr g = x0 - s`` recovered from the provisional anchor of :func:`local_anchor_` (to
    rounding: for the replica-spread metric, which needs ``s`` after it was overwritten):
    ``x0 - x^0 = alpha lr (k g + b u)`` with ``k = 1, b = beta`` (Nesterov: ``1 + beta``,
    ``beta^2``).

    Args:
        provisional: ``x^0``.
        anchor: ``x0`` (not yet changed by the landing's slow step).
        slow_buffer: ``u`` (likewise); None without a slow update.
        lr, slow_lr, slow_momentum, nesterov: as for :func:`local_anchor_`.
    """
    out = div_(anchor - provisional, slow_lr)
    if slow_buffer is not None:
        b = slow_momentum * slow_momentum if nesterov else slow_momentum
        out.sub_(slow_buffer, alpha=lr * b)
    return div_(out, 1.0 + slow_momentum if nesterov else 1.0)


def eager_landed_(
    others: list[Tensor], anchor: list[Tensor], average: list[Tensor], lr: float
) -> None:
    """Complete the other workers' shares when the exact average lands (before the slow step):
    ``c <- c + (x0 - avg) / lr``, so ``c = (1/m) sum_{j != i} g_j`` at the next boundary.

    Args:
        others: ``c``, ``-g / m`` since :func:`eager_anchor_`.
        anchor: ``x0`` (before the slow step).
        average: the exact average of the snapshots.
        lr: the learning rate of the boundary (> 0).
    """
    if not others:
        return
    exact = torch._foreach_sub(anchor, average)
    torch._foreach_mul_(exact, 1.0 / lr)
    torch._foreach_add_(others, exact)


def land_(live: list[Tensor], snapshot: list[Tensor], landed: list[Tensor], mix: float) -> None:
    """The landing of an overlapped outer step (``overlap >= 1``), in place: each worker keeps
    its progress since the snapshot and, with the mixing factor ``mix``, a fraction of its own
    difference from the landed value at the boundary (Streaming DiLoCo, arXiv 2501.18512)::

        x_i <- x0 + (x_i - s_i) + mix (s_i - x0)
             = mix x_i + (1 - mix) (x0 + (x_i - s_i))

    the paper's ``alpha * local + (1 - alpha) * global`` with ``global`` the landed value as this
    library lands it without mixing (the worker's progress since ``s_i`` carried over). ``mix =
    0`` is that landing, with the same two operations, bit for bit.

    Args:
        live: ``x_i``, the worker's current tensors; the landed ones on return.
        snapshot: ``s_i``, the worker's tensors at the boundary (with eager updates, the
            provisional anchor it continued from); used as scratch space when ``mix > 0``.
        landed: ``x0``, the new anchor (for the model's and the base optimizer's buffers: their
            average at the boundary).
        mix: the mixing factor, in ``[0, 1)``.
    """
    if not live:
        return
    torch._foreach_sub_(live, snapshot)
    torch._foreach_add_(live, landed)
    if mix:
        torch._foreach_sub_(snapshot, landed)  # s_i - x0: the snapshot is not used after this
        torch._foreach_add_(live, snapshot, alpha=mix)
