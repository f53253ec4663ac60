"""Mixed precision: the gradient checks behind a ``torch.amp.GradScaler`` step (arXiv 1910.00643).

``DistributedOptimizer`` declares ``_step_supports_amp_scaling``, so ``GradScaler.step(opt)``
always calls ``opt.step()`` and hands over its verdict as ``opt.found_inf`` (and
``opt.grad_scale`` when ``scaler.unscale_(opt)`` was not called). The optimizer then makes the
skip decision the same on every worker, so an overflow on one rank never leaves the ranks one
step apart (see :meth:`hvd_slowmo.DistributedOptimizer.step`). These are the tensor parts of it.
"""

from typing import Dict, List, Tuple

import torch
from torch import Tensor

__all__ = ["unscale_grads_", "any_nonfinite"]


def _by_device_and_dtype(tensors: List[Tensor]) -> Dict[Tuple[torch.device, torch.dtype], List[Tensor]]:
    groups: Dict[Tuple[torch.device, torch.dtype], List[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


@torch.no_grad()
def unscale_grads_(grads: List[Tensor], grad_scale: Tensor) -> bool:
    """Divide gradients by the loss scale in place, as ``GradScaler.unscale_`` does, and say
    whether any of them holds inf/NaN.

    Args:
        grads: the (already communicated) gradients.
        grad_scale: the scaler's current loss scale (a one-element tensor).

    Returns:
        True if any gradient is non-finite.
    """
    # The reciprocal in float64, then float32: GradScaler's own rounding of 1/scale.
    inv_scale = grad_scale.double().reciprocal().float()
    found = []
    for (device, _), group in _by_device_and_dtype(grads).items():
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale.to(device))
        found.append(found_inf)
    return bool(sum(float(f) for f in found))


@torch.no_grad()
def any_nonfinite(grads: List[Tensor]) -> bool:
    """True if any gradient holds inf/NaN (one fused max-norm pass per device and dtype).

    Args:
        grads: the gradients.
    """
    for group in _by_device_and_dtype(grads).values():
        if not bool(torch.stack(torch._foreach_norm(group, float("inf"))).isfinite().all()):
            return True
    return False
