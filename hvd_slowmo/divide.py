"""A division by a number that gives the same bits on every device.

For a Python number (a CPU scalar) as divisor, CUDA's ``div`` multiplies by the divisor's
float32 reciprocal (torch's ``div_true_kernel_cuda``) where the CPU divides: the two differ by
one ulp for many dividends whenever the reciprocal is not exact in binary (a mean over 3, 5, 6 or
7 workers; 1/448). A divisor that is a 0-dim tensor on the dividend's device is an IEEE division
everywhere, so a mean taken on a GPU has the CPU reference's bits. On the CPU both forms are the
same division (tests/test_divide.py checks the bits).
"""

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["div_", "foreach_div_"]


def _divisor(like: Tensor, n: float) -> Tensor:
    """``n`` as a 0-dim tensor of ``like``'s dtype on its device."""
    return torch.full((), n, dtype=like.dtype, device=like.device)


def div_(t: Tensor, n: float) -> Tensor:
    """``t /= n`` in place, an IEEE division on every device; returns ``t``.

    Args:
        t: a floating-point tensor.
        n: the divisor (a worker count, a weight, a learning rate).
    """
    return t.div_(_divisor(t, n))


def foreach_div_(tensors: Sequence[Tensor], n: float) -> None:
    """:func:`div_` of each tensor of ``tensors``.

    Args:
        tensors: floating-point tensors (any dtypes and devices).
        n: the divisor.
    """
    for t in tensors:
        div_(t, n)
