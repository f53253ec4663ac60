"""The scaling sparse average: each region reduced at its owner, sparsified again, gathered.

Opt in with ``SparseCodec(exchange="owners")``. The all-gather average
(:mod:`hvd_slowmo.compression.sparse_exchange`, the default) has every worker receive ``m - 1``
packets, so its bytes grow with the number of workers ``m``; here they stay about two packets
of the whole vector, whatever ``m`` (the dense codecs' structure, :mod:`.exchange`, with the
sparse codec). For ``m`` workers, each with a flat float32 vector ``v_i`` of ``n`` elements
(SlowMo's pseudo-gradient, arXiv 1910.00643; the codec of SparseLoCo, arXiv 2508.15706):

1. The vector's codec chunks (``ceil(n / chunk)``) are split over the workers as
   :func:`~hvd_slowmo.comm.base.shard_sizes` splits them: worker ``j`` owns region ``j``, whole
   chunks (the last region ends at ``n``).
2. Error feedback as the all-gather form's: ``e_i <- decay e_i + v_i``; worker ``i`` sends the
   packet of each region of ``e_i`` (one :func:`~.sparse.sparse_encode` per region) to its
   owner in one all-to-all, and keeps ``e_i <- e_i - D(C(e_i))``.
3. The owner decodes the ``m`` packets of its region, adds them in rank order into float32
   zeros (:func:`~.sparse.sparse_sum`), divides by ``m``, and **encodes the mean again**: a
   second top-k of the region, at the same density and bits, which is not fed back (as the
   dense codecs' re-encoding of the reduced chunk). So the average differs from the all-gather
   form's, which is the exact mean of the sent packets: an entry kept by only some workers, or
   small in the sum, may be dropped by the owner.
4. An all-gather of the reduced packets; every worker decodes the same bits: the average is
   bitwise identical everywhere.

Bytes per worker: ``(m-1)/m`` of the region packets in each collective, about ``2 (m-1)/m``
packets of the whole vector (the communicator's ``bytes_sent``), against ``m - 1`` for the
all-gather form. The work per region (encode, decode) is vectorised over its chunks.
"""

import torch
from torch import Tensor

from ..comm.base import Communicator, PendingTensors, shard_sizes
from .codecs import check_transport, check_vector
from .sparse import (
    SparseCodec,
    packet_nbytes,
    sparse_decode_runs,
    sparse_encode,
    sparse_encode_with_feedback,
    sparse_sum,
)

__all__ = ["PendingOwnerSparseMean", "owner_sizes"]


def owner_sizes(numel: int, codec: SparseCodec, workers: int) -> list[int]:
    """Elements of each worker's region: whole chunks of ``codec.chunk``, split over the
    workers as :func:`~hvd_slowmo.comm.base.shard_sizes` splits the chunks; the last non-empty
    region ends at ``numel``.

    Args:
        numel: the vector's length.
        codec: the sparse codec (its ``chunk``).
        workers: the number of workers ``m``.
    """
    chunks = shard_sizes(-(-numel // codec.chunk), workers)
    sizes, left = [], numel
    for count in chunks:
        size = min(left, count * codec.chunk)
        sizes.append(size)
        left -= size
    return sizes


class PendingOwnerSparseMean:
    """The scaling sparse average in flight: the packets are encoded and the all-to-all
    started on construction (the residual updated there), the owner's reduction and the
    all-gather started once :meth:`done` finds the all-to-all done (or at :meth:`wait`).
    Collective.

    With one worker the average is ``flat`` itself (copied; nothing encoded, the residual not
    touched).

    Args:
        comm: the workers (needs ``alltoall_flat`` and ``allgather_flat``).
        flat: this worker's 1-D float32 vector; the same length on every worker.
        codec: the settings, the same on every worker.
        name: a label for the collectives.
        residual: this worker's error-feedback residual (``flat``'s shape), updated in place;
            None: no error feedback.
    """

    def __init__(
        self,
        comm: Communicator,
        flat: Tensor,
        codec: SparseCodec,
        name: str,
        residual: Tensor | None = None,
    ) -> None:
        check_vector(flat, residual, "owner sparse mean")
        check_transport(comm, codec)
        self._comm, self._codec, self._name = comm, codec, name
        self._sizes = owner_sizes(flat.numel(), codec, comm.size)
        self._result: Tensor | None = flat.clone() if comm.size == 1 else None
        self._gather: PendingTensors | None = None
        if self._result is not None:
            return
        # One packet per region; with feedback each region of the residual takes its part of
        # the vector, is encoded and loses what its packet decodes to, in place.
        if residual is None:
            packets = [sparse_encode(part, codec) for part in flat.split(self._sizes)]
        else:
            parts = zip(flat.split(self._sizes), residual.split(self._sizes))
            packets = [sparse_encode_with_feedback(f, codec, r) for f, r in parts]
        mine = packet_nbytes(self._sizes[comm.rank], codec)
        self._alltoall = comm.alltoall_flat_start(packets, [mine] * comm.size, f"{name}.a2a")

    def done(self) -> bool:
        """Never blocks: advance (reduce and start the all-gather once the all-to-all is done),
        then say whether :meth:`wait` would return at once."""
        if self._result is not None:
            return True
        if self._gather is None and self._alltoall.done():
            self._reduce()
        return self._gather is not None and self._gather.done()

    def wait(self) -> Tensor:
        """Block until done; returns the average (a new 1-D float32 tensor, the same object on
        every call)."""
        if self._result is None:
            if self._gather is None:
                self._reduce()
            assert self._gather is not None
            (gathered,) = self._gather.wait()
            self._result = sparse_decode_runs(gathered, self._sizes, self._codec)
        return self._result

    def _reduce(self) -> None:
        """The owner's mean of its region (rank order), encoded again; the all-gather."""
        codec, m = self._codec, self._comm.size
        mine = self._sizes[self._comm.rank]
        received = self._alltoall.wait()
        if mine == 0:  # fewer chunks than workers: this owner has nothing
            reduced = torch.empty(0, dtype=torch.uint8, device=received[0].device)
        else:
            total = sparse_sum(torch.stack(received), mine, codec, divide=m)
            reduced = sparse_encode(total.contiguous(), codec)
        self._gather = self._comm.allgather_flat_start([reduced], f"{self._name}.gather")
