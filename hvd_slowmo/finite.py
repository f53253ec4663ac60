"""Whether tensors hold only finite values, at the cost of one fused norm pass (SlowMo,
arXiv 1910.00643: the outer step's NaN/inf check and the AMP overflow check).

A max-norm pass (``torch._foreach_norm(..., inf)``) is exact but on CPUs runs several times
slower than the optimizer step itself; the L2 norm is vectorized. A finite L2 norm proves every
element finite (an inf or NaN makes any sum of squares non-finite); a non-finite one, which
finite elements above ~1e19 in float32 could also give, is checked element by element.
"""

import torch
from torch import Tensor

__all__ = ["all_finite", "by_device_and_dtype"]


def by_device_and_dtype(
    tensors: list[Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    """``tensors`` grouped by device and dtype (the groups a fused ``_foreach`` op takes).

    Args:
        tensors: any tensors.
    """
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


@torch.no_grad()
def all_finite(tensors: list[Tensor]) -> bool:
    """True if no tensor holds an inf or NaN (no communication).

    Args:
        tensors: the tensors (parameters or gradients).
    """
    for group in by_device_and_dtype(tensors).values():
        if not bool(torch.stack(torch._foreach_norm(group, 2)).isfinite().all()):
            if not all(bool(t.isfinite().all()) for t in group):
                return False
    return True
