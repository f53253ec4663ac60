"""``DistributedOptimizer``: SlowMo (arXiv 1910.00643, Algorithm 1) around any torch optimizer.

The wrapper shares ``param_groups`` and ``state`` with the wrapped optimizer (like PyTorch's
``PostLocalSGDOptimizer``), so LR schedulers, ``GradScaler`` and checkpoint tools see one
optimizer. Each :meth:`DistributedOptimizer.step` is one base-algorithm step; every ``tau``
steps it runs the outer step: exact average, slow update, base-buffer strategy. What it is made
of: the configuration (:mod:`.config`), the base algorithm (:mod:`.bases`), the slow state
(:mod:`.slow_state`) and the communicators (:mod:`.comm`).
"""

import contextlib
import logging
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor

from .bases import grads_or_zeros
from .buffers import averageable_buffers, reset_buffers
from .comm.base import Communicator
from .comm.factory import default_communicator, worker_hierarchy
from .config import SlowMoConfig, check_same_everywhere, param_names, saved_config_changes
from .elastic import is_elastic_launch, register_state_handler
from .hierarchy import Hierarchy
from .progress import gather_progress, uneven_message
from .slow_state import make_slow_state

__all__ = ["STATE_FORMAT", "DistributedOptimizer", "broadcast_optimizer_state"]

log = logging.getLogger("hvd_slowmo")

#: Version of the ``state_dict`` layout; :meth:`DistributedOptimizer.load_state_dict` refuses others.
STATE_FORMAT = 1


def _setting(name: str) -> property:
    return property(lambda self: getattr(self.config, name), doc=f"``config.{name}`` (read-only).")


class DistributedOptimizer(torch.optim.Optimizer):
    """SlowMo over a base algorithm, as a drop-in for ``horovod.torch.DistributedOptimizer``.

    Glossary (paper symbol -> name here): ``tau`` -> ``tau``; ``alpha`` -> ``slow_lr``;
    ``beta`` -> ``slow_momentum``; ``x_{t,0}`` -> anchor; ``u_t`` -> slow buffer;
    ``gamma_t`` -> each param group's current ``lr``.

    Special cases: ``slow_lr=1, slow_momentum=0`` is the base algorithm with a periodic exact
    average (Local SGD for ``base="localsgd"``), and skips the slow update and its memory;
    ``tau=1`` over plain SGD is large-batch momentum SGD; one worker with ``slow_momentum=0`` is
    Lookahead; Local SGD with ``slow_momentum>0`` is BMUF; ``buffers="average"`` with Local SGD
    is double-averaging momentum.

    Args:
        optimizer: the base optimizer (any ``torch.optim.Optimizer``), stepping the local copy.
        named_parameters: ``model.named_parameters()``; names appear in error messages and in
            the cross-rank configuration check. Every optimizer parameter must be named.
        base: the base algorithm: a name from :data:`hvd_slowmo.bases.BASES` (``"localsgd"``,
            ``"allreduce"``, ``"sgp"``, ``"osgp"``, ``"dpsgd"``) or a
            :class:`~hvd_slowmo.bases.base.BaseAlgorithm` subclass (the protocol is documented there).
        tau: base steps per outer step (>= 1).
        slow_lr: ``alpha`` (> 0; default 1.0, the paper's).
        slow_momentum: ``beta`` in ``[0, 1)`` (default 0.5, the paper's).
        buffers: the base optimizer's state at each outer step: ``"reset"``, ``"maintain"``
            or ``"average"``.
        average: False skips the exact average (SGP-SlowMo-noaverage): the slow update then
            acts on each worker's own parameters.
        model_buffers: non-parameter tensors averaged at each exact average, e.g.
            ``model.buffers()`` for BatchNorm running statistics (integer buffers are skipped).
            None averages none.
        compression: ``hvd.Compression.none`` or ``hvd.Compression.fp16`` for the exact
            average's payload (Horovod communicator only).
        nonfinite: what an outer step does when any worker's parameters hold NaN/inf, checked
            before anything is averaged: ``"raise"`` a ``FloatingPointError`` naming the ranks and
            the step on every rank; ``"skip"`` the outer step, restarting every worker from the
            previous anchor with reset base buffers (keeps an anchor even without slow momentum);
            ``"ignore"`` skips the check and its one tiny collective per outer step.
        outer_optimizer: the slow update: ``"heavyball"`` (the paper's), ``"nesterov"`` (Nesterov
            slow momentum, same ``slow_lr``/``slow_momentum``), or a callable that builds any torch
            optimizer over a list of anchor tensors, e.g. ``lambda ps: torch.optim.SGD(ps, lr=0.7,
            momentum=0.9, nesterov=True)`` (DiLoCo). A custom outer optimizer is applied to the
            *unscaled* pseudo-gradient ``x0 - x_avg`` with its own learning rate (so it does not
            follow the base LR schedule); ``slow_lr`` and ``slow_momentum`` are then unused.
        shard_slow_state: keep only this rank's ~1/m shard of the anchor and slow state (ZeRO-1
            style, :mod:`hvd_slowmo.slow_state.sharded`): the exact average becomes a
            reduce-scatter, the slow update runs on the shard and an all-gather returns the new
            anchor (same bytes on the wire). Each rank saves and loads its own shard, in a job of
            the same size.
        worker: what one SlowMo worker is: ``"process"`` (every rank), ``"node"`` (every host:
            gradients are averaged inside the node at every step, the base algorithm runs between
            nodes, see :mod:`hvd_slowmo.hierarchy`; needs ``hvd.init(process_sets="dynamic")``), or
            a :class:`~hvd_slowmo.hierarchy.Hierarchy` of two communicators for other layouts.
        communicator: the transport over all ranks; default a Horovod communicator.
        base_options: extra keyword options for the base algorithm (gossip topology, ...).

    Raises:
        TypeError, ValueError: for invalid arguments, or a configuration that differs across
            ranks (checked with one allgather at construction, so it fails instead of hanging).
    """

    tau = _setting("tau")
    slow_lr = _setting("slow_lr")
    slow_momentum = _setting("slow_momentum")
    buffers = _setting("buffers")
    average = _setting("average")
    nonfinite = _setting("nonfinite")
    base_name = _setting("base_name")

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, Tensor]] | None = None,
        base: Any = "localsgd",
        tau: int = 12,
        slow_lr: float | None = None,
        slow_momentum: float | None = None,
        buffers: str = "reset",
        average: bool = True,
        model_buffers: Iterable[Tensor] | None = None,
        compression: Any = None,
        nonfinite: str = "raise",
        outer_optimizer: str | Callable[[list[Tensor]], torch.optim.Optimizer] = "heavyball",
        shard_slow_state: bool = False,
        worker: str | Hierarchy = "process",
        communicator: Communicator | None = None,
        **base_options: Any,
    ) -> None:
        # Everything is validated before any state is created, so a bad argument leaves nothing.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                            "pass e.g. torch.optim.SGD(model.parameters(), lr=0.1)")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a hvd_slowmo.DistributedOptimizer; wrap the base "
                            "optimizer once")
        self.config = SlowMoConfig(
            base=base, base_options=base_options, tau=tau, slow_lr=slow_lr, slow_momentum=slow_momentum,
            buffers=buffers, average=average, nonfinite=nonfinite, outer_optimizer=outer_optimizer,
            shard_slow_state=shard_slow_state)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.param_names = param_names(params, named_parameters)
        self.comm = default_communicator(communicator, compression)
        hierarchy = worker_hierarchy(worker, communicator)
        #: Averages gradients inside this rank's node every step (hierarchical mode only).
        self.node_comm: Communicator | None = hierarchy.node if hierarchy else None
        self.optimizer = optimizer
        self.model_buffers = [b for b in (model_buffers or []) if isinstance(b, Tensor) and b.is_floating_point()]
        self._params = params
        # The base algorithm runs between workers: between nodes in hierarchical mode.
        self.base = self.config.base(hierarchy.cross if hierarchy else self.comm, **self.config.base_options)
        self.slow_state = make_slow_state(self.comm, self.config)
        if is_elastic_launch():
            # A worker that joins an elastic job later builds its optimizer alone while the others
            # wait in hvd.elastic's state sync: a collective here would deadlock. The same check
            # runs in that sync instead (hvd_slowmo.elastic.sync_optimizer), with every worker there.
            register_state_handler(DistributedOptimizer)
        else:
            self.check_consistent()
        self.base.attach(params)
        self.inner_step = 0  # base steps taken in the current outer step
        self.num_steps = 0  # base steps taken in total
        self.outer_steps = 0
        self._world = (self.comm.rank, self.comm.size)  # the workers the base was built for
        self._synchronized = False
        self._skip_synchronize = False
        #: Cumulative wall-clock seconds per phase (for time-per-iteration breakdowns).
        self.timings: dict[str, float] = {"base_comm": 0.0, "average": 0.0, "slow_update": 0.0}

    # --- the torch.optim.Optimizer surface, shared with the wrapped optimizer ---------------
    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> dict[Tensor, Any]:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: dict[Tensor, Any]) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def __repr__(self) -> str:
        return (f"hvd_slowmo.DistributedOptimizer(base={self.base_name!r}, tau={self.tau}, "
                f"slow_lr={self.slow_lr}, slow_momentum={self.slow_momentum}, buffers={self.buffers!r}, "
                f"average={self.average}, workers={self.comm.size}, optimizer={self.optimizer!r})")

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the gradients, as ``torch.optim.Optimizer.zero_grad``.

        Args:
            set_to_none: drop the gradient tensors instead of zeroing them.
        """
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer (collective: call it on every rank).

        Args:
            param_group: as for ``torch.optim.Optimizer.add_param_group``.
        """
        self.optimizer.add_param_group(param_group)
        new = self.optimizer.param_groups[-1]["params"]
        for i, p in enumerate(new):
            if not p.is_floating_point():
                self.optimizer.param_groups.pop()
                raise TypeError(f"add_param_group: parameter {i} has dtype {p.dtype}; only floating-point "
                                "parameters can be averaged")
        self._params.extend(new)
        self.param_names.extend(f"group{len(self.param_groups) - 1}.param{i}" for i in range(len(new)))
        self.slow_state.add_group_(self.param_groups)
        self.base.attach(self._params)

    # --- Horovod's AMP protocol -----------------------------------------------------------
    def synchronize(self) -> None:
        """Run this step's gradient communication now (Horovod's recipe for ``GradScaler``:
        ``synchronize()``, ``scaler.unscale_(opt)``, then ``with opt.skip_synchronize(): scaler.step(opt)``)."""
        if not self._synchronized:
            t0 = time.perf_counter()
            if self.node_comm is not None and self.node_comm.size > 1:
                self.node_comm.average_(grads_or_zeros(self._params), name="hvd_slowmo.node_grad_average")
            self.base.pre_step()
            self.timings["base_comm"] += time.perf_counter() - t0
            self._synchronized = True

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank handed to every transport it uses (exact average, base, node)."""
        comms = {id(c): c for c in (self.comm, self.base.comm, self.node_comm) if c is not None}
        return sum(c.bytes_sent for c in comms.values())

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Inside this context, :meth:`step` does not run :meth:`synchronize` again."""
        self._skip_synchronize = True
        try:
            yield
        finally:
            self._skip_synchronize = False

    # --- the algorithm --------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One base-algorithm step; every ``tau``-th call also runs the outer step.

        Args:
            closure: optional, re-evaluates the model and returns the loss (called once).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if (self.comm.rank, self.comm.size) != self._world:
            # Horovod elastic re-initialized with other workers and skipped its state sync
            # (workers removed at a commit): nothing may communicate with the old world's layout.
            self.adopt_world("workers changed without an elastic state sync")
        self.slow_state.capture_(self.param_groups)  # once, after hvd.broadcast_parameters
        if not self._skip_synchronize:
            self.synchronize()
        self._synchronized = False
        self.optimizer.step()
        t0 = time.perf_counter()
        self.base.post_step(self.num_steps)
        self.timings["base_comm"] += time.perf_counter() - t0
        self.num_steps += 1
        self.inner_step += 1
        if self.inner_step == self.tau:
            try:
                self._outer_step()
            except Exception as e:
                # A collective that failed (a dead or frozen worker: Horovod's error) or a check
                # that raised: say where, without changing the type (hvd.elastic catches
                # HorovodInternalError by type).
                hint = ("; a worker died, froze (HOROVOD_GLOO_TIMEOUT_SECONDS), or stopped calling "
                        "step() early (uneven data or hvd.join(): see DistributedOptimizer.finish)"
                        if type(e).__name__ == "HorovodInternalError" else "")
                e.add_note(f"hvd_slowmo: raised on rank {self.comm.rank} of {self.comm.size} at outer "
                           f"step {self.outer_steps} (after step {self.num_steps}), base "
                           f"{self.base_name!r}{hint}")
                raise
        return loss

    @torch.no_grad()
    def _outer_step(self) -> None:
        self.base.before_average()
        t0 = time.perf_counter()
        params = [p.detach() for p in self._params]
        if self.nonfinite != "ignore" and not self._all_finite_everywhere(params):
            # Every worker restarts from the anchor, a consensus point: push-sum weights reset too.
            self.base.after_average(True)
        else:
            self.slow_state.average_(params, self.model_buffers if self.average else [],
                                     self.config.exact_average)
            self.base.after_average(self.average)
            if self.buffers == "average":
                self.comm.average_(averageable_buffers(self.optimizer.state, self._params),
                                   name="hvd_slowmo.buffer_average")
            t1 = time.perf_counter()
            t1 += self.slow_state.update_(params, self.param_groups)  # its collectives: averaging
            if self.buffers == "reset":
                reset_buffers(self.optimizer.state, self._params)
            self.timings["average"] += t1 - t0
            self.timings["slow_update"] += time.perf_counter() - t1
        self.inner_step = 0
        self.outer_steps += 1

    def _all_finite_everywhere(self, params: list[Tensor]) -> bool:
        """Agree across ranks on whether every worker's parameters are finite, before any averaging.

        One tiny collective per outer step; with ``nonfinite="skip"`` a failed check restores the
        anchor on every rank, so one worker's NaN never reaches the others.
        """
        local_ok = bool(torch.stack(torch._foreach_norm(params, float("inf"))).isfinite().all()) if params else True
        everyone = gather_progress(self.comm, "outer step", local_ok, self.num_steps, self.outer_steps)
        bad = [r for r, p in enumerate(everyone) if not p["finite"]]
        if not bad:
            return True
        where = (f"non-finite parameters (NaN/inf) on rank(s) {bad} after step {self.num_steps} "
                 f"(outer step {self.outer_steps})")
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"{where}; they were not averaged into the other workers. Lower the learning rate or clip "
                "gradients, or pass nonfinite='skip' to restart the outer step from the last anchor")
        warnings.warn(f"{where}: outer step skipped, every worker restarts from the previous anchor",
                      stacklevel=4)
        self.slow_state.restore_(params)  # nonfinite="skip" always keeps an anchor
        reset_buffers(self.optimizer.state, self._params)
        return False

    # --- reliability: uneven steps, membership changes (docs/reliability.md) ---------------
    def finish(self) -> None:
        """Check that every worker called :meth:`step` equally often; call it on every rank at the
        end of each epoch (before any other collective). Collective.

        Outer steps are count-based, so a worker with fewer batches (uneven data) does not fail
        at an outer step: it stops early while the others wait for it. This check and the one at
        every outer step go through the same named collective, so a worker here and a worker
        still at an outer step meet, and both raise instead of hanging.

        Raises:
            RuntimeError: the workers took different numbers of steps.
        """
        everyone = gather_progress(self.comm, "finish", True, self.num_steps, self.outer_steps)
        if len({p["num_steps"] for p in everyone}) > 1:
            raise RuntimeError(uneven_message(everyone))

    def reset_base(self) -> None:
        """Build a fresh base algorithm for the current workers (gossip graph, transport,
        push-sum weight); messages of the previous one still in flight are dropped."""
        self.base = self.config.base(self.base.comm, **self.config.base_options)
        self.base.attach(self._params)

    @torch.no_grad()
    def adopt_world(self, why: str) -> None:
        """Continue with the current workers: rebuild the base and restart the outer step from
        the anchor, identical on every worker (the base steps since the anchor are dropped).

        Without an anchor (``slow_lr=1, slow_momentum=0`` and ``nonfinite != "skip"``) there is no
        common point: the outer step continues from the parameters as they are.

        Args:
            why: what changed the workers, for the log line and errors.
        """
        self.slow_state.check_world(self._world, why)
        old, self._world = self._world, (self.comm.rank, self.comm.size)
        self.reset_base()
        dropped = 0
        if self.slow_state.captured and self.inner_step > 0:
            dropped = self.inner_step
            self.slow_state.restore_([p.detach() for p in self._params])
            if self.buffers == "reset":
                reset_buffers(self.optimizer.state, self._params)
            self.num_steps -= dropped
            self.inner_step = 0
        if self.comm.rank == 0 and (old != self._world or dropped):
            change = f"{old[1]} -> {self.comm.size} workers, " if old[1] != self.comm.size else ""
            what = (f"outer step {self.outer_steps} restarts from its anchor ({dropped} base steps "
                    f"dropped, num_steps back to {self.num_steps})" if dropped else
                    f"continuing at step {self.num_steps} (inner step {self.inner_step})")
            log.warning("hvd_slowmo: %s (%sbase %r rebuilt for %d workers): %s. The learning rate is "
                        "yours: rescale it in a reset callback if it depends on the number of workers",
                        why, change, self.base_name, self.comm.size, what)

    def _settings(self) -> dict[str, Any]:
        """The configuration as saved and compared across ranks, with the run's layout."""
        worker = "process" if self.node_comm is None else f"node({self.node_comm.size} ranks)"
        return {**self.config.summary(), "num_model_buffers": len(self.model_buffers), "worker": worker}

    def check_consistent(self) -> None:
        """Raise on every rank if any rank is configured differently (settings, parameter names,
        shapes, dtypes). Collective."""
        params = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self.param_names, self._params)]
        check_same_everywhere(self.comm, {**self._settings(), "params": params})

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """Everything needed to continue exactly, keyed by parameter index (not tensor identity).

        Contains the base optimizer's ``state_dict``, the slow state (anchor and slow buffer, or
        this rank's shards), the step counters (position inside the outer step), the base
        algorithm's own state and the configuration. Tensors are references, as in torch's own
        ``state_dict``; ``torch.save`` copies them.
        """
        return {
            "format": STATE_FORMAT,
            "base_optimizer": self.optimizer.state_dict(),
            "slowmo": {
                "config": self._settings(),
                "num_params": len(self._params),
                "inner_step": self.inner_step,
                "num_steps": self.num_steps,
                "world_size": self.comm.size,  # a state from another world size restarts its outer step
                "outer_steps": self.outer_steps,
                **self.slow_state.state_dict(),
                "base_algorithm": self.base.state_dict(),
            },
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Restore :meth:`state_dict` output; on any error the optimizer is left unchanged.

        Args:
            state_dict: from :meth:`state_dict` (any rank's, or rank 0's broadcast).

        Raises:
            ValueError: a state from another format version, model, or configuration.
        """
        if not isinstance(state_dict, dict) or "slowmo" not in state_dict or "base_optimizer" not in state_dict:
            raise ValueError("load_state_dict: not a hvd_slowmo.DistributedOptimizer state (no 'slowmo' and "
                             "'base_optimizer' keys); a plain optimizer state belongs in opt.optimizer.load_state_dict")
        if state_dict.get("format") != STATE_FORMAT:
            raise ValueError(f"load_state_dict: state format {state_dict.get('format')!r} is not supported "
                             f"(this version reads format {STATE_FORMAT})")
        s = state_dict["slowmo"]
        if s.get("num_params") != len(self._params):
            raise ValueError(f"load_state_dict: the state has {s.get('num_params')} parameters, this optimizer "
                             f"{len(self._params)}: it comes from another model")
        inner = s.get("inner_step")
        if not isinstance(inner, int) or not 0 <= inner < self.tau:
            raise ValueError(f"load_state_dict: inner_step {inner!r} is outside [0, tau={self.tau}); "
                             "the state was saved with a larger tau")
        for key in ("num_steps", "outer_steps"):
            if not isinstance(s.get(key), int) or s[key] < 0:
                raise ValueError(f"load_state_dict: '{key}' is {s.get(key)!r}, not a step count: a damaged state")
        changes = saved_config_changes(s.get("config"), self._settings())
        loaded = self.slow_state.prepare_load(s, self.param_groups, inner, self.param_names)
        self.base.check_state_dict(s.get("base_algorithm", {}))
        saved_size = s.get("world_size")  # absent in states written before it was recorded
        if saved_size is not None and saved_size != self.comm.size and inner > 0 and loaded.anchor is None:
            raise ValueError(f"load_state_dict: the state was saved by {saved_size} workers inside an outer "
                             f"step (inner_step {inner}) without an anchor, and this job has {self.comm.size}: "
                             "only the anchor is common to all workers. Save at an outer-step boundary "
                             "(when opt.inner_step == 0), or load with the same number of workers")
        # All checks passed; the wrapped optimizer's own load checks group sizes before it mutates.
        self.optimizer.load_state_dict(state_dict["base_optimizer"])
        self.inner_step = inner
        self.num_steps = int(s["num_steps"])
        self.outer_steps = int(s["outer_steps"])
        self.slow_state.commit_load(loaded)
        self.base.load_state_dict(s.get("base_algorithm", {}))
        if changes:
            warnings.warn("load_state_dict: the state was saved with other settings ("
                          + "; ".join(changes) + "); training continues with this optimizer's", stacklevel=2)
        if saved_size is not None and saved_size != self.comm.size:
            # Inside an outer step each worker's parameters and base state are its own: with
            # another number of workers only the anchor is common, so restart from it.
            self.adopt_world(f"a state saved by {saved_size} workers was loaded by {self.comm.size}")

    def broadcast_state(self, root_rank: int = 0) -> None:
        """Give every rank ``root_rank``'s full optimizer state (base state, anchor, slow buffer,
        counters), e.g. after rank 0 alone loaded a checkpoint. Collective.

        Args:
            root_rank: the rank whose state is sent.

        Raises:
            ValueError: each rank holds its own part of the slow state (``shard_slow_state=True``).
        """
        if self.slow_state.per_rank:
            raise ValueError("broadcast_optimizer_state: with shard_slow_state=True each rank holds its own "
                             "shard of the slow state; have every rank load the state it saved instead")
        mine = self.state_dict() if self.comm.rank == root_rank else None
        self.load_state_dict(self.comm.broadcast_object(mine, root_rank=root_rank))


def broadcast_optimizer_state(optimizer: DistributedOptimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s full optimizer state (:meth:`DistributedOptimizer.broadcast_state`).

    Args:
        optimizer: the optimizer on this rank.
        root_rank: the rank whose state is sent.
    """
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError("broadcast_optimizer_state expects a hvd_slowmo.DistributedOptimizer; "
                        "use hvd.broadcast_optimizer_state for plain optimizers")
    optimizer.broadcast_state(root_rank)
