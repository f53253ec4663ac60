"""The per-step gradient average in buckets, started during backward (SlowMo's AR-SGD base and
the node-level average of ``worker="node"``; arXiv 1910.00643, Section 3). A base algorithm
builds it (:meth:`hvd_slowmo.bases.base.BaseAlgorithm.gradient_average`) and hands it to the
optimizer, which feeds it the backward pass's gradients and waits for it before the step.

As Horovod's optimizer and PyTorch DDP do it: a hook on each parameter counts the backward
passes that accumulate into its gradient; once every parameter of a bucket holds its final
gradient (the last of ``backward_passes_per_step`` passes), the bucket's average starts
asynchronously and the backward pass goes on. :meth:`BucketedAverage.finish` waits for them.

Buckets start in bucket order on every rank (a bucket waits for the ones before it, as in
DDP): transports that match collectives by order (threads, MPI) then pair the same buckets
everywhere, and Horovod, which matches them by name, is unaffected. A parameter that gets no
gradient on a rank holds its bucket back until :meth:`BucketedAverage.finish`, which gives it
zeros (Horovod's rule), so every rank enters every bucket's average and none hangs.

A bucket may pass through several communicators in turn (``worker="node"`` with AR-SGD: inside
the node, then across nodes); the next stage of a bucket starts when a later bucket starts, or
at :meth:`~BucketedAverage.finish`.
"""

from collections.abc import Sequence

import torch
from torch import Tensor

from ..comm.base import Communicator, PendingAverage

__all__ = [
    "BUCKET_BYTES",
    "BucketedAverage",
    "Stage",
    "choose_bucket_bytes",
    "grads_or_zeros",
    "plan_buckets",
]

#: A communicator to average over and the label of its averages (Horovod matches by label).
Stage = tuple[Communicator, str]


#: The first bucket's limit (DDP's): small, so the first average starts early in backward.
FIRST_BUCKET_BYTES = 2**20
#: The other buckets' limit where the transport does not fuse averages itself (DDP's).
BUCKET_BYTES = 25 * 2**20


def choose_bucket_bytes(requested: int | None, stages: Sequence[Stage]) -> int:
    """The bucket size of a per-step gradient average over ``stages``.

    Horovod fuses the averages that are ready in the same cycle into one collective, so a
    bucket that waits for its last gradient only holds back the ones ready before it (on the
    emulated cluster, 25 MB buckets ran 30% behind ``hvd.DistributedOptimizer``, one parameter
    per bucket as fast: README, "Cluster benchmark"). Other transports run each bucket as one
    collective and get DDP's sizes; so does a chain of two (``worker="node"``), where a bucket
    waits for its first stage before its second.

    Args:
        requested: the user's ``bucket_mb`` in bytes, or None for the transport's choice.
        stages: the communicators the gradients are averaged over, in turn.
    """
    if requested is not None:
        return requested
    if len(stages) == 1 and stages[0][0].fuses_averages:
        return 1  # one parameter per bucket: every parameter exceeds it
    return BUCKET_BYTES


def plan_buckets(
    nbytes: Sequence[int], bucket_bytes: int, first_bytes: int = FIRST_BUCKET_BYTES
) -> list[list[int]]:
    """Parameter indices grouped into buckets, the last parameter first.

    Backward produces gradients roughly in the reverse of the order in which the forward pass
    uses parameters (their registration order, in most models), so the first bucket fills
    first. Each bucket holds whole parameters, up to ``bucket_bytes`` of gradient (the first
    one up to ``min(first_bytes, bucket_bytes)``, as DDP does); a parameter larger than that is
    a bucket of its own.

    Args:
        nbytes: each parameter's gradient size in bytes, in parameter index order.
        bucket_bytes: the most bytes a bucket of several parameters may hold (>= 1).
        first_bytes: the most bytes the first bucket may hold.
    """
    buckets: list[list[int]] = []
    size = 0
    for i in reversed(range(len(nbytes))):
        limit = min(first_bytes, bucket_bytes) if len(buckets) == 1 else bucket_bytes
        if not buckets or size + nbytes[i] > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(i)
        size += nbytes[i]
    return buckets


def grads_or_zeros(params: list[Tensor]) -> list[Tensor]:
    """The gradients of ``params``, giving zeros to those without one.

    Like Horovod: a parameter without a gradient on this rank joins with zeros, so every rank
    enters the same collective and unused parameters cannot deadlock the job.

    Args:
        params: the parameters, in the same order on every rank.
    """
    out = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        out.append(p.grad)
    return out


class BucketedAverage:
    """Each step's gradient average over a chain of communicators, started bucket by bucket.

    Args:
        params: the parameters, in the index order used on every rank.
        names: their names, for the errors.
        stages: the communicators to average over, in turn, each with the label of its
            averages.
        passes: backward passes that accumulate into the gradients before each average
            (Horovod's ``backward_passes_per_step``).
        bucket_bytes: the most gradient bytes a bucket of several parameters holds.
        in_backward: start each bucket's average as soon as its gradients are final, during
            backward (AR-SGD); False: everything at :meth:`finish` (the node-level average of
            the other bases, at ``synchronize()``).
    """

    def __init__(
        self,
        params: Sequence[Tensor],
        names: Sequence[str],
        stages: Sequence[Stage],
        passes: int,
        bucket_bytes: int,
        in_backward: bool = True,
    ) -> None:
        self.params = list(params)
        self.names = list(names)
        self.stages = list(stages)
        self.passes = passes
        self.in_backward = in_backward
        self.buckets = plan_buckets(
            [p.numel() * p.element_size() for p in self.params], bucket_bytes
        )
        self._bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket}
        self._index = {id(p): i for i, p in enumerate(self.params)}
        #: True once this step's gradients are averaged, until :meth:`take` (the step took
        #: them) or :meth:`discard`: a further backward pass before then is one too many.
        self.averaged = False
        self._reset()

    def _reset(self) -> None:
        # Backward passes each parameter still accumulates before its gradient is final.
        self._left = [self.passes] * len(self.params)
        self._missing = [len(bucket) for bucket in self.buckets]  # parameters not yet final
        self._started = 0  # buckets [0, _started) have started
        self._in_flight: list[tuple[int, int, PendingAverage]] = []  # (bucket, stage, handle)
        #: True once some parameter got its final gradient: this backward pass is the last one.
        self.last_pass = False

    @property
    def in_flight(self) -> bool:
        """Whether any bucket has started and not been waited for."""
        return bool(self._in_flight)

    def gradient_ready(self, param: Tensor) -> None:
        """A backward pass accumulated into ``param``'s gradient; start every bucket that is now
        complete (in bucket order). Does nothing unless :attr:`in_backward`.

        Args:
            param: one of the parameters.

        Raises:
            RuntimeError: more backward passes than ``backward_passes_per_step`` before the
                average was waited for.
        """
        if not self.in_backward:
            return
        index = self._index[id(param)]
        if self.averaged or self._left[index] == 0:
            raise RuntimeError(
                f"parameter {self.names[index]!r} got a gradient from more than "
                f"backward_passes_per_step={self.passes} backward passes before step() or "
                "synchronize(): its average has already started. Pass "
                "backward_passes_per_step=<passes per step> to accumulate gradients locally, "
                "or call zero_grad() to start the step over"
            )
        self._left[index] -= 1
        if self._left[index]:
            return
        self.last_pass = True
        self._missing[self._bucket_of[index]] -= 1
        while self._started < len(self.buckets) and self._missing[self._started] == 0:
            self._start(self._started)

    def finish(self) -> None:
        """Average whatever has not been averaged yet and wait for every bucket: start the
        remaining buckets in order (a parameter without a gradient joins with zeros, one that
        saw fewer passes with what it has), then wait. Does nothing once :attr:`averaged`."""
        if self.averaged:
            return
        try:
            while self._started < len(self.buckets):
                self._start(self._started)
            self._advance()
            for _, _, pending in self._in_flight:
                pending.wait()
        finally:
            # Also after a failed collective: hvd.elastic retries the step with a fresh world,
            # and nothing of this step may stay in flight.
            self._reset()
        self.averaged = True

    def take(self) -> None:
        """The step took this step's averaged gradients: the next backward pass starts the next
        step's average."""
        self.averaged = False

    def discard(self) -> None:
        """Wait for any bucket in flight (the transport may still write the gradients), then
        forget this step's progress: the next step averages afresh."""
        try:
            for _, _, pending in self._in_flight:
                pending.wait()
        finally:
            self._reset()
            self.averaged = False

    def _grads(self, bucket: int) -> list[Tensor]:
        return grads_or_zeros([self.params[i] for i in self.buckets[bucket]])

    def _start(self, bucket: int) -> None:
        # Earlier buckets move on to their next stage first, so every communicator sees the
        # buckets in the same order on every rank.
        self._advance()
        comm, label = self.stages[0]
        self._in_flight.append(
            (bucket, 0, comm.average_start(self._grads(bucket), f"{label}.{bucket}"))
        )
        self._started = bucket + 1

    def _advance(self) -> None:
        """Move every bucket in flight to its last stage (waiting for the earlier ones)."""
        stages = self.stages
        for k, (bucket, stage, pending) in enumerate(self._in_flight):
            while stage + 1 < len(stages):
                pending.wait()
                stage += 1
                comm, label = stages[stage]
                pending = comm.average_start(self._grads(bucket), f"{label}.{bucket}")
            self._in_flight[k] = (bucket, stage, pending)
