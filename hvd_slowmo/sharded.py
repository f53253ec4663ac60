"""Sharded slow state (ZeRO-1 style) for SlowMo's outer step (arXiv 1910.00643, Algorithm 1, lines 6-8).

Unsharded, every worker keeps the whole anchor ``x_{t,0}`` and slow buffer ``u_t``: twice the
parameters. Sharded, the parameters of each (param group, dtype, device) are viewed as one flat
vector (a *bucket*), each bucket is cut into ``m`` contiguous shards, and worker ``r`` keeps only
shard ``r`` of the anchor and of the slow buffer: ``2/m`` times the parameters. The outer step is

1. reduce-scatter of the flat parameters with a mean: worker ``r`` gets shard ``r`` of ``x_avg``;
2. the slow update of that shard alone (heavy-ball, Nesterov, or a custom torch optimizer built
   over the anchor shards): the update is per element, so it is the same arithmetic as unsharded;
3. all-gather of the new anchor shards into the parameters, which are then bitwise identical on
   every worker (each element was computed once, by its owner).

Reduce-scatter plus all-gather move the same volume as one ring allreduce, ``2 (m-1)/m`` times
the payload. Transient memory during the outer step only: a flat copy of the parameters, the
transport's buffers (Horovod's alltoall receive buffer, or its reducescatter fusion buffer: about
the parameters' size) and the gathered anchor (the parameters' size), so the peak is about 2x the
parameters above the persistent state for a moment; the persistent state is ``2/m`` x.

Shards follow Horovod 0.28.1's reducescatter split (``ReducescatterOp::ComputeOutputShapeForRank``
in ``horovod/common/ops/collective_operations.cc``): ``n // m`` elements each, and one more for
ranks ``0 .. n % m - 1``.
"""
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .comm.base import Communicator
from .slowmo import slow_momentum_step_

__all__ = ["Bucket", "shard_sizes", "shard_range", "make_buckets", "check_shard_option", "ShardedSlowState"]


def shard_sizes(numel: int, size: int) -> List[int]:
    """Elements per rank when a flat vector of ``numel`` is split over ``size`` ranks, as Horovod does.

    Args:
        numel: the flat vector's length (>= 0).
        size: the number of ranks (>= 1).
    """
    if numel < 0 or size < 1:
        raise ValueError(f"shard_sizes: need numel >= 0 and size >= 1, got numel={numel}, size={size}")
    base, extra = divmod(numel, size)
    return [base + (1 if r < extra else 0) for r in range(size)]


def shard_range(numel: int, rank: int, size: int) -> Tuple[int, int]:
    """The half-open element range ``[start, end)`` of rank ``rank``'s shard (see :func:`shard_sizes`).

    Args:
        numel: the flat vector's length.
        rank: the rank, in ``[0, size)``.
        size: the number of ranks.
    """
    if not 0 <= rank < size:
        raise ValueError(f"shard_range: rank {rank} is outside [0, {size})")
    base, extra = divmod(numel, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


@dataclass(frozen=True)
class Bucket:
    """Parameters flattened together: one param group, one dtype, one device.

    Attributes:
        group: the param group's index (its ``lr`` scales the slow update).
        indices: the parameters' indices in the optimizer's flat parameter order.
        numel: total elements of the flat vector.
        start: this rank's shard start in the flat vector.
        end: this rank's shard end (exclusive).
    """

    group: int
    indices: Tuple[int, ...]
    numel: int
    start: int
    end: int


def make_buckets(groups: Sequence[Sequence[Tensor]], rank: int, size: int) -> List[Bucket]:
    """Partition parameters into buckets (per group, then per dtype and device, in order of first
    appearance) and give each this rank's shard range. Pure: reads only shapes, dtypes, devices.

    Args:
        groups: the parameters of each param group, in the optimizer's order.
        rank: this rank.
        size: the number of ranks.
    """
    buckets: List[Bucket] = []
    index = 0
    for g, params in enumerate(groups):
        by_kind: Dict[Tuple[torch.dtype, torch.device], List[int]] = {}
        numel: Dict[Tuple[torch.dtype, torch.device], int] = {}
        for p in params:
            key = (p.dtype, p.device)
            by_kind.setdefault(key, []).append(index)
            numel[key] = numel.get(key, 0) + p.numel()
            index += 1
        for key, indices in by_kind.items():
            start, end = shard_range(numel[key], rank, size)
            buckets.append(Bucket(g, tuple(indices), numel[key], start, end))
    return buckets


def check_shard_option(shard_slow_state: Any, slow_enabled: bool, average: bool) -> bool:
    """Validate ``DistributedOptimizer(shard_slow_state=...)``.

    Args:
        shard_slow_state: the value given.
        slow_enabled: whether the optimizer has a slow update (anchor and slow state).
        average: whether the optimizer runs the exact average.
    """
    if not isinstance(shard_slow_state, bool):
        raise TypeError(f"shard_slow_state must be True or False, got {shard_slow_state!r}")
    if shard_slow_state and not slow_enabled:
        raise ValueError("shard_slow_state=True with the slow update disabled (slow_lr=1, slow_momentum=0): "
                         "there is no slow state to shard; drop shard_slow_state")
    if shard_slow_state and not average:
        raise ValueError("shard_slow_state=True needs the exact average (its reduce-scatter is the average); "
                         "use average=True or shard_slow_state=False")
    return shard_slow_state


def _flatten(params: Sequence[Tensor], bucket: Bucket) -> Tensor:
    return torch.cat([params[i].reshape(-1) for i in bucket.indices])


def _unflatten_into_(params: Sequence[Tensor], bucket: Bucket, flat: Tensor) -> None:
    targets = [params[i] for i in bucket.indices]
    pieces = torch.split(flat, [t.numel() for t in targets])
    torch._foreach_copy_(targets, [piece.view(t.shape) for piece, t in zip(pieces, targets)])


class ShardedSlowState:
    """This rank's shards of the anchor and slow state, and the sharded outer step.

    Args:
        comm: the communicator of the exact average; must implement ``reduce_scatter_mean`` and
            ``allgather_flat``.
        slow_lr: ``alpha``.
        slow_momentum: ``beta``.
        nesterov: Nesterov slow momentum instead of heavy-ball.
        outer_optimizer_factory: builds a torch optimizer over the anchor shards (one tensor per
            bucket), applied to the unscaled pseudo-gradient; None for the built-in update. It must
            be per-element (SGD, Adam, ...): one that uses per-tensor norms (LARS, LAMB) would see
            bucket shards instead of parameters.
    """

    def __init__(self, comm: Communicator, slow_lr: float, slow_momentum: float, nesterov: bool,
                 outer_optimizer_factory: Optional[Callable[[List[Tensor]], torch.optim.Optimizer]]) -> None:
        for method in ("reduce_scatter_mean", "allgather_flat"):
            if getattr(type(comm), method) is getattr(Communicator, method):
                raise TypeError(f"shard_slow_state=True needs a communicator with {method}(); "
                                f"{type(comm).__name__} has none: use the Horovod or thread communicator")
        self.comm = comm
        self.slow_lr = slow_lr
        self.slow_momentum = slow_momentum
        self.nesterov = nesterov
        self.outer_optimizer_factory = outer_optimizer_factory
        self.buckets: Optional[List[Bucket]] = None  # set at capture (the first step)
        self.anchor_shards: List[Tensor] = []
        self.slow_buffer_shards: Optional[List[Tensor]] = None
        self.outer_optimizer: Optional[torch.optim.Optimizer] = None
        self._zero_lr_warned = False

    @property
    def captured(self) -> bool:
        """Whether the anchor has been captured (or loaded)."""
        return self.buckets is not None

    def state_tensors(self) -> List[Tensor]:
        """Every tensor of the slow state this rank keeps (anchor and slow buffer shards, and the
        custom outer optimizer's per-element state)."""
        out = list(self.anchor_shards) + list(self.slow_buffer_shards or [])
        if self.outer_optimizer is not None:
            for entry in self.outer_optimizer.state.values():
                out.extend(v for v in entry.values() if isinstance(v, Tensor))
        return out

    def _layout(self, param_groups: Sequence[Dict[str, Any]]) -> List[Bucket]:
        return make_buckets([g["params"] for g in param_groups], self.comm.rank, self.comm.size)

    @torch.no_grad()
    def capture_(self, param_groups: Sequence[Dict[str, Any]]) -> None:
        """Take this rank's anchor shards from the current parameters (once; later calls return).

        Called at the first step, after ``hvd.broadcast_parameters``, so every rank's anchor is
        a shard of the same vector.

        Args:
            param_groups: the optimizer's param groups.
        """
        if self.captured:
            return
        buckets = self._layout(param_groups)
        params = [p.detach() for g in param_groups for p in g["params"]]
        self.anchor_shards = [_flatten(params, b)[b.start:b.end].clone() for b in buckets]
        self.buckets = buckets
        self._new_slow_state()

    def _new_slow_state(self) -> None:
        if self.outer_optimizer_factory is not None:
            self.outer_optimizer = self._build_outer(self.anchor_shards)
            self.slow_buffer_shards = None
        else:
            self.slow_buffer_shards = [torch.zeros_like(a) for a in self.anchor_shards]

    def _build_outer(self, anchor_shards: List[Tensor]) -> torch.optim.Optimizer:
        assert self.outer_optimizer_factory is not None
        opt = self.outer_optimizer_factory(anchor_shards)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(opt).__name__}")
        return opt

    @torch.no_grad()
    def add_group_(self, param_groups: Sequence[Dict[str, Any]]) -> None:
        """Extend the state after ``add_param_group`` (the new group's anchor: its current values).

        Args:
            param_groups: the optimizer's param groups, the new one last.
        """
        if not self.captured:
            return  # captured with every group at the first step
        assert self.buckets is not None
        buckets = self._layout(param_groups)
        new = buckets[len(self.buckets):]
        params = [p.detach() for g in param_groups for p in g["params"]]
        shards = [_flatten(params, b)[b.start:b.end].clone() for b in new]
        self.buckets = buckets
        self.anchor_shards.extend(shards)
        if self.outer_optimizer is not None:
            self.outer_optimizer.add_param_group({"params": shards})
        elif self.slow_buffer_shards is not None:
            self.slow_buffer_shards.extend(torch.zeros_like(s) for s in shards)

    @torch.no_grad()
    def outer_step_(self, params: List[Tensor], param_groups: Sequence[Dict[str, Any]], exact: bool) -> float:
        """Reduce-scatter (mean), slow update of this rank's shards, all-gather into ``params``.

        Args:
            params: the parameters (detached), in the optimizer's order; hold the new anchor on return.
            param_groups: the optimizer's param groups (their current ``lr``).
            exact: False when the parameters are already identical on every rank (AR-SGD base):
                the shard is then sliced locally and the reduce-scatter skipped.

        Returns:
            Seconds spent communicating (the caller books them as averaging time).
        """
        assert self.buckets is not None, "the anchor is captured at the first step"
        t0 = time.perf_counter()
        flats = [_flatten(params, b) for b in self.buckets]
        if exact:
            averages = self.comm.reduce_scatter_mean(flats, name="hvd_slowmo.sharded_average")
        else:
            averages = [f[b.start:b.end].clone() for f, b in zip(flats, self.buckets)]
        del flats  # the transient copy is not needed past this point
        comm_s = time.perf_counter() - t0
        self._slow_update(averages, param_groups)
        t1 = time.perf_counter()
        self._gather_anchor_into_(params)
        return comm_s + time.perf_counter() - t1

    def _slow_update(self, averages: List[Tensor], param_groups: Sequence[Dict[str, Any]]) -> None:
        assert self.buckets is not None
        if self.outer_optimizer is not None:
            for a, x in zip(self.anchor_shards, averages):
                a.grad = a - x  # the unscaled pseudo-gradient, as unsharded
            self.outer_optimizer.step()
            self.outer_optimizer.zero_grad(set_to_none=True)
            return
        assert self.slow_buffer_shards is not None
        for g, group in enumerate(param_groups):
            idx = [i for i, b in enumerate(self.buckets) if b.group == g]
            if not idx:
                continue
            anchor = [self.anchor_shards[i] for i in idx]
            lr = float(group["lr"])
            if lr <= 0:
                # As unsharded: the 1/lr scaling is undefined at lr=0; keep the buffer, restart from the average.
                if not self._zero_lr_warned:
                    warnings.warn("a param group has lr=0 at an outer step: its slow update is skipped "
                                  "and its anchor set to the average", stacklevel=4)
                    self._zero_lr_warned = True
                torch._foreach_copy_(anchor, [averages[i] for i in idx])
                continue
            slow_momentum_step_([averages[i] for i in idx], anchor, [self.slow_buffer_shards[i] for i in idx],
                                lr, self.slow_lr, self.slow_momentum, nesterov=self.nesterov)

    def _gather_anchor_into_(self, params: List[Tensor]) -> None:
        assert self.buckets is not None
        full = self.comm.allgather_flat(self.anchor_shards, name="hvd_slowmo.sharded_anchor")
        for b, flat in zip(self.buckets, full):
            if flat.numel() != b.numel:
                raise RuntimeError(f"sharded anchor: gathered {flat.numel()} elements for a bucket of {b.numel}")
            _unflatten_into_(params, b, flat)

    @torch.no_grad()
    def restore_(self, params: List[Tensor]) -> None:
        """Overwrite ``params`` with the full anchor (all-gathered; collective), for ``nonfinite="skip"``.

        Args:
            params: the parameters (detached), in the optimizer's order.
        """
        assert self.buckets is not None, "the anchor is captured at the first step"
        self._gather_anchor_into_(params)

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """This rank's shards and the layout they belong to (rank, size, shard ranges)."""
        return {
            "rank": self.comm.rank,
            "size": self.comm.size,
            "buckets": None if self.buckets is None else [asdict(b) for b in self.buckets],
            "anchor_shards": list(self.anchor_shards) if self.captured else None,
            "slow_buffer_shards": None if self.slow_buffer_shards is None else list(self.slow_buffer_shards),
            "outer_optimizer": None if self.outer_optimizer is None else self.outer_optimizer.state_dict(),
        }

    def prepare_load(self, state: Any, param_groups: Sequence[Dict[str, Any]], inner_step: int) -> Dict[str, Any]:
        """Check a saved sharded state against this rank and model; returns what :meth:`commit_load`
        installs. Changes nothing, so the caller can still fail atomically.

        Args:
            state: the ``"sharded"`` entry of a saved optimizer state (None if it was unsharded).
            param_groups: this optimizer's param groups.
            inner_step: the saved position inside the outer step.

        Raises:
            ValueError: unsharded state, another world size or rank, another model layout.
        """
        if not isinstance(state, dict):
            raise ValueError("load_state_dict: the state was saved with shard_slow_state=False (full anchor); "
                             "load it into an optimizer built with shard_slow_state=False")
        if state.get("size") != self.comm.size:
            raise ValueError(f"load_state_dict: the sharded slow state was saved by {state.get('size')} workers, "
                             f"this job has {self.comm.size}; a sharded state cannot be resharded: resume with "
                             f"{state.get('size')} workers")
        if state.get("rank") != self.comm.rank:
            raise ValueError(f"load_state_dict: this is rank {state.get('rank')}'s shard, loaded on rank "
                             f"{self.comm.rank}; with shard_slow_state=True every rank loads the state it saved")
        if state.get("buckets") is None:
            if inner_step > 0:
                raise ValueError("load_state_dict: the sharded state has no anchor but was saved inside an outer step")
            return {"buckets": None, "anchor": [], "slow": None, "outer": None}
        layout = self._layout(param_groups)
        if [asdict(b) for b in layout] != [dict(b, indices=tuple(b["indices"])) for b in state["buckets"]]:
            raise ValueError("load_state_dict: the saved shard layout (param groups, dtypes, sizes) differs from "
                             "this optimizer's: the state comes from another model or param groups")
        params = [p for g in param_groups for p in g["params"]]
        anchor = self._load_shards(state.get("anchor_shards"), layout, params, "anchor_shards")
        slow, outer = None, None
        if self.outer_optimizer_factory is None:
            slow = self._load_shards(state.get("slow_buffer_shards"), layout, params, "slow_buffer_shards")
        else:
            if state.get("outer_optimizer") is None:
                raise ValueError("load_state_dict: this optimizer has a custom outer_optimizer but the state has no "
                                 "outer optimizer state; it was saved with outer_optimizer='heavyball'/'nesterov'")
            outer = self._build_outer(anchor)
            outer.load_state_dict(state["outer_optimizer"])  # into a new object: raises before anything changes
        return {"buckets": layout, "anchor": anchor, "slow": slow, "outer": outer}

    @staticmethod
    def _load_shards(saved: Any, layout: List[Bucket], params: List[Tensor], key: str) -> List[Tensor]:
        if not isinstance(saved, list) or len(saved) != len(layout):
            raise ValueError(f"load_state_dict: '{key}' is missing or has the wrong number of shards")
        out = []
        for b, t in zip(layout, saved):
            if not isinstance(t, Tensor) or tuple(t.shape) != (b.end - b.start,):
                raise ValueError(f"load_state_dict: a shard of '{key}' has shape "
                                 f"{getattr(t, 'shape', None)}, expected ({b.end - b.start},): a damaged state")
            ref = params[b.indices[0]]
            out.append(t.detach().to(ref.device, ref.dtype).clone())
        return out

    def commit_load(self, prepared: Dict[str, Any]) -> None:
        """Install what :meth:`prepare_load` returned.

        Args:
            prepared: its return value.
        """
        self.buckets = prepared["buckets"]
        self.anchor_shards = prepared["anchor"]
        self.slow_buffer_shards = prepared["slow"]
        self.outer_optimizer = prepared["outer"]
