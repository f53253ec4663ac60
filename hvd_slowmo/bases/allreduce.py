"""AR-SGD / AR-Adam: Horovod's per-step gradient average (arXiv 1910.00643, Section 3).

Every worker steps the same averaged gradient, so the parameters stay identical and the outer
step needs no exact average of them (:attr:`AllReduceSGD.needs_exact_average` is False). The
optimizer averages the gradients in buckets started during backward
(:mod:`hvd_slowmo.grad_buckets`), as Horovod's ``DistributedOptimizer`` and DDP do.
"""

from ..comm.base import Communicator
from ..validation import check_int, check_number
from .base import BaseAlgorithm

__all__ = ["AllReduceSGD"]


class AllReduceSGD(BaseAlgorithm):
    """Average the gradients over all workers before every local step.

    Args:
        comm: the communicator over the SlowMo workers.
        bucket_mb: megabytes (2**20 bytes) of gradients per bucket; a bucket's average starts
            once all its gradients are ready. Smaller buckets start earlier, larger ones make
            fewer collectives. None (default): each parameter on its own where the transport
            fuses what is ready itself (Horovod, as ``hvd.DistributedOptimizer``), else DDP's
            25 MB (:func:`hvd_slowmo.grad_buckets.choose_bucket_bytes`).
        backward_passes_per_step: backward passes whose gradients accumulate locally before
            each average (Horovod's argument): the average starts during the last one, and a
            further pass before ``step()`` raises.
    """

    name = "allreduce"
    label = "AR-{opt}"
    OPTIONS = ("bucket_mb", "backward_passes_per_step")
    communicates_every_step = True
    needs_exact_average = False
    averages_gradients = True

    def __init__(
        self,
        comm: Communicator,
        bucket_mb: float | None = None,
        backward_passes_per_step: int = 1,
    ) -> None:
        super().__init__(comm)
        if bucket_mb is not None:
            mb = check_number(
                "bucket_mb", bucket_mb, low=0.0, low_open=True, fix="e.g. bucket_mb=25"
            )
            self.bucket_bytes = max(1, int(mb * 2**20))
        self.backward_passes_per_step = check_int(
            "backward_passes_per_step",
            backward_passes_per_step,
            1,
            "the number of backward passes accumulated into each step's gradients",
        )
