"""Local SGD / Local Adam: no communication in the inner loop (arXiv 1910.00643, Section 3).

With SlowMo's exact average every ``tau`` steps and ``slow_lr=1, slow_momentum=0`` this is
Local SGD; with ``slow_momentum > 0`` it is BMUF; with one worker and ``slow_momentum=0``,
Lookahead.
"""

from .base import BaseAlgorithm

__all__ = ["LocalSGD"]


class LocalSGD(BaseAlgorithm):
    """Each worker steps its own copy; the workers meet only at the outer step's exact average.

    Args:
        comm: the communicator over the SlowMo workers (unused in the inner loop).
    """

    name = "localsgd"
    label = "Local {opt}"
