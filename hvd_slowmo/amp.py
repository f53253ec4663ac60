"""Mixed precision: the ``torch.amp.GradScaler`` verdict made the same on every worker
(SlowMo, arXiv 1910.00643).

``DistributedOptimizer`` declares ``_step_supports_amp_scaling``, so ``GradScaler.step(opt)``
always calls ``opt.step()`` and hands over its verdict as ``opt.found_inf`` (and
``opt.grad_scale`` when ``scaler.unscale_(opt)`` was not called). :class:`MixedPrecision` then
makes the skip decision the same on every worker, so an overflow on one rank never leaves the
ranks one step apart (see :meth:`hvd_slowmo.DistributedOptimizer.step`). The gradients' own
communication is :mod:`hvd_slowmo.bases.gradient_path`.
"""

import torch
from torch import Tensor

from .bases.gradient_path import GradientPath
from .comm.base import Communicator
from .finite import all_finite, by_device_and_dtype

__all__ = ["MixedPrecision", "any_nonfinite", "overflow_anywhere", "unscale_grads_"]


@torch.no_grad()
def unscale_grads_(grads: list[Tensor], grad_scale: Tensor) -> bool:
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
    for (device, _), group in by_device_and_dtype(grads).items():
        found_inf = torch.zeros((), dtype=torch.float32, device=device)
        torch._amp_foreach_non_finite_check_and_unscale_(group, found_inf, inv_scale.to(device))
        found.append(found_inf)
    return bool(sum(float(f) for f in found))


def any_nonfinite(grads: list[Tensor]) -> bool:
    """True if any gradient holds inf/NaN (:func:`hvd_slowmo.finite.all_finite`).

    Args:
        grads: the gradients.
    """
    return not all_finite(grads)


def overflow_anywhere(
    comm: Communicator, grads_averaged: bool, grads: list[Tensor], overflow: bool
) -> bool:
    """Whether any worker's gradients overflowed this step: the same answer on every worker.

    Args:
        comm: the communicator over all workers.
        grads_averaged: every worker holds the same averaged gradients (the base's
            ``averages_gradients``): an inf/NaN on any worker is non-finite in the average, so
            a local check agrees everywhere with no collective (the scaler may have checked
            this worker's gradients before averaging).
        grads: this worker's (communicated) gradients.
        overflow: whether this worker's gradients held inf/NaN, as the scaler saw them.
    """
    if grads_averaged:
        return any_nonfinite(grads)
    flag = torch.tensor([1.0 if overflow else 0.0], dtype=torch.float64)
    comm.average_([flag], name="hvd_slowmo.amp_overflow")
    return flag.item() > 0


class MixedPrecision(GradientPath):
    """The gradient path with the loss scaler's verdict: whether this step happens, decided the
    same way on every worker (a mixin of :class:`hvd_slowmo.DistributedOptimizer`)."""

    #: ``torch.amp.GradScaler.step`` always calls ``step()`` and passes its verdict, so the
    #: decision to skip an overflowed step is made the same on every worker.
    _step_supports_amp_scaling = True
    #: Steps skipped on every worker because a GradScaler found inf/NaN gradients on any worker.
    skipped_steps = 0

    def _gradients_ready(self) -> bool:
        """Communicate the gradients (unless already done) and apply the scaler's verdict.

        Returns:
            False when any worker's gradients overflowed (under a ``GradScaler``): every worker
            then skips the step.
        """
        # Set by GradScaler.step around the step() call (see _step_supports_amp_scaling).
        found_inf: Tensor | None = getattr(self, "found_inf", None)
        if self._wait_deferred:  # the averages land before anything here reads the gradients
            self._wait_deferred = False
            self._average_gradients()
        grad_scale: Tensor | None = getattr(self, "grad_scale", None)
        overflow = found_inf is not None and bool(found_inf.sum().item())
        if grad_scale is not None and not self._synchronized:
            # scaler.step(opt) without scaler.unscale_(opt): unscale before communicating, since
            # the workers' loss scales differ once one of them has backed off from an overflow.
            overflow = unscale_grads_(self._grads(), grad_scale) or overflow
            grad_scale = None
        if not self._skip_synchronize:
            self.synchronize()
        self._synchronized = False
        if found_inf is None:
            return True
        if grad_scale is not None:  # communicated by an explicit synchronize(), still scaled
            overflow = unscale_grads_(self._grads(), grad_scale) or overflow
        return not overflow_anywhere(
            self.comm, self.base.averages_gradients, self._grads(), overflow
        )

    def _grads(self) -> list[Tensor]:
        return [p.grad for p in self.params if p.grad is not None]
