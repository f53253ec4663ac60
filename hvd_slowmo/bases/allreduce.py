"""AR-SGD / AR-Adam: Horovod's per-step gradient average (arXiv 1910.00643, Section 3).

Every worker steps the same averaged gradient, so the parameters stay identical and the outer
step needs no exact average of them (:attr:`AllReduceSGD.needs_exact_average` is False). The
base hands the optimizer its gradient average (:meth:`AllReduceSGD.gradient_average`): buckets
started during backward (:mod:`hvd_slowmo.bases.gradient_buckets`), as Horovod's
``DistributedOptimizer`` and DDP do.
"""

from collections.abc import Sequence

from torch import Tensor

from ..comm.base import Communicator
from ..validation import check_int, check_number
from .base import BaseAlgorithm
from .gradient_buckets import BucketedAverage

#: The label of the gradient average over the workers (Horovod matches collectives by label).
LABEL = "hvd_slowmo.grad_average"

__all__ = ["AllReduceSGD"]


class AllReduceSGD(BaseAlgorithm):
    """Average the gradients over all workers before every local step.

    Args:
        comm: the communicator over the SlowMo workers.
        bucket_mb: megabytes (2**20 bytes) of gradients per bucket; a bucket's average starts
            once all its gradients are ready. Smaller buckets start earlier, larger ones make
            fewer collectives. None (default): each parameter on its own where the transport
            fuses what is ready itself (Horovod, as ``hvd.DistributedOptimizer``), else DDP's
            25 MB (:func:`hvd_slowmo.bases.gradient_buckets.choose_bucket_bytes`).
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

    def gradient_average(
        self, params: Sequence[Tensor], names: Sequence[str], node: Communicator | None
    ) -> BucketedAverage | None:
        """The gradients averaged inside the node (``worker="node"``), then over the workers,
        bucket by bucket as backward produces them; None with one worker and no node level.

        Args:
            params: the parameters, in the index order used on every rank.
            names: their names, for the errors.
            node: this rank's node, or None.
        """
        stages = self._node_stages(node)
        if self.comm.size > 1:
            stages.append((self.comm, LABEL))
        return self._bucketed(params, names, stages, in_backward=True)
