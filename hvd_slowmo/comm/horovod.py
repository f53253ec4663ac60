"""The communicator over Horovod: the exact average is a grouped Horovod allreduce
(NCCL for CUDA tensors, Gloo or MPI for CPU tensors), gossip is Horovod ``alltoall`` with
zero-length splits to non-peers (Horovod has no point-to-point API)."""

import pickle
from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from ..divide import div_
from ..validation import check_choice
from .base import (
    Communicator,
    PendingAverage,
    PendingExchange,
    PendingTensors,
    filled,
    joined,
    shard_range,
)
from .deadline import collective_timeout, timeout_message, wait_until

__all__ = ["HorovodCommunicator", "check_compression"]

REDUCE_SCATTER_MODES = ("auto", "reducescatter", "alltoall")


def _hvd() -> Any:
    # Imported lazily: the pure parts of the package and the torch.distributed engine need no
    # Horovod.
    try:
        import horovod.torch as hvd
    except ImportError as e:
        raise ImportError(
            f"this feature needs Horovod, which is not importable here ({e}): build it with "
            "scripts/install_horovod.sh (see the README), or launch with torchrun and use the "
            "torch.distributed engine"
        ) from e
    return hvd


def check_compression(compression: Any) -> Any:
    """``compression`` itself, which must be None or a ``hvd.Compression`` (``none``, ``fp16``).

    Args:
        compression: the value given.
    """
    if compression is not None and not (
        callable(getattr(compression, "compress", None))
        and callable(getattr(compression, "decompress", None))
    ):
        raise TypeError(
            f"compression must be hvd.Compression.none or hvd.Compression.fp16, got {compression!r}"
        )
    return compression


class _AlltoallExchange(PendingExchange):
    # Horovod's alltoall is a collective that every rank enters once per exchange; it runs on
    # Horovod's background thread, so the handle lets compute overlap it (OSGP).
    def __init__(self, handle: Any, recv_from: Sequence[int], chunk: int, send_buf: Tensor) -> None:
        self._handle, self._recv_from, self._chunk = handle, list(recv_from), chunk
        self._send_buf: Tensor | None = send_buf
        self._result: dict[int, Tensor] | None = None

    def done(self) -> bool:
        return self._result is not None or _hvd().poll(self._handle)

    def wait(self) -> dict[int, Tensor]:
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
                    raise RuntimeError(
                        f"gossip: expected {self._chunk} elements from rank {src}, "
                        f"got {counts[src]}"
                    )
                self._result[src] = out[offsets[src] : offsets[src + 1]]
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
        timeout: seconds a wait for an average, all-gather or all-to-all lasts (polling
            ``hvd.poll``) before it raises :class:`~hvd_slowmo.comm.deadline.CollectiveTimeout`;
            None: Horovod's own ``hvd.synchronize``, no deadline; ``"env"`` (default): from
            ``HVD_SLOWMO_COLLECTIVE_TIMEOUT`` (unset: none). docs/timeouts.md lists Horovod's
            own timeouts, which end the job where this one cannot.
    """

    supports_sharding = True
    supports_alltoall = True
    supports_exchange = True
    fuses_averages = True
    collectives_any_thread = True  # Horovod pairs collectives by name

    def __init__(
        self,
        compression: Any = None,
        process_set: Any = None,
        reduce_scatter: str = "auto",
        timeout: float | str | None = "env",
    ) -> None:
        self.reduce_scatter = check_choice("reduce_scatter", reduce_scatter, REDUCE_SCATTER_MODES)
        self.timeout = collective_timeout(timeout)
        hvd = _hvd()
        self.compression = check_compression(compression) or hvd.Compression.none
        self.process_set = process_set if process_set is not None else hvd.global_process_set
        # A set built from a rank list: its members, in Horovod's (sorted) rank order.
        ranks = self.process_set.ranks
        self._members = list(ranks) if self.process_set.process_set_id != 0 and ranks else None

    # The global set is read from Horovod on every use, not cached: hvd.elastic re-initializes
    # Horovod with other workers, and a stale rank or size would make the optimizer talk to the
    # old world's layout. A process set built from a rank list (worker="node") answers from that
    # list, without asking Horovod: its members cannot change, and Horovod 0.28.1 answers
    # ProcessSet.size()/rank() from its process-set table, which the background thread may be
    # rebuilding at that moment (see hvd_slowmo.comm.factory.horovod_node_hierarchy).
    @property
    def rank(self) -> int:  # type: ignore[override]
        if self._members is None:
            return self.process_set.rank()
        return self._members.index(_hvd().rank())

    @property
    def size(self) -> int:  # type: ignore[override]
        if self._members is None:
            return self.process_set.size()
        return len(self._members)

    @property
    def mpi_launch(self) -> bool:
        """Whether Horovod runs over MPI (``horovodrun --mpi`` or ``mpirun``)."""
        return bool(_hvd().mpi_enabled())

    def _synchronize(self, handle: Any, what: str) -> Any:
        """``hvd.synchronize(handle)`` within the deadline: poll first, so a peer frozen inside
        the collective (which Horovod over MPI never notices) ends in an error naming it."""
        hvd = _hvd()
        if self.timeout is not None:
            wait_until(
                lambda: hvd.poll(handle),
                self.timeout,
                lambda: timeout_message(
                    self.rank, what, self.timeout or 0.0, "Horovod still runs it"
                ),
            )
        return hvd.synchronize(handle)

    def _average_(self, tensors: list[Tensor], name: str) -> int:
        pending, wire = self._average_start(tensors, name)
        pending.wait()
        return wire

    def _average_start(self, tensors: list[Tensor], name: str) -> tuple[PendingAverage, int]:
        # One grouped allreduce, run by Horovod's background thread: the caller's compute goes
        # on until wait().
        hvd = _hvd()
        if self.compression is hvd.Compression.none:
            handle = hvd.grouped_allreduce_async_(
                tensors, op=hvd.Average, name=name, process_set=self.process_set
            )
            wire = sum(t.numel() * t.element_size() for t in tensors)
            what = f"average {name!r}"
            return PendingAverage(lambda: self._synchronize(handle, what)), wire
        # float64 payloads (the optimizer's step-count probe) must stay exact: never compressed.
        packed = [
            (t, None) if t.dtype == torch.float64 else self.compression.compress(t) for t in tensors
        ]
        handle = hvd.grouped_allreduce_async(
            [c for c, _ in packed], op=hvd.Average, name=name, process_set=self.process_set
        )

        def finish() -> None:
            outs = self._synchronize(handle, f"average {name!r}")
            for t, out, (_, ctx) in zip(tensors, outs, packed):
                t.copy_(out if t.dtype == torch.float64 else self.compression.decompress(out, ctx))

        return PendingAverage(finish), sum(c.numel() * c.element_size() for c, _ in packed)

    def _allgather_object(self, obj: Any) -> list[Any]:
        hvd = _hvd()
        name = "hvd_slowmo.allgather_object"
        if self._members is None:
            return hvd.allgather_object(obj, name=name)
        # Horovod 0.28.1's allgather_object runs over the global set only: gather the pickled
        # bytes over this set with two allgathers (their lengths, then the bytes).
        data = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8)
        ps = self.process_set
        sizes = hvd.allgather(torch.tensor([data.numel()]), name=f"{name}.sz", process_set=ps)
        flat = hvd.allgather(data, name=f"{name}.data", process_set=ps)
        ends = torch.cumsum(sizes, 0).tolist()
        starts = [0] + ends[:-1]
        return [pickle.loads(flat[a:b].numpy().tobytes()) for a, b in zip(starts, ends)]

    def _broadcast_object(self, obj: Any, root_rank: int) -> Any:
        # Horovod names the root by its global rank, this interface by its rank in the set.
        root = root_rank if self._members is None else self._members[root_rank]
        return _hvd().broadcast_object(
            obj, root_rank=root, name="hvd_slowmo.broadcast_object", process_set=self.process_set
        )

    def _reduce_scatter_mean(self, flats: list[Tensor], name: str) -> tuple[list[Tensor], int]:
        hvd = _hvd()
        if self.reduce_scatter == "alltoall" or (
            self.reduce_scatter == "auto" and not flats[0].is_cuda
        ):
            return self._reduce_scatter_alltoall(flats, name)
        # Horovod splits each tensor's first dimension itself (n // m, one more below n % m), which
        # is the rule of shard_range.
        out = hvd.grouped_reducescatter(
            flats,
            name=name,
            compression=self.compression,
            op=hvd.Average,
            process_set=self.process_set,
        )
        itemsize = 2 if self.compression is hvd.Compression.fp16 else flats[0].element_size()
        return out, sum(f.numel() for f in flats) * itemsize

    def _reduce_scatter_alltoall(self, flats: list[Tensor], name: str) -> tuple[list[Tensor], int]:
        hvd = _hvd()
        m = self.size
        ranges = [[shard_range(f.numel(), r, m) for r in range(m)] for f in flats]
        # One alltoall per dtype (Horovod's alltoall takes one tensor): every destination's shards
        # of every flat, destination-major, so rank r receives its own shard of each flat from
        # everyone.
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, f in enumerate(flats):
            by_dtype.setdefault(f.dtype, []).append(i)
        pending = []
        wire = 0
        for dtype, idx in by_dtype.items():
            # One flat is already destination-major (shards are contiguous, in rank order): no copy.
            send = (
                flats[idx[0]]
                if len(idx) == 1
                else torch.cat(
                    [flats[i][ranges[i][r][0] : ranges[i][r][1]] for r in range(m) for i in idx]
                )
            )
            splits = torch.tensor(
                [sum(ranges[i][r][1] - ranges[i][r][0] for i in idx) for r in range(m)],
                dtype=torch.int32,
            )
            packed, ctx = self.compression.compress(send)
            handle = hvd.alltoall_async(
                packed, splits=splits, name=f"{name}.{dtype}", process_set=self.process_set
            )
            pending.append((idx, handle, packed, ctx))  # packed stays alive until Horovod sent it
            wire += packed.numel() * packed.element_size()
        out: list[Tensor | None] = [None] * len(flats)
        for idx, handle, _, ctx in pending:
            received, _ = self._synchronize(handle, f"reduce_scatter {name!r}")
            received = self.compression.decompress(received, ctx)
            mine = [ranges[i][self.rank][1] - ranges[i][self.rank][0] for i in idx]
            per_source = received.reshape(m, sum(mine))  # one row per source rank, rank 0 first
            for chunk in per_source:  # rank order
                for i, part in zip(idx, chunk.split(mine)):
                    # Summed in rank order and divided, as the thread communicator: deterministic.
                    acc = out[i]  # None before the first source's chunk
                    out[i] = part.clone() if acc is None else acc.add_(part)
        return [div_(t, m) for t in filled(out)], wire

    def _allgather_flat_start(self, shards: list[Tensor], name: str) -> PendingTensors:
        hvd = _hvd()
        # Horovod keeps the inputs alive until synchronize (its handle map holds them).
        handle = hvd.grouped_allgather_async(shards, name=name, process_set=self.process_set)
        return PendingTensors(
            lambda: list(self._synchronize(handle, f"allgather {name!r}")),
            lambda: hvd.poll(handle),
        )

    def _alltoall_flat_start(
        self, sends: list[Tensor], recv_numels: list[int], name: str
    ) -> PendingTensors:
        # One flat buffer in destination order with per-destination splits; Horovod returns
        # the received buffer in source order with the received splits.
        hvd = _hvd()
        splits = torch.tensor([s.numel() for s in sends], dtype=torch.int32)
        handle = hvd.alltoall_async(
            joined(sends), splits=splits, name=name, process_set=self.process_set
        )

        def finish() -> list[Tensor]:
            out, received = self._synchronize(handle, f"alltoall {name!r}")
            return list(out.split(received.tolist()))

        return PendingTensors(finish, lambda: hvd.poll(handle))

    def _exchange_start(
        self,
        sends: Mapping[int, Tensor],
        recv_from: Sequence[int],
        tag: int,
        graph_key: Hashable | None,
    ) -> PendingExchange:
        hvd = _hvd()
        chunk = next(iter(sends.values())).numel()
        # One flat send buffer in rank order with per-destination splits (zero to non-peers);
        # with one destination (SGP, OSGP) the caller's buffer is sent as is, without a copy.
        parts = [sends[r] for r in sorted(sends)]
        buf = parts[0] if len(parts) == 1 else torch.cat(parts)
        splits = torch.zeros(self.size, dtype=torch.int32)
        for r in sends:
            splits[r] = chunk
        handle = hvd.alltoall_async(
            buf, splits=splits, name=f"hvd_slowmo.gossip.{tag}", process_set=self.process_set
        )
        # buf is kept alive by the exchange: Horovod reads it on its background thread.
        return _AlltoallExchange(handle, recv_from, chunk, buf)
