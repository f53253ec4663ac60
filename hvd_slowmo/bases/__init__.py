"""Base algorithms (arXiv 1910.00643, Section 3 and Appendix C) and their registry.

The protocol a base algorithm follows is documented in :mod:`hvd_slowmo.bases.base`;
``DistributedOptimizer(base=...)`` takes a registered name or a :class:`BaseAlgorithm` subclass.
"""

from .allreduce import AllReduceSGD
from .base import BaseAlgorithm
from .gossip import DPSGD, OSGP, SGP
from .gradient_buckets import grads_or_zeros
from .localsgd import LocalSGD

__all__ = [
    "BASES",
    "DPSGD",
    "OSGP",
    "SGP",
    "AllReduceSGD",
    "BaseAlgorithm",
    "LocalSGD",
    "grads_or_zeros",
    "resolve_base",
]

#: Registered base algorithms, name -> class, in the paper's table order (the report's rows).
BASES: dict[str, type[BaseAlgorithm]] = {
    cls.name: cls for cls in (LocalSGD, OSGP, SGP, DPSGD, AllReduceSGD)
}


def resolve_base(base: object) -> type[BaseAlgorithm]:
    """The class of ``DistributedOptimizer(base=...)``: a registered name or a subclass.

    Args:
        base: a name in :data:`BASES` or a :class:`BaseAlgorithm` subclass.

    Raises:
        TypeError: neither a string nor a :class:`BaseAlgorithm` subclass.
        ValueError: an unknown name.
    """
    if isinstance(base, type) and issubclass(base, BaseAlgorithm):
        return base
    names = ", ".join(repr(n) for n in BASES)
    if not isinstance(base, str):
        raise TypeError(
            f"base must be one of {names} or a hvd_slowmo.bases.BaseAlgorithm "
            f"subclass, got {base!r}"
        )
    if base not in BASES:
        raise ValueError(
            f"base must be one of {names} or a hvd_slowmo.bases.BaseAlgorithm "
            f"subclass, got {base!r}"
        )
    return BASES[base]
