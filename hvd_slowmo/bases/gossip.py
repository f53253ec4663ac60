"""Gossip base algorithms: SGP, OSGP (push-sum) and D-PSGD (arXiv 1910.00643, Appendix C).

Matrix form (plain SGD, parameters stacked as columns, ``P_k`` from
:meth:`hvd_slowmo.bases.topology.GossipGraph.mixing_matrix`)::

    X_{k+1} = (X_k - lr * G_k) P_k^T,    G_k = gradients at the de-biased Z_k = X_k / w_k

* SGP: ``P_k`` column-stochastic on the time-varying directed exponential graph; each worker
  keeps a push-sum weight ``w`` (``ps_weight``) and the model holds ``z = x / w``.
* OSGP: the same messages sent without blocking; a message may stay in flight ``staleness``
  steps, so communication overlaps the next forward/backward. ``staleness=0`` is SGP.
* D-PSGD: ``P_k`` symmetric doubly stochastic (Metropolis weights) on the undirected graph.

The model's parameters always hold the de-biased ``z``, so forward/backward never see
push-sum. Before the optimizer step they are re-biased (``x = z * w``) so the step acts on the
numerator, as in the paper; after it they are mixed and de-biased again. When ``w == 1``
exactly both are skipped: that is SGP on the built-in graphs, for any ``peers_per_step``
(they are circulant, every in-degree equals every out-degree, so weights stay 1); weights
move with OSGP (shares in flight) and with custom graphs of uneven in-degree.

With SlowMo, the exact average is taken over the numerators ``x`` (their mean is the
push-sum consensus value, since the weights sum to ``m``), after every message in flight has
been mixed; the weight is then reset to 1. ``average=False`` (SGP-SlowMo-noaverage) keeps
each worker's own ``z`` and weight.

One worker is refused (``ValueError``): there is nobody to gossip with, and silently running
Local SGD instead would hide a launch mistake.

One message per step and dtype: all parameters (and the weight) packed in one flat buffer.
"""

import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ..comm.base import Communicator, PendingExchange
from ..comm.factory import GOSSIP_TRANSPORTS, gossip_transport
from ..validation import check_choice, check_int, check_number
from .base import BaseAlgorithm
from .localsgd import LocalSGD
from .topology import GossipGraph, TopologyFn, metropolis_weights, push_sum_weights

__all__ = ["GossipBase", "SGP", "OSGP", "DPSGD", "DEFAULT_GOSSIP_TIMEOUT"]

log = logging.getLogger("hvd_slowmo")

#: Seconds a blocking gossip wait lasts before failing (override: ``gossip_timeout`` or the
#: ``HVD_SLOWMO_GOSSIP_TIMEOUT`` environment variable).
DEFAULT_GOSSIP_TIMEOUT = 300.0


class _FlatGroup:
    """The parameters of one (device, dtype) and their layout in one flat message."""

    def __init__(self, params: list[Tensor], carries_weight: bool) -> None:
        self.params = params
        self.carries_weight = carries_weight
        self.numel = sum(p.numel() for p in params)
        self.length = self.numel + (1 if carries_weight else 0)
        self._free: list[Tensor] = []  # send buffers whose exchange has completed

    def pack(self, scale: float, weight: float) -> Tensor:
        """A flat buffer ``[params..., weight] * scale`` (a buffer no exchange is still using)."""
        p0 = self.params[0]
        buf = (
            self._free.pop()
            if self._free
            else torch.empty(self.length, dtype=p0.dtype, device=p0.device)
        )
        torch._foreach_copy_(self.views(buf), [p.detach() for p in self.params])
        if self.carries_weight:
            buf[-1] = weight
        if scale != 1.0:
            buf.mul_(scale)
        return buf

    def release(self, buf: Tensor) -> None:
        """Return a send buffer for reuse once its exchange has completed."""
        self._free.append(buf)

    def views(self, flat: Tensor) -> list[Tensor]:
        """Per-parameter views into a flat message."""
        out, off = [], 0
        for p in self.params:
            out.append(flat[off : off + p.numel()].view_as(p))
            off += p.numel()
        return out


class _InFlight:
    """One started exchange: its step, group, handle, send buffer and expected senders."""

    def __init__(
        self, step: int, group: int, pending: PendingExchange, buf: Tensor, senders: Sequence[int]
    ) -> None:
        self.step, self.group, self.pending, self.buf, self.senders = (
            step,
            group,
            pending,
            buf,
            tuple(senders),
        )


def _default_timeout() -> float:
    env = os.environ.get("HVD_SLOWMO_GOSSIP_TIMEOUT")
    if env is None:
        return DEFAULT_GOSSIP_TIMEOUT
    try:
        return float(env)
    except ValueError:
        raise ValueError(
            f"HVD_SLOWMO_GOSSIP_TIMEOUT must be a number of seconds, got {env!r}"
        ) from None


class GossipBase(BaseAlgorithm):
    """Shared machinery of the gossip bases: topology, transport, flat messages, timed waits.

    Args:
        comm: the communicator of this worker (its size must be >= 2).
        topology: ``"exponential"`` (default), ``"ring"``, or a callable
            ``(rank, size, step) -> out-peers`` that is the same function on every rank.
        peers_per_step: out-peers per step for the built-in topologies (default 1).
        gossip_transport: ``"auto"`` (MPI neighbour collectives under an MPI launch with CPU
            tensors, otherwise the communicator's own exchange, e.g. Horovod ``alltoall``),
            ``"mpi"`` or ``"horovod"``.
        gossip_timeout: seconds a blocking wait lasts before raising ``TimeoutError`` naming the
            peer and step (default ``HVD_SLOWMO_GOSSIP_TIMEOUT`` or 300).

    Raises:
        ValueError: one worker (gossip needs >= 2: use ``base="localsgd"``, which is Lookahead
            with one worker), or an invalid option.
    """

    OPTIONS: tuple[str, ...] = ("topology", "peers_per_step", "gossip_transport", "gossip_timeout")
    communicates_every_step = True
    needs_exact_average = True
    #: D-PSGD mixes over the undirected graph; push-sum over the directed one.
    undirected = False

    def __init__(
        self,
        comm: Communicator,
        topology: str | TopologyFn = "exponential",
        peers_per_step: int = 1,
        gossip_transport: str = "auto",
        gossip_timeout: float | None = None,
    ) -> None:
        super().__init__(comm)
        if comm.size < 2:
            raise ValueError(
                f"base={self.name!r} needs at least 2 workers, got {comm.size}: with one "
                f"worker there is nobody to gossip with; use base={LocalSGD.name!r} "
                "(Lookahead with one worker)"
            )
        self.gossip_transport = check_choice(
            "gossip_transport", gossip_transport, GOSSIP_TRANSPORTS
        )
        self.timeout = check_number(
            "gossip_timeout",
            _default_timeout() if gossip_timeout is None else gossip_timeout,
            low=0.0,
            low_open=True,
            finite=False,
            fix="the seconds a gossip wait may last, e.g. 300",
        )
        self.graph = GossipGraph(topology, comm.size, peers_per_step, undirected=self.undirected)
        self.transport: Communicator | None = None
        self.groups: list[_FlatGroup] = []
        self._inflight: deque[_InFlight] = deque()

    # --- setup ----------------------------------------------------------------------------
    def attach(self, params: list[Tensor]) -> None:
        if self._inflight:
            self.flush()
        super().attach(params)
        by_kind: dict[tuple[str, torch.dtype], list[Tensor]] = {}
        for p in params:
            by_kind.setdefault((str(p.device), p.dtype), []).append(p)
        kinds = list(by_kind)
        # The push-sum weight rides in the group with the widest float type (fp16 would round it).
        widest = (
            max(range(len(kinds)), key=lambda i: torch.finfo(kinds[i][1]).bits) if kinds else -1
        )
        self.groups = [
            _FlatGroup(by_kind[k], carries_weight=(i == widest and not self.undirected))
            for i, k in enumerate(kinds)
        ]
        if self.transport is None:
            self.transport = gossip_transport(
                self.comm, self.gossip_transport, any(p.is_cuda for p in params), self.name
            )

    # --- exchanges ------------------------------------------------------------------------
    def _start(
        self, step: int, sends_to: Sequence[int], recv_from: Sequence[int], scale: float
    ) -> None:
        """Pack every group, scaled, and start one exchange per group."""
        assert self.transport is not None, "attach() first"
        key = self.graph.key(step)
        for g, group in enumerate(self.groups):
            buf = group.pack(scale, self.ps_weight)
            # tag: unique per exchange (Horovod names its collectives by it).
            pending = self.transport.exchange_start(
                {d: buf for d in sends_to},
                recv_from,
                tag=step * len(self.groups) + g,
                graph_key=key,
            )
            self._inflight.append(_InFlight(step, g, pending, buf, recv_from))

    def _wait(self, item: _InFlight) -> dict[int, Tensor]:
        """Wait for one exchange with a deadline (polling ``done()``, which drives MPI progress)."""
        if not item.pending.done():
            deadline = time.monotonic() + self.timeout
            delay = 0.0
            while not item.pending.done():
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"hvd_slowmo gossip: rank {self.comm.rank} waited {self.timeout:.0f}s for "
                        f"the step-{item.step} message from rank(s) {list(item.senders)} "
                        f"({self.name}); a peer has died, stalled, or takes different steps. Raise "
                        "gossip_timeout / HVD_SLOWMO_GOSSIP_TIMEOUT if it is just slow"
                    )
                time.sleep(delay)
                delay = min(max(2 * delay, 2e-5), 5e-4)
        received = item.pending.wait()
        self.groups[item.group].release(item.buf)
        return received

    # --- push-sum weight (no-ops for D-PSGD, whose weight is always 1) ----------------------
    ps_weight: float = 1.0

    @torch.no_grad()
    def _rebias(self) -> None:
        if self.ps_weight != 1.0:
            torch._foreach_mul_([p.detach() for p in self.params], self.ps_weight)

    @torch.no_grad()
    def _debias(self) -> None:
        if self.ps_weight != 1.0:
            torch._foreach_div_([p.detach() for p in self.params], self.ps_weight)

    def flush(self) -> None:
        """Finish every message in flight and mix it in (call it at the end of training with OSGP).

        D-PSGD and SGP complete each exchange within its step, so there is nothing to do.
        """


class OSGP(GossipBase):
    """Overlap SGP (arXiv 1910.00643, Appendix C, Algorithm OSGP): push-sum with non-blocking sends.

    Each step a worker keeps its share ``p_ii x`` of its numerator, starts sending the rest,
    mixes whatever has arrived (oldest first), and blocks only for messages that have been in
    flight ``staleness`` steps. Opportunistic mixing depends on timing, so runs are not
    bit-reproducible for ``staleness >= 1``; ``staleness=0`` is SGP, exactly.

    Args:
        comm: the communicator of this worker.
        staleness: steps a message may stay in flight (>= 0; default 1).
        **options: the :class:`GossipBase` options.
    """

    name = "osgp"
    label = "OSGP"
    OPTIONS = GossipBase.OPTIONS + ("staleness",)

    def __init__(self, comm: Communicator, staleness: int = 1, **options: Any) -> None:
        super().__init__(comm, **options)
        self.staleness = check_int(
            "staleness", staleness, 0, "the steps a gossip message may stay in flight (0 is SGP)"
        )
        self.ps_weight = 1.0

    @property
    def consensus_weight(self) -> float:
        return self.ps_weight

    def flush(self) -> None:
        if not self._inflight:
            return
        self._rebias()
        self._mix(until=None)
        self._debias()

    def pre_step(self) -> None:
        # The optimizer steps the numerator x = z * w, not the de-biased model.
        self._rebias()

    @torch.no_grad()
    def post_step(self, step: int) -> None:
        rank = self.comm.rank
        outs = self.graph.out_peers(rank, step)
        keep, share = push_sum_weights(outs)
        self._start(step, outs, self.graph.in_peers(rank, step), share)
        torch._foreach_mul_([p.detach() for p in self.params], keep)
        self.ps_weight *= keep
        self._mix(until=step - self.staleness)
        self._debias()

    def _mix(self, until: int | None) -> None:
        """Add received shares in issue order: every message from steps ``<= until`` (all if
        None, blocking), then any later one that has already arrived. Params hold numerators."""
        while self._inflight:
            item = self._inflight[0]
            if not (until is None or item.step <= until or item.pending.done()):
                break  # keep issue order: a later message never overtakes an earlier one
            self._inflight.popleft()
            received = self._wait(item)
            group = self.groups[item.group]
            params = [p.detach() for p in group.params]
            for src in sorted(received):  # a fixed order: the same sums on every transport
                msg = received[src]
                torch._foreach_add_(params, group.views(msg))
                if group.carries_weight:
                    self.ps_weight += float(msg[-1])

    def before_average(self) -> None:
        # All mass must be home before the exact average; and it averages the numerators x,
        # whose mean is the push-sum consensus value (sum w = m), not the z's.
        self._rebias()
        self._mix(until=None)

    def after_average(self, averaged: bool) -> None:
        if averaged:
            self.ps_weight = 1.0  # params hold the average numerator = the common model
        else:
            self._debias()  # noaverage: each worker keeps its own z and its weight

    def state_dict(self) -> dict[str, Any]:
        self.flush()  # a message in flight would lose a peer's share of the mass on resume
        return {"ps_weight": self.ps_weight}

    def check_state_dict(self, state: dict[str, Any]) -> None:
        w = state.get("ps_weight")
        if (
            isinstance(w, bool)
            or not isinstance(w, (int, float))
            or not w > 0
            or w != w
            or w == float("inf")
        ):
            raise ValueError(
                f"load_state_dict: base {self.name!r} needs a positive finite 'ps_weight' in the "
                f"base-algorithm state, got {w!r}; was the state saved with another base?"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.flush()
        self.ps_weight = float(state["ps_weight"])


class SGP(OSGP):
    """Stochastic Gradient Push (arXiv 1910.00643, Appendix C, Algorithm SGP): each step, send
    half of ``(x, w)`` to one out-peer of the directed exponential graph and block until the
    in-peer's share arrives. OSGP with ``staleness=0``.

    Args:
        comm: the communicator of this worker.
        **options: the :class:`GossipBase` options.
    """

    name = "sgp"
    label = "SGP"
    OPTIONS = GossipBase.OPTIONS

    def __init__(self, comm: Communicator, **options: Any) -> None:
        super().__init__(comm, staleness=0, **options)


class DPSGD(GossipBase):
    """D-PSGD (Lian et al. 2017; arXiv 1910.00643, Appendix C): exchange the whole model with
    the undirected neighbours and average with symmetric doubly-stochastic Metropolis weights
    (1/3 self and per neighbour on a ring; 1/2 with one neighbour). No push-sum weight.

    Args:
        comm: the communicator of this worker.
        **options: the :class:`GossipBase` options.
    """

    name = "dpsgd"
    label = "D-PSGD"
    undirected = True

    @torch.no_grad()
    def post_step(self, step: int) -> None:
        rank = self.comm.rank
        graph = self.graph.graph(step)
        self_weight, weights = metropolis_weights(rank, graph)
        self._start(step, graph[rank], graph[rank], 1.0)
        received = [self._wait(self._inflight.popleft()) for _ in self.groups]
        for group, msgs in zip(self.groups, received):
            params = [p.detach() for p in group.params]
            torch._foreach_mul_(params, self_weight)
            for src in sorted(msgs):
                torch._foreach_add_(params, group.views(msgs[src]), alpha=weights[src])
