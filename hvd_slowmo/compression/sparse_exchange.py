"""The exact average of sparse packets, built from one all-gather (sparse payloads cannot be
summed by an allreduce).

For ``m`` workers, each with a flat float32 vector ``v_i`` of ``n`` elements (its
pseudo-gradient ``anchor - parameters`` in SlowMo's outer step, arXiv 1910.00643):

1. Error feedback (optional, SparseLoCo's, arXiv 2508.15706): worker ``i`` keeps a residual
   ``e_i``; it sets ``e_i <- decay * e_i + v_i`` and sends ``C(e_i)``, the packet of
   :func:`~hvd_slowmo.compression.sparse.sparse_encode`, then keeps ``e_i <- e_i - D(C(e_i))``
   (``D``: decode). Without it, worker ``i`` sends ``C(v_i)``.
2. One all-gather hands every worker every packet (all of one size, in rank order).
3. Every worker decodes the packets and adds them, in rank order, into a float32 vector of
   zeros (each packet's positions are distinct, so each addition is one float32 add per
   entry; :func:`~hvd_slowmo.compression.sparse.sparse_sum` decodes all ``m`` at once), then
   divides by ``m``: the same operations on the same bits, so every worker holds
   the same average, bit for bit.

Each worker sends ``(m - 1)`` packets' worth on a ring all-gather (the communicator's
``bytes_sent``): unlike an allreduce this grows with ``m``.
"""

from torch import Tensor

from ..comm.base import Communicator, PendingTensors
from .codecs import check_transport, check_vector
from .sparse import (
    SparseCodec,
    packet_nbytes,
    sparse_encode,
    sparse_encode_with_feedback,
    sparse_sum,
)

__all__ = ["PendingSparseMean", "sparse_mean"]


def sparse_mean(
    comm: Communicator,
    flat: Tensor,
    codec: SparseCodec,
    name: str,
    residual: Tensor | None = None,
) -> Tensor:
    """The average over all workers of the sparse packets of ``flat``; identical bits on every
    worker. Collective.

    With one worker the average is ``flat`` itself (copied; nothing is encoded, the residual is
    not touched), as for the other codecs.

    Args:
        comm: the workers (needs ``allgather_flat``).
        flat: this worker's 1-D float32 vector; the same length on every worker.
        codec: the settings, the same on every worker.
        name: a label for the all-gather (Horovod matches collectives by name).
        residual: this worker's error-feedback residual (1-D float32, ``flat``'s length),
            updated in place at the start; None: no error feedback.

    Returns:
        A new 1-D float32 tensor: the average of the decoded packets.
    """
    return PendingSparseMean(comm, flat, codec, name, residual).wait()


class PendingSparseMean:
    """:func:`sparse_mean` in flight: the packet is encoded and the all-gather started on
    construction (the residual is updated there); the packets are summed once :meth:`poll`
    finds the all-gather done, or at :meth:`wait`. Arguments as for :func:`sparse_mean`, and
    ``out``: a float32 buffer of ``ceil(n / chunk) * chunk`` elements to sum into (the result
    is a view of it; a caller that consumes each result before its next mean reuses it), None:
    a new one. Collective.
    """

    def __init__(
        self,
        comm: Communicator,
        flat: Tensor,
        codec: SparseCodec,
        name: str,
        residual: Tensor | None = None,
        out: Tensor | None = None,
    ) -> None:
        check_vector(flat, residual, "sparse_mean")
        check_transport(comm, codec)
        self._comm, self._codec, self._numel, self._out = comm, codec, flat.numel(), out
        self._result: Tensor | None = flat.clone() if comm.size == 1 else None
        if self._result is not None:
            return
        if residual is None:
            packet = sparse_encode(flat, codec)
        else:  # the residual (the contribution itself) less what its packet decodes to
            packet = sparse_encode_with_feedback(flat, codec, residual)
        self._gather: PendingTensors = comm.allgather_flat_start([packet], f"{name}.gather")

    def done(self) -> bool:
        """Sum the packets if they have all arrived (never blocks); True once :meth:`wait`
        would not block."""
        if self._result is None and self._gather.done():
            self._sum()
        return self._result is not None

    def wait(self) -> Tensor:
        """Block until done; returns the average (a new 1-D float32 tensor, the same object on
        every call)."""
        if self._result is None:
            self._sum()
        assert self._result is not None
        return self._result

    def _sum(self) -> None:
        (gathered,) = self._gather.wait()
        codec, n, m = self._codec, self._numel, self._comm.size
        nbytes = packet_nbytes(n, codec)
        if gathered.numel() != m * nbytes:
            raise RuntimeError(
                f"sparse_mean: gathered {gathered.numel()} bytes, want {m} packets of {nbytes} "
                "(the workers disagree on the vector's length or the codec)"
            )
        # One decode of every packet and one add in rank order: the same sum on every worker.
        self._result = sparse_sum(gathered.view(m, nbytes), n, codec, self._out, divide=m)
