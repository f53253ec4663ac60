"""AR-SGD / AR-Adam: Horovod's per-step gradient average (arXiv 1910.00643, Section 3).

Every worker steps the same averaged gradient, so the parameters stay identical and the outer
step needs no exact average of them (:attr:`AllReduceSGD.needs_exact_average` is False).
"""

from .base import BaseAlgorithm, grads_or_zeros

__all__ = ["AllReduceSGD"]


class AllReduceSGD(BaseAlgorithm):
    """Average the gradients over all workers before every local step.

    Args:
        comm: the communicator over the SlowMo workers.
    """

    name = "allreduce"
    label = "AR-{opt}"
    communicates_every_step = True
    needs_exact_average = False
    averages_gradients = True

    def communicate_gradients(self) -> None:
        self.comm.average_(grads_or_zeros(self.params), name="hvd_slowmo.grad_average")
