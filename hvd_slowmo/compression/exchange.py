"""The compressed exact average, built from collectives (no collective sums codes).

For ``m`` workers and a flat float32 vector ``v`` of ``n`` elements (the pseudo-gradient
``anchor - parameters`` of SlowMo's outer step, arXiv 1910.00643):

1. ``v`` is split into ``m`` chunks as :func:`~hvd_slowmo.comm.base.shard_range` splits it
   (``n // m`` each, one more for the first ``n % m``); each worker encodes its ``m`` chunks.
2. An all-to-all sends chunk ``j``'s codes and scales to worker ``j``.
3. Worker ``j`` decodes the ``m`` chunks it received, sums them in float32 in rank order,
   divides by ``m`` and encodes the result (its reduced chunk).
4. An all-gather returns every reduced chunk to every worker, and every worker decodes the same
   bits: the average is bitwise identical everywhere.

The wire carries ``(m-1)/m`` of the encoded vector in each of the two collectives, like a ring
allreduce of the encoded vector; the sums are float32, as the fp32 allreduce's.

Error feedback (optional): each worker keeps the residual of its own contribution,
``e <- (v + e) - decode(encode(v + e))``, and adds it to its next contribution, so what the
quantizer dropped is sent later instead of lost. The second rounding (of the reduced chunk) is
common to all workers and is not fed back.
"""

import torch
from torch import Tensor

from ..comm.base import Communicator, PendingTensors, shard_sizes
from ..divide import div_
from .codecs import (
    BLOCK_SIZE,
    check_transport,
    check_vector,
    column_slices,
    decode_rows,
    encode,
    encode_rows,
    encoded_nbytes,
)
from .native import decode_rows as native_decode_rows
from .native import encode_rows as native_encode_rows
from .native import reduce as native_reduce
from .native import usable as native_usable
from .offload import Scratch

__all__ = ["PendingMean", "compressed_mean"]


def _runs(flat: Tensor, sizes: list[int]) -> list[Tensor]:
    """``flat`` cut into pieces of ``sizes``, each run of equal consecutive sizes as one
    matrix, a piece a row (:func:`~hvd_slowmo.comm.base.shard_sizes` makes at most two runs)."""
    out, offset, i = [], 0, 0
    while i < len(sizes):
        j = i
        while j < len(sizes) and sizes[j] == sizes[i]:
            j += 1
        count, size = j - i, sizes[i]
        out.append(flat[offset : offset + count * size].view(count, size))
        offset += count * size
        i = j
    return out


def compressed_mean(
    comm: Communicator,
    flat: Tensor,
    codec: str,
    name: str,
    residual: Tensor | None = None,
    block: int = BLOCK_SIZE,
) -> Tensor:
    """The average over all workers of ``flat``, exchanged with ``codec``; identical bits on
    every worker. Collective.

    With one worker the average is ``flat`` itself (copied; nothing is encoded).

    Args:
        comm: the workers (needs :attr:`~hvd_slowmo.comm.base.Communicator.supports_alltoall`).
        flat: this worker's 1-D float32 vector; the same length on every worker.
        codec: a name of :data:`~hvd_slowmo.compression.codecs.CODECS`, the same on every worker.
        name: a label for the two collectives (Horovod matches them by name).
        residual: this worker's error-feedback residual (1-D float32, ``flat``'s length): added
            to ``flat`` before encoding, and updated in place to what the encoding lost.
            None: no error feedback.
        block: elements per scale of the scaled codecs.

    Returns:
        A new 1-D float32 tensor: the decoded average.
    """
    return PendingMean(comm, flat, codec, name, residual, block).wait()


class PendingMean:
    """:func:`compressed_mean` in flight: the all-to-all starts on construction, the all-gather
    as soon as :meth:`done` finds the all-to-all done (or at :meth:`wait`). Collective.

    On transports without background progress (threads, MPI) each collective finishes when it
    starts. Arguments as for :func:`compressed_mean`; ``residual`` is updated on construction.
    ``out``: a float32 buffer of ``n`` elements to decode the mean into (the result is it; it
    may be ``flat``'s own, which is not read after construction), None: a new one.
    ``scratch``: where the packets sent and the reduced chunk are kept from one mean to the next
    (only where each mean is waited for before the next one starts: the collectives read them
    until then), None: new buffers. Kept, they cost no fresh pages: at 64 MB a new packet
    buffer's page faults cost as much as the rest of the mean on a CPU.
    """

    def __init__(
        self,
        comm: Communicator,
        flat: Tensor,
        codec: str,
        name: str,
        residual: Tensor | None = None,
        block: int = BLOCK_SIZE,
        out: Tensor | None = None,
        scratch: Scratch | None = None,
    ) -> None:
        check_vector(flat, residual, "compressed_mean")
        check_transport(comm, codec)
        self._comm, self._codec, self._name, self._block = comm, codec, name, block
        self._out, self._scratch = out, scratch
        self._sizes = shard_sizes(flat.numel(), comm.size)
        self._result: Tensor | None = flat.clone() if comm.size == 1 else None
        self._native = native_usable(codec, flat)
        self._gather: PendingTensors | None = None
        if self._result is not None:
            return
        # The chunks come in at most two runs of equal sizes: each run encoded in one pass,
        # its packets written straight into rows of one buffer.
        nbytes = [encoded_nbytes(s, codec, block) for s in self._sizes]
        buffer = self._bytes("packets", sum(nbytes), flat.device)
        feedback = residual is not None  # the rows are the residual's: less what they send
        packet_runs = _runs(buffer, nbytes)
        if self._native:  # the C kernels add ``flat`` into the residual as they encode
            rows_of = _runs(flat if residual is None else residual, self._sizes)
            for rows, source, out in zip(rows_of, _runs(flat, self._sizes), packet_runs):
                native_encode_rows(codec, rows, block, out, source, feedback)
        else:
            # In place (``flat + residual``, operands in this order: which NaN a sum of two
            # NaNs yields depends on it); the residual becomes what the encoding lost below.
            contribution = flat if residual is None else torch.add(flat, residual, out=residual)
            for rows, out in zip(_runs(contribution, self._sizes), packet_runs):
                encode_rows(rows, codec, block, out, decoded=False, feedback=feedback)
        packets = list(buffer.split(nbytes))
        packet = encoded_nbytes(self._sizes[comm.rank], codec, block)
        self._alltoall = comm.alltoall_flat_start(packets, [packet] * comm.size, f"{name}.a2a")

    def done(self) -> bool:
        """Never blocks: advance (start the all-gather once the all-to-all is done), then say
        whether :meth:`wait` would return at once."""
        if self._result is not None:
            return True
        if self._gather is None and self._alltoall.done():
            self._reduce()
        return self._gather is not None and self._gather.done()

    def wait(self) -> Tensor:
        """Block until done; returns the decoded average (1-D float32: ``out``, or a new
        tensor; the same object on every call)."""
        if self._result is None:
            if self._gather is None:
                self._reduce()
            assert self._gather is not None
            (gathered,) = self._gather.wait()
            codec, block, sizes = self._codec, self._block, self._sizes
            nbytes = [encoded_nbytes(s, codec, block) for s in sizes]
            result = self._out
            if result is None:
                result = torch.empty(sum(sizes), dtype=torch.float32, device=gathered.device)
            for rows, values in zip(_runs(gathered, nbytes), _runs(result, sizes)):
                if self._native:
                    native_decode_rows(codec, rows, values.shape[1], block, values)
                else:
                    decode_rows(rows, values.shape[1], codec, block, out=values)
            self._result = result
        return self._result

    def _bytes(self, role: str, nbytes: int, device: torch.device) -> Tensor:
        """A uint8 buffer of ``nbytes``: the scratch's ``role`` buffer, or a new one."""
        if self._scratch is None:
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        return self._scratch.take(role, nbytes, device, torch.uint8)

    def _reduce(self) -> None:
        """Sum this worker's chunk over the workers, in rank order (every worker would sum a
        chunk the same way), average, encode, and start the all-gather."""
        codec, block, m = self._codec, self._block, self._comm.size
        mine = self._sizes[self._comm.rank]
        if self._native:
            chunks = self._alltoall.wait()
            out = self._bytes("reduced", chunks[0].numel(), chunks[0].device)
            reduced = native_reduce(codec, chunks, mine, block, out)
            self._gather = self._comm.allgather_flat_start([reduced], f"{self._name}.gather")
            return
        packets = torch.stack(self._alltoall.wait())
        reduced = self._bytes("reduced", encoded_nbytes(mine, codec, block), packets.device)
        codes_at = None  # where the codes start in the packet: after every block's scale
        # A slice of columns (whole blocks) at a time: the decoded chunks, their sum and its
        # encode stay a slice's size, with the same bits as the whole chunk's.
        for start, stop in column_slices(mine, m, block):
            received = decode_rows(packets, mine, codec, block, columns=(start, stop))
            # Added one worker after the other, in rank order: the bitwise contract of the sum
            # (into the first worker's row, which is not needed after).
            total = received[0]
            for src in range(1, m):
                total += received[src]
            enc = encode(div_(total, m), codec, block)
            itemsize = enc.codes.element_size()
            if codes_at is None:
                codes_at = reduced.numel() - mine * itemsize
            first = 4 * (start // block) if enc.scales.numel() else 0
            reduced[first : first + 4 * enc.scales.numel()] = enc.scales.view(torch.uint8)
            codes = reduced[codes_at + start * itemsize : codes_at + stop * itemsize]
            codes.copy_(enc.codes.view(torch.uint8))
        self._gather = self._comm.allgather_flat_start([reduced], f"{self._name}.gather")
