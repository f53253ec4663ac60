"""The communicator over Horovod: the exact average is a grouped Horovod allreduce
(NCCL for CUDA tensors, Gloo or MPI for CPU tensors), gossip is Horovod ``alltoall`` with
zero-length splits to non-peers (Horovod has no point-to-point API)."""
from typing import Any, Dict, Hashable, List, Mapping, Optional, Sequence

import torch
from torch import Tensor

from ..sharded import shard_range
from .base import Communicator, PendingExchange

__all__ = ["HorovodCommunicator"]


def _hvd():
    import horovod.torch as hvd  # imported lazily: the pure parts of the package need no Horovod

    return hvd


class _AlltoallExchange(PendingExchange):
    # Horovod's alltoall is a collective that every rank enters once per exchange; it runs on
    # Horovod's background thread, so the handle lets compute overlap it (OSGP).
    def __init__(self, handle: Any, recv_from: Sequence[int], chunk: int, send_buf: Tensor) -> None:
        self._handle, self._recv_from, self._chunk = handle, list(recv_from), chunk
        self._send_buf: Optional[Tensor] = send_buf
        self._result: Optional[Dict[int, Tensor]] = None

    def done(self) -> bool:
        return self._result is not None or _hvd().poll(self._handle)

    def wait(self) -> Dict[int, Tensor]:
        if self._result is None:
            out, received = _hvd().synchronize(self._handle)
            self._send_buf = None
            counts = received.tolist()
            offsets = [0]
            for c in counts:
                offsets.append(offsets[-1] + c)
            self._result = {}
            for src in self._recv_from:
                if counts[src] != self._chunk:
                    raise RuntimeError(f"gossip: expected {self._chunk} elements from rank {src}, got {counts[src]}")
                self._result[src] = out[offsets[src]:offsets[src + 1]]
        return self._result


class HorovodCommunicator(Communicator):
    """Horovod's collectives, for ``hvd.init()``-ed processes.

    Args:
        compression: a ``hvd.Compression`` (``none`` or ``fp16``) applied to the exact average's
            payload; the averaged result is cast back to each tensor's dtype. float64 tensors are
            never compressed (they carry exact counts).
        process_set: the Horovod process set to run over (default: all ranks).
        reduce_scatter: how :meth:`reduce_scatter_mean` runs: ``"reducescatter"`` (Horovod's
            ``grouped_reducescatter``), ``"alltoall"`` (each rank sends every other rank its shard,
            then sums what it received in rank order: the same volume), or ``"auto"``: alltoall for
            CPU tensors, where Horovod 0.28.1's Gloo reducescatter measured 3-4x slower than its
            allreduce (benchmarks/sharded_overhead.py), reducescatter for GPU tensors (NCCL).
    """

    def __init__(self, compression: Any = None, process_set: Any = None, reduce_scatter: str = "auto") -> None:
        if reduce_scatter not in ("auto", "reducescatter", "alltoall"):
            raise ValueError(f"reduce_scatter must be 'auto', 'reducescatter' or 'alltoall', got {reduce_scatter!r}")
        self.reduce_scatter = reduce_scatter
        hvd = _hvd()
        self.compression = compression if compression is not None else hvd.Compression.none
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        self.bytes_sent = 0

    # The global set is read from Horovod on every use, not cached: hvd.elastic re-initializes
    # Horovod with other workers, and a stale rank or size would make the optimizer talk to the
    # old world's layout. A process set built from a rank list (worker="node") answers from that
    # list: Horovod 0.28.1's size query for a dynamic set intermittently reported it unknown right
    # after a collective on it had succeeded (seen once in CI), and its ranks cannot change.
    @property
    def rank(self) -> int:  # type: ignore[override]
        if self.process_set.process_set_id == 0 or not self.process_set.ranks:
            return self.process_set.rank()
        return self.process_set.ranks.index(_hvd().rank())

    @property
    def size(self) -> int:  # type: ignore[override]
        if self.process_set.process_set_id == 0 or not self.process_set.ranks:
            return self.process_set.size()
        return len(self.process_set.ranks)

    def average_(self, tensors: Sequence[Tensor], name: str) -> None:
        if self.size == 1 or not tensors:
            return
        hvd = _hvd()
        tensors = list(tensors)
        if self.compression is hvd.Compression.none:
            hvd.grouped_allreduce_(tensors, op=hvd.Average, name=name, process_set=self.process_set)
            wire = sum(t.numel() * t.element_size() for t in tensors)
        else:
            # float64 payloads (the optimizer's step-count probe) must stay exact: never compressed.
            packed = [(t, None) if t.dtype == torch.float64 else self.compression.compress(t) for t in tensors]
            outs = hvd.grouped_allreduce([c for c, _ in packed], op=hvd.Average, name=name, process_set=self.process_set)
            for t, out, (_, ctx) in zip(tensors, outs, packed):
                t.copy_(out if t.dtype == torch.float64 else self.compression.decompress(out, ctx))
            wire = sum(c.numel() * c.element_size() for c, _ in packed)
        self.bytes_sent += int(2 * (self.size - 1) / self.size * wire)

    def allgather_object(self, obj: Any) -> List[Any]:
        return _hvd().allgather_object(obj, name="hvd_slowmo.allgather_object")

    def broadcast_object(self, obj: Any, root_rank: int = 0) -> Any:
        return _hvd().broadcast_object(obj, root_rank=root_rank, name="hvd_slowmo.broadcast_object",
                                       process_set=self.process_set)

    def reduce_scatter_mean(self, flats: Sequence[Tensor], name: str) -> List[Tensor]:
        flats = list(flats)
        if not flats:
            return []
        if self.size == 1:
            return [f.clone() for f in flats]
        hvd = _hvd()
        if self.reduce_scatter == "alltoall" or (self.reduce_scatter == "auto" and not flats[0].is_cuda):
            return self._reduce_scatter_alltoall(flats, name)
        # Horovod splits each tensor's first dimension itself (n // m, one more below n % m), which
        # is the rule of hvd_slowmo.sharded.shard_range.
        out = hvd.grouped_reducescatter(flats, name=name, compression=self.compression, op=hvd.Average,
                                        process_set=self.process_set)
        wire = sum(f.numel() for f in flats) * (2 if self.compression is hvd.Compression.fp16 else flats[0].element_size())
        self.bytes_sent += int((self.size - 1) / self.size * wire)
        return out

    def _reduce_scatter_alltoall(self, flats: List[Tensor], name: str) -> List[Tensor]:
        hvd = _hvd()
        m = self.size
        ranges = [[shard_range(f.numel(), r, m) for r in range(m)] for f in flats]
        # One alltoall per dtype (Horovod's alltoall takes one tensor): every destination's shards of
        # every flat, destination-major, so rank r receives its own shard of each flat from everyone.
        by_dtype: Dict[torch.dtype, List[int]] = {}
        for i, f in enumerate(flats):
            by_dtype.setdefault(f.dtype, []).append(i)
        pending = []
        for dtype, idx in by_dtype.items():
            # One flat is already destination-major (shards are contiguous, in rank order): no copy.
            send = flats[idx[0]] if len(idx) == 1 else torch.cat(
                [flats[i][ranges[i][r][0]:ranges[i][r][1]] for r in range(m) for i in idx])
            splits = torch.tensor([sum(ranges[i][r][1] - ranges[i][r][0] for i in idx) for r in range(m)],
                                  dtype=torch.int32)
            packed, ctx = self.compression.compress(send)
            handle = hvd.alltoall_async(packed, splits=splits, name=f"{name}.{dtype}", process_set=self.process_set)
            pending.append((idx, handle, packed, ctx))  # packed stays alive until Horovod has sent it
            self.bytes_sent += int((m - 1) / m * packed.numel() * packed.element_size())
        out: List[Optional[Tensor]] = [None] * len(flats)
        for idx, handle, _, ctx in pending:
            received, _ = hvd.synchronize(handle)
            received = self.compression.decompress(received, ctx)
            mine = [ranges[i][self.rank][1] - ranges[i][self.rank][0] for i in idx]
            per_source = received.reshape(m, sum(mine))  # one row per source rank, rank 0 first
            for src, chunk in enumerate(per_source):
                for i, part in zip(idx, chunk.split(mine)):
                    # Summed in rank order and divided, as the thread communicator: deterministic.
                    out[i] = part.clone() if src == 0 else out[i].add_(part)
        return [t.div_(m) for t in out]

    def allgather_flat(self, shards: Sequence[Tensor], name: str) -> List[Tensor]:
        shards = list(shards)
        if not shards:
            return []
        if self.size == 1:
            return [s.clone() for s in shards]
        out = _hvd().grouped_allgather(shards, name=name, process_set=self.process_set)
        # Ring all-gather: each worker forwards everyone's shards but its successor's: (m-1)/m of the total.
        self.bytes_sent += int((self.size - 1) / self.size * sum(o.numel() * o.element_size() for o in out))
        return out

    def exchange_start(self, sends: Mapping[int, Tensor], recv_from: Sequence[int], tag: int,
                       graph_key: Optional[Hashable] = None) -> PendingExchange:
        if not sends:
            # Every rank enters the collective with a buffer of the message dtype; with nothing
            # to send this rank would not know it.
            raise ValueError("HorovodCommunicator.exchange_start: sends is empty; every rank must send "
                             "at least one message per exchange (Horovod's alltoall is collective)")
        hvd = _hvd()
        chunks = {t.numel() for t in sends.values()}
        if len(chunks) != 1:
            raise ValueError(f"exchange_start: all messages of one exchange must have one length, got {sorted(chunks)}")
        chunk = chunks.pop()
        # One flat send buffer in rank order with per-destination splits (zero to non-peers);
        # with one destination (SGP, OSGP) the caller's buffer is sent as is, without a copy.
        parts = [sends[r] for r in sorted(sends)]
        buf = parts[0] if len(parts) == 1 else torch.cat(parts)
        splits = torch.zeros(self.size, dtype=torch.int32)
        for r in sends:
            splits[r] = chunk
        handle = hvd.alltoall_async(buf, splits=splits, name=f"hvd_slowmo.gossip.{tag}", process_set=self.process_set)
        self.bytes_sent += buf.numel() * buf.element_size()
        # buf is kept alive by the exchange: Horovod reads it on its background thread.
        return _AlltoallExchange(handle, recv_from, chunk, buf)
