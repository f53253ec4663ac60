"""The quorum exchange (``straggler=Quorum(...)``): SlowMo's exact average (arXiv 1910.00643,
Algorithm 1, line 6) over the workers that arrived in time, and a resynchronization of the late
ones from the new anchor.

Rank 0 coordinates. At a boundary every other worker sends its tensors to rank 0 and waits for
the reply. Rank 0 waits until ``min_workers`` finite contributions (its own included) have
arrived, then for the grace (:class:`~hvd_slowmo.straggler.Grace`) or until every worker it
expects has arrived, averages the contributions in rank order (a sum then one division), and
sends the average with the list of members to each member. Every member applies the same slow
step to the same average from the same anchor, so the members stay bitwise identical.

A worker whose contribution arrives after its outer step closed (paused, slowed, or non-finite:
a non-finite contribution is left out like a late one) is dropped from that step: rank 0
notices it at its next boundary, and after closing that outer step sends the late worker the
state it ends with (parameters, which are the new anchor, model buffers, slow buffer). The late
worker copies it and continues from the same outer step as everyone, bitwise identical, never
from a stale anchor; its work since its last outer step is dropped. It idles from its arrival
until rank 0's next close (at most one period and a grace).

With time-based periods (``period_seconds``) each worker's seconds per step ride in its
header; rank 0 plans every worker's next count from the members' (a late worker's last known)
and sends the plan's tally with the average and with a resync, so every worker plans alike.

Messages are point-to-point (:meth:`~hvd_slowmo.comm.base.Communicator.send_start`): a worker
that is not there takes part in nothing. Costs and limits: rank 0 receives and sends ``m - 1``
model copies per outer step (a star, not a ring: for tens of workers, not thousands); rank 0
itself is never late (a paused rank 0 stalls everyone, as without a policy).
"""

import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ..comm.base import Communicator, PendingAverage, PendingExchange
from ..comm.deadline import CollectiveTimeout, collective_timeout, timeout_message
from ..divide import div_
from ..slow_state import SlowState
from ..straggler import Grace, Quorum
from .base import Exchange, Payload

__all__ = ["QuorumExchange"]

log = logging.getLogger("hvd_slowmo")

CONTRIBUTION, REPLY = 0, 1
AVERAGE, RESYNC = 0.0, 1.0
_PARTS = 16  # message parts per (step, kind): a header and one flat per dtype


def _tag(step: int, kind: int, part: int) -> int:
    """The tag of one part of one message: the step (modulo 2^20: messages of one pair of
    ranks are never that many steps apart), contribution or reply, the part."""
    return ((step % (1 << 20)) * 2 + kind) * _PARTS + part


def _dtype_groups(tensors: list[Tensor]) -> list[list[int]]:
    """The tensors' indices grouped by dtype, in first-seen order (one message per group)."""
    groups: dict[torch.dtype, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.dtype, []).append(i)
    if len(groups) >= _PARTS:
        raise ValueError(f"the quorum exchange sends at most {_PARTS - 1} dtypes at once")
    return list(groups.values())


def _flatten(tensors: list[Tensor]) -> list[Tensor]:
    """One flat copy per dtype group."""
    return [
        torch.cat([tensors[i].detach().reshape(-1) for i in group])
        for group in _dtype_groups(tensors)
    ]


@torch.no_grad()
def _unflatten_(flats: list[Tensor], tensors: list[Tensor]) -> None:
    """Copy the flats of :func:`_flatten`'s layout back into ``tensors``."""
    for flat, group in zip(flats, _dtype_groups(tensors)):
        offset = 0
        for i in group:
            n = tensors[i].numel()
            tensors[i].copy_(flat[offset : offset + n].view_as(tensors[i]))
            offset += n


def _mean(contributions: list[list[Tensor]]) -> list[Tensor]:
    """The mean of the members' flats, in rank order: a sum, then one division (an integer
    buffer: the floor of the mean)."""
    out = []
    for j in range(len(contributions[0])):
        acc = contributions[0][j].clone()
        for c in contributions[1:]:
            acc.add_(c[j])
        if acc.is_floating_point():
            div_(acc, len(contributions))
        else:
            acc = torch.div(acc, len(contributions), rounding_mode="floor")
        out.append(acc)
    return out


def _received(handles: list[PendingExchange], src: int, step: int) -> list[Tensor]:
    """The parts of ``src``'s message for outer ``step``; a transport's error (a peer gone past
    the process group's timeout) says which rank and outer step it was."""
    try:
        return [h.wait()[src] for h in handles]
    except Exception as e:
        e.add_note(f"hvd_slowmo: straggler quorum: rank {src}'s message for outer step {step}")
        raise


def _finite(tensors: list[Tensor]) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors if t.is_floating_point())


class QuorumExchange(Exchange):
    """The exact average over the workers that arrived in time; late ones resynchronize.

    Args:
        comm: the communicator over all workers (point-to-point messages needed).
        policy: the quorum policy.
        slow_state: the fragment's slow state (its slow buffer travels in a resync).
        timeout: seconds a worker waits for rank 0's reply, and rank 0 for its quorum, before a
            :class:`~hvd_slowmo.comm.deadline.CollectiveTimeout`; None: the transport's
            collective deadline (``HVD_SLOWMO_COLLECTIVE_TIMEOUT`` where it has none; unset:
            forever).
        clock: seconds as a float (a fake clock makes tests deterministic).

    Attributes:
        step: the outer step this worker contributes to next.
        members: each outer step's members as this worker learnt them (every step on rank 0;
            the steps it took part in, or was resynchronized to, elsewhere).
        resumed_at: after a resync, the outer step this worker continues from (its slow step is
            already applied); None after an ordinary reply.
        grace: the grace rule (rank 0's is the one that counts).
    """

    name = "quorum"
    unsupported = {
        "fragments": "fragments would need a quorum per fragment; use fragments=1",
        "eager": "the eager estimate assumes every worker's share in every outer step",
        "codec": "a late worker's resync carries the state uncompressed; use no codec",
        "hierarchy": "the quorum is over workers, not over nodes; use hierarchical=False",
        "merge": "the weights would have to be renormalised over the members; use merge='mean'",
    }

    def __init__(
        self,
        comm: Communicator,
        policy: Quorum,
        slow_state: SlowState,
        timeout: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(comm)
        if not comm.supports_point_to_point:
            raise ValueError(
                f"straggler={policy!r} needs point-to-point messages, which the "
                f"{type(comm).__name__} transport does not have (Horovod's operations are "
                "collective over every rank, so a missing worker stalls them); launch with "
                "torchrun (torch.distributed) or use thread workers, or straggler=None"
            )
        policy.check_world(comm.size)
        if timeout is None:  # the transport's deadline (thread workers keep it in their world)
            world = getattr(comm, "world", None)
            timeout = getattr(comm, "timeout", getattr(world, "timeout", None))
        self.timeout = collective_timeout() if timeout is None else timeout
        self.policy, self.slow_state, self.clock = policy, slow_state, clock
        self.grace = Grace(policy)
        self.step = 0
        self.members: list[list[int]] = []
        self.resumed_at: int | None = None
        self._params = 0  # how many of the tensors are parameters (the rest: model buffers)
        self._late: dict[int, tuple[int, list[PendingExchange]]] = {}  # rank 0: not yet here
        self._waiting: list[tuple[int, int]] = []  # rank 0: (rank, its step) owed a resync
        self._sends: list[PendingExchange] = []  # rank 0: replies in flight
        self._latest: list[Tensor] | None = None  # rank 0: the last resync body, for settle()
        self._last_tally: list[float] = []  # rank 0: the last merged tally (a resync's too)
        self._seconds: dict[int, float] = {}  # rank 0: each worker's last seconds per step

    # --- the outer step ------------------------------------------------------------------
    def start(self, payload: Payload, exact: bool) -> PendingAverage:
        params = payload.params if exact else []
        tensors = params + payload.extra
        self._params = len(params)
        if self.comm.size == 1:
            return PendingAverage()
        return PendingAverage(lambda: self._run(tensors, payload.tally), started=False)

    def _run(self, tensors: list[Tensor], tally: Tensor | None) -> None:
        self.resumed_at = None
        # Time-based periods: the tally (each worker's seconds per step in its own slot) rides in
        # the header; rank 0 replies with the members' merged tally (:meth:`_merge_tally`).
        extra = [] if tally is None else tally.tolist()
        if self.comm.rank == 0:
            merged = self._close(tensors, extra)
        else:
            merged = self._contribute(tensors, extra)
        if tally is not None:
            tally.copy_(torch.tensor(merged, dtype=tally.dtype))

    def _resync_body(self, tensors: list[Tensor]) -> list[Tensor]:
        """What a resync carries: the parameters (the new anchor), model buffers, slow buffer."""
        return tensors + list(self.slow_state.slow_buffer or [])

    def _wait(self, handle: PendingExchange, src: int, what: str) -> Tensor:
        began = self.clock()
        delay = 0.0
        while not handle.done():
            if self.timeout is not None and self.clock() - began > self.timeout:
                raise CollectiveTimeout(timeout_message(self.comm.rank, what, self.timeout))
            time.sleep(delay)
            delay = min(max(2 * delay, 2e-5), 5e-3)
        return handle.wait()[src]

    def _contribute(self, tensors: list[Tensor], tally: list[float]) -> list[float]:
        """A worker other than rank 0: send, then take the reply (an average or a resync);
        returns the merged tally."""
        comm, t = self.comm, self.step
        flats = _flatten(tensors)
        device = flats[0].device  # NCCL sends only what lives on the GPU: the headers too
        head = [t, float(_finite(tensors)), *tally]
        header = torch.tensor(head, dtype=torch.float64, device=device)
        sends = [comm.send_start(header, 0, _tag(t, CONTRIBUTION, 0))]
        sends += [comm.send_start(f, 0, _tag(t, CONTRIBUTION, 1 + j)) for j, f in enumerate(flats)]
        what = f"rank 0's reply to outer step {t} (straggler quorum)"
        like = torch.empty(2 + comm.size + len(tally), dtype=torch.float64, device=device)
        reply = self._wait(comm.recv_start(like, 0, _tag(t, REPLY, 0)), 0, what)
        kind, closed = float(reply[0]), int(reply[1])
        members = [r for r in range(comm.size) if reply[2 + r] > 0]
        merged = reply[2 + comm.size :].tolist()
        into = tensors if kind == AVERAGE else self._resync_body(tensors)
        likes = flats if kind == AVERAGE else _flatten(into)
        pending = [comm.recv_start(f, 0, _tag(t, REPLY, 1 + j)) for j, f in enumerate(likes)]
        _unflatten_([self._wait(h, 0, what) for h in pending], into)
        for s in sends:
            s.wait()  # rank 0 has read them: it replied
        self.members.append(members)
        if kind == RESYNC:
            if self.slow_state.anchor is not None:
                torch._foreach_copy_(self.slow_state.anchor, tensors[: self._params])
            self.resumed_at = closed + 1
            log.warning(
                "hvd_slowmo: rank %d was late for outer step %d: resynchronized from rank 0 "
                "at outer step %d (its steps since its last outer step are dropped)",
                comm.rank, t, closed + 1,
            )  # fmt: skip
        self.step = closed + 1
        return merged

    def _close(self, tensors: list[Tensor], tally: list[float]) -> list[float]:
        """Rank 0: wait for the quorum and the grace, average the members, reply to them;
        returns the merged tally."""
        comm, t = self.comm, self.step
        flats = _flatten(tensors)
        posted: dict[int, list[PendingExchange]] = {}
        head = torch.empty(2 + len(tally), dtype=torch.float64, device=flats[0].device)
        for r in range(1, comm.size):
            if r not in self._late:  # a late worker's next message is for its own old step
                like = [head, *flats]
                posted[r] = [
                    comm.recv_start(x, r, _tag(t, CONTRIBUTION, j)) for j, x in enumerate(like)
                ]
        tallies = {0: tally}
        bodies = self._gather(posted, {0: flats} if _finite(tensors) else {}, tallies)
        members = sorted(bodies)
        if not members:
            raise RuntimeError(
                f"hvd_slowmo: no worker has finite parameters at outer step {t} (straggler "
                "quorum): every contribution was NaN or inf"
            )
        mean = _mean([bodies[r] for r in members])
        _unflatten_(mean, tensors)
        merged = self._last_tally = self._merge_tally(tallies, members)
        flags = [1.0 if r in members else 0.0 for r in range(comm.size)]
        head_out = [AVERAGE, t, *flags, *merged]
        header = torch.tensor(head_out, dtype=torch.float64, device=mean[0].device)
        for r in members:
            if r != 0:
                self._send(r, t, [header, *mean])
        self.members.append(members)
        self.step = t + 1
        if len(members) < comm.size:
            log.info("hvd_slowmo: outer step %d closed with rank(s) %s", t, members)
        return merged

    def _merge_tally(self, tallies: dict[int, list[float]], members: list[int]) -> list[float]:
        """Rank 0: the tally every worker reads (:func:`hvd_slowmo.merge.read_tally`), as the
        average over every worker would be, from the members' tallies.

        Only time-based periods send one (the weighted merge is refused): the head (``r_i = 1``)
        and the lrs are the members' means; each worker's slot holds its seconds per step
        divided by the workers, a late worker's from its last contribution (until it has
        contributed: the slowest member's), so every worker's next count is planned."""
        if not tallies[0]:
            return []
        size, width = self.comm.size, len(tallies[0])
        groups = width - 2 - size
        for r in members:
            self._seconds[r] = tallies[r][2 + groups + r]
        slowest = max(self._seconds[r] for r in members)
        out = [sum(tallies[r][j] for r in members) / len(members) for j in range(2 + groups)]
        return out + [self._seconds.get(r, slowest) / size for r in range(size)]

    def _gather(
        self,
        posted: dict[int, list[PendingExchange]],
        bodies: dict[int, list[Tensor]],
        tallies: dict[int, list[float]],
    ) -> dict[int, list[Tensor]]:
        """Rank 0: the finite contributions of this outer step (``bodies``, its own in it when
        finite) that arrive before the quorum and the grace are over; the workers that have
        not arrived become late."""
        t, k = self.step, self.policy.min_workers
        began = self.clock()
        arrived: dict[int, float] = {}
        quorum_at = began if len(bodies) >= k else None
        grace, delay = self.grace.seconds(), 0.0
        while True:
            now = self.clock()
            self._take_arrivals(posted, arrived, bodies, tallies, now)
            self._collect_late()
            if quorum_at is None and len(bodies) >= k:
                quorum_at = now
            if len(arrived) == len(posted) or (quorum_at is not None and now - quorum_at >= grace):
                break  # everyone who can arrive for this step did, or the grace is over
            if quorum_at is None and self.timeout is not None and now - began > self.timeout:
                missing = sorted(set(posted) - set(arrived))
                raise CollectiveTimeout(
                    timeout_message(
                        0,
                        f"the quorum of outer step {t} ({k} workers)",
                        self.timeout,
                        f"rank(s) {missing} never arrived",
                    )  # fmt: skip
                )
            time.sleep(delay)
            delay = min(max(2 * delay, 2e-5), 5e-3)
        if quorum_at is not None:
            self.grace.record([arrived[r] - quorum_at for r in bodies if r in arrived])
        for r in set(posted) - set(arrived):
            self._late[r] = (t, posted[r])
        return bodies

    def _take_arrivals(
        self,
        posted: dict[int, list[PendingExchange]],
        arrived: dict[int, float],
        bodies: dict[int, list[Tensor]],
        tallies: dict[int, list[float]],
        now: float,
    ) -> None:
        """Rank 0: note the contributions of this outer step that have arrived by ``now``."""
        for r, handles in posted.items():
            if r not in arrived and all(h.done() for h in handles):
                arrived[r] = now
                header, *body = _received(handles, r, self.step)
                if float(header[1]) > 0:
                    bodies[r], tallies[r] = body, header[2:].tolist()
                else:  # non-finite: left out, resynchronized like a late worker
                    self._waiting.append((r, self.step))

    def _collect_late(self) -> None:
        """Rank 0: the late workers whose message has now arrived wait for a resync."""
        for r, (step, handles) in list(self._late.items()):
            if all(h.done() for h in handles):
                _received(handles, r, step)
                del self._late[r]
                self._waiting.append((r, step))

    def _send(self, rank: int, step: int, parts: list[Tensor]) -> None:
        self._sends = [s for s in self._sends if not s.done()]
        self._sends += [
            self.comm.send_start(p, rank, _tag(step, REPLY, j)) for j, p in enumerate(parts)
        ]

    def landed(self, tensors: list[Tensor]) -> None:
        """After the slow step: rank 0 sends the late workers the state it ends this outer step
        with (the parameters are then the new anchor).

        Args:
            tensors: the payload's tensors (parameters, model buffers) after the slow step.
        """
        if self.comm.rank != 0 or self.comm.size == 1:
            return
        self._latest = None
        if self._waiting or self._late:
            self._latest = _flatten(self._resync_body(tensors))
        self._resync_waiting()

    def _resync_waiting(self) -> None:
        assert self._latest is not None or not self._waiting
        closed, members = self.step - 1, self.members[-1] if self.members else []
        flags = [1.0 if r in members else 0.0 for r in range(self.comm.size)]
        for r, step in self._waiting:
            assert self._latest is not None
            device = self._latest[0].device
            head = [RESYNC, closed, *flags, *self._last_tally]
            header = torch.tensor(head, dtype=torch.float64, device=device)
            self._send(r, step, [header, *self._latest])
        self._waiting = []

    def settle(self) -> None:
        """At the end of training (``opt.finish()``): rank 0 waits for the workers still late
        (up to the deadline), resynchronizes them to the last outer step, and waits for every
        reply to be read, so no message is left in flight."""
        if self.comm.rank != 0:
            return
        began, delay = self.clock(), 0.0
        while self._late:
            self._collect_late()
            if self.timeout is not None and self.clock() - began > self.timeout:
                what = f"the late workers' last messages (after outer step {self.step - 1})"
                missing = f"rank(s) {sorted(self._late)} never arrived"
                raise CollectiveTimeout(timeout_message(0, what, self.timeout, missing))
            time.sleep(delay)
            delay = min(max(2 * delay, 2e-5), 5e-3)
        if self._waiting:
            self._resync_waiting()
        for s in self._sends:
            s.wait()
        self._sends = []

    def state_dict(self) -> dict[str, Any] | None:
        return {"step": self.step}

    def load_state_dict(self, saved: dict[str, Any] | None) -> None:
        if isinstance(saved, dict) and isinstance(saved.get("step"), int):
            self.step = saved["step"]
