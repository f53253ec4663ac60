"""The slow momentum update of SlowMo (Algorithm 1, lines 7-8; arXiv 1910.00643), as pure
tensor math.

No communication happens here: the caller has already put the exact average into ``params``.
"""

import torch
from torch import Tensor

__all__ = ["slow_momentum_step_"]


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
