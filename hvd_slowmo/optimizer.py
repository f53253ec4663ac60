"""``DistributedOptimizer``: SlowMo (arXiv 1910.00643, Algorithm 1) around any torch optimizer.

The wrapper shares ``param_groups`` and ``state`` with the wrapped optimizer (like PyTorch's
``PostLocalSGDOptimizer``), so LR schedulers, ``GradScaler`` and checkpoint tools see one
optimizer. Each :meth:`DistributedOptimizer.step` is one base-algorithm step; every ``tau``
steps it runs the outer step: exact average, slow update, base-buffer strategy. What it is made
of: the configuration (:mod:`.config`), the base algorithm (:mod:`.bases`), the slow state
(:mod:`.slow_state`) and the communicators (:mod:`.comm`).
"""

import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from .amp import MixedPrecision
from .bases.base import BaseAlgorithm
from .comm.base import Communicator
from .comm.factory import (
    default_communicator,
    island_communicators,
    worker_hierarchy,
)
from .comm.hierarchy import Hierarchy
from .config import SlowMoConfig, check_same_everywhere, param_names, resolve_codec
from .consensus import ConsensusView
from .elastic import is_elastic_launch, register_state_handler
from .exchange import Exchange
from .fragment import OuterParts, make_outer_states
from .fragments import fragment_of, resolve_fragments
from .islands import Islands, LocalViews, is_distributed_tensor
from .merge import check_samples
from .outer_step import OuterLoop
from .period import TimedPeriod
from .progress import gather_progress, outer_step_note, uneven_message
from .saved_state import SavedState
from .slow_state import SlowState
from .state_format import STATE_FORMAT
from .straggler import Quorum
from .timing import PhaseTimer
from .validation import check_base_optimizer
from .wrapper import WrappedOptimizer

__all__ = ["STATE_FORMAT", "DistributedOptimizer"]


def _setting(name: str) -> property:
    return property(lambda self: getattr(self.config, name), doc=f"``config.{name}`` (read-only).")


def _counter(name: str) -> property:
    return property(
        lambda self: getattr(self.outer.position, name), doc=f"Position: ``{name}`` (read-only)."
    )


def _check_unequal_worker(config: SlowMoConfig, worker: Any) -> None:
    """Refuse unequal work where a worker is several ranks that must step together: the ranks
    of a node average gradients every step (``worker="node"``, a ``Hierarchy``) and the ranks
    of an island run FSDP's collectives every step, so each rank planning its own steps
    (``period_seconds``) would deadlock them; an island's ranks each hold a shard, so a weight
    per rank (``merge="samples"``) would weight one island's shards differently."""
    if worker == "process":
        return
    if config.straggler is not None:
        raise ValueError(
            f"straggler={config.straggler!r} with worker={worker!r}: the ranks of one worker "
            "take collectives together every step, so one of them cannot be left out; use "
            "worker='process'"
        )
    if config.timed:
        raise ValueError(
            f"period_seconds={config.period_seconds!r} with worker={worker!r}: the ranks of one "
            "worker step together, while time-based periods plan each rank's steps; use "
            "worker='process'"
        )
    if config.merge != "mean" and isinstance(worker, Islands):
        raise ValueError(
            f"merge={config.merge!r} with worker=Islands(...) is not supported: each rank "
            "weights its own shard, so one island's shards could be weighted differently; use "
            "merge='mean'"
        )


def _island_levels(island: Communicator, across: Communicator, params: list[Tensor]) -> Hierarchy:
    """``hierarchical=True`` with islands: the island is the node level, its ranks replicas
    (DDP); an island that shards the model has no level to add.

    Args:
        island: this rank's island.
        across: this rank's peers in the other islands (the outer step's communicator).
        params: the parameters.
    """
    if any(is_distributed_tensor(p) for p in params):
        raise ValueError(
            "hierarchical=True with islands that shard the model (FSDP2): each rank already "
            "exchanges only its shard with its peers; drop hierarchical"
        )
    island.share_counter(across)
    return Hierarchy(node=island, cross=across)


def _warn_unbalanced(split: list[int], params: list[Tensor], count: int) -> None:
    """Warn when named fragments differ in bytes by more than 2x: the largest one's average
    is the longest, and with overlap it must hide behind the shortest phase of the period."""
    size = [0] * count
    for k, p in zip(split, params):
        size[k] += p.numel() * p.element_size()
    if min(size) * 2 < max(size):
        warnings.warn(
            f"fragments: the named fragments hold {size} bytes; the largest average takes the "
            "longest, so balance them by bytes (move modules between the lists) for an even "
            "stream",
            stacklevel=3,
        )


class DistributedOptimizer(MixedPrecision, ConsensusView, SavedState, WrappedOptimizer):
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
        base: the base algorithm; it and the other settings of the algorithm (``tau``,
            ``slow_lr``, ``slow_momentum``, ``buffers``, ``average``, ``nonfinite``,
            ``outer_optimizer``, ``shard_slow_state``, ``overlap``, ``fragments``, ``eager``,
            ``mix``, ``merge``, ``period_seconds``, ``straggler``, ``base_options``: the base
            algorithm's own keyword options, e.g. a gossip topology) are documented and checked in
            :class:`hvd_slowmo.config.SlowMoConfig`.
        model_buffers: non-parameter tensors averaged at each exact average, e.g.
            ``model.buffers()`` for BatchNorm running statistics (integer buffers are skipped).
            None averages none.
        codec: the outer exchange's pseudo-gradient codec: ``"fp16"``, ``"bf16"``, ``"int8"``
            or ``"fp8"`` (``"fp32"``: uncompressed, by the same route): every worker sends its
            pseudo-gradient ``anchor - parameters`` in that format (int8/fp8 with one float32
            scale per 256 values), the sums are float32, and the parameters end bitwise
            identical on every worker (:mod:`hvd_slowmo.compression`; a communicator with
            ``supports_alltoall``). Or ``"sparse"`` /
            :class:`~hvd_slowmo.compression.sparse.SparseCodec` ``(density, bits, chunk,
            ef_decay)``: each worker sends the chunked top-k of its pseudo-gradient at 2-8 bits,
            averaged by an all-gather (docs/sparse.md). None: the exact average is an allreduce
            of the parameters.
        compression: Horovod's meaning only: ``hvd.Compression.none`` / ``hvd.Compression.fp16``
            casts the payload of the default communicator's allreduces (the parameters' exact
            average without a codec, AR-SGD's gradients). None: no cast. A codec name here
            (``compression="int8"``, the old spelling of ``codec``) still works, with a
            ``DeprecationWarning``; together with ``codec`` it raises ``ValueError``.
        error_feedback: with a codec, each worker adds what its codes lost to its next
            pseudo-gradient (the residual is in ``state_dict()``).
        hierarchical: the exact average in two levels
            (:mod:`hvd_slowmo.exchange.hierarchical`): exact inside each node, and across nodes
            each rank averages only its share of the model (through ``codec`` where one is
            given), then an all-gather inside the node. ``True``: the nodes of the launch
            (``worker="node"``'s or an island's ranks, whose parameters are identical, take their
            shard without a reduce-scatter); a :class:`~hvd_slowmo.comm.hierarchy.Hierarchy`:
            these two levels, with ``worker="process"``. Not with islands that shard the model
            (each rank exchanges only its shard already).
        worker: what one SlowMo worker is: ``"process"`` (every rank), ``"node"`` (every host:
            gradients are averaged inside the node at every step, the base algorithm runs between
            nodes, see :mod:`hvd_slowmo.comm.hierarchy`; needs
            ``hvd.init(process_sets="dynamic")``), or a
            :class:`~hvd_slowmo.comm.hierarchy.Hierarchy` of two communicators for other layouts,
            or :class:`~hvd_slowmo.islands.Islands` (a 2-D ``DeviceMesh``): every island of
            ranks, which shards the model with FSDP2 or replicates it with DDP inside, is one
            worker, and the outer step runs on each rank's shard with the ranks holding the same
            shard in the other islands (under ``torchrun``; docs/islands.md).
        communicator: the transport over all ranks; default one over ``engine``.
        engine: who carries the default communicator: ``"horovod"``, ``"torch"``
            (``torch.distributed``, e.g. under ``torchrun``) or ``"auto"``: Horovod where
            ``hvd.init()`` has run, else torch.distributed where it is initialized.
        clock: the clock of time-based periods (``period_seconds``): seconds as a float,
            default ``time.monotonic`` (a fake clock makes tests deterministic).

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
    num_steps = _counter("num_steps")  # base steps taken in total
    inner_step = _counter("inner_step")  # base steps taken in the current outer step
    outer_steps = _counter("outer_steps")  # outer-step boundaries passed

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Iterable[tuple[str, Tensor]] | None = None,
        base: Any = "localsgd",
        tau: int = 12,
        slow_lr: float = 1.0,
        slow_momentum: float = 0.5,
        buffers: str = "reset",
        average: bool = True,
        model_buffers: Iterable[Tensor] | None = None,
        compression: Any = None,
        codec: str | None = None,
        error_feedback: bool = False,
        hierarchical: bool | Hierarchy = False,
        nonfinite: str = "raise",
        outer_optimizer: str | Callable[[list[Tensor]], torch.optim.Optimizer] = "heavyball",
        shard_slow_state: bool = False,
        overlap: int = 0,
        fragments: int | Sequence[Sequence[str]] = 1,
        eager: str | None = None,
        mix: float = 0.0,
        merge: str = "mean",
        period_seconds: float | str | None = None,
        straggler: Quorum | None = None,
        clock: Callable[[], float] | None = None,
        worker: str | Hierarchy | Islands = "process",
        communicator: Communicator | None = None,
        engine: str = "auto",
        **base_options: Any,
    ) -> None:
        # Everything is validated before any state is created, so a bad argument leaves nothing.
        check_base_optimizer(optimizer, DistributedOptimizer)
        codec, compression = resolve_codec(codec, compression)
        fragments, fragment_modules = resolve_fragments(fragments)
        self.config = SlowMoConfig(
            base=base,
            base_options=base_options,
            tau=tau,
            slow_lr=slow_lr,
            slow_momentum=slow_momentum,
            buffers=buffers,
            average=average,
            nonfinite=nonfinite,
            outer_optimizer=outer_optimizer,
            shard_slow_state=shard_slow_state,
            overlap=overlap,
            codec=codec,
            error_feedback=error_feedback,
            hierarchical=hierarchical is not False,
            fragments=fragments,
            fragment_modules=fragment_modules,
            eager=eager,
            mix=mix,
            merge=merge,
            period_seconds=period_seconds,
            straggler=straggler,
        )
        if clock is not None and not callable(clock):
            raise TypeError(
                f"clock must be a callable returning seconds (e.g. time.monotonic), got {clock!r}"
            )
        _check_unequal_worker(self.config, worker)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.param_names = param_names(params, named_parameters)
        split = fragment_of(self.param_names, self.config.fragments, fragment_modules)
        if fragment_modules is not None:
            _warn_unbalanced(split, params, self.config.fragments)
        #: The islands of ``worker=Islands(...)``, or None.
        self.islands = worker if isinstance(worker, Islands) else None
        self._world_comm: Communicator | None = None  # the settings check's, with islands
        self._island_comm: Communicator | None = None  # this rank's island, with islands
        if self.islands is not None:
            self.islands.check_params(
                params, self.param_names, self.config.base_name, self.config.nonfinite
            )
            self.comm, self._island_comm, self._world_comm = island_communicators(
                self.islands, communicator, compression, engine
            )
            worker = "process"  # one island is one worker: no node level
        else:
            sharded = [n for n, p in zip(self.param_names, params) if is_distributed_tensor(p)]
            if sharded:
                raise ValueError(
                    f"parameters {sharded[:3]} are DTensors (FSDP2 or tensor parallel): a rank "
                    "holds only its shard, so the ranks sharing the model must act as one "
                    "worker. Under torchrun pass worker=hvd_slowmo.Islands(mesh) with a 2-D "
                    "DeviceMesh (across islands x inside them); under horovodrun shard nothing "
                    "and use worker='node' (docs/islands.md)"
                )
            # The codec is the outer exchange's; a hvd.Compression belongs to the communicator.
            self.comm = default_communicator(communicator, compression, engine)
        hierarchy = worker_hierarchy(worker, communicator, self.comm)
        #: Averages gradients inside this rank's node every step (hierarchical mode only).
        self.node_comm: Communicator | None = hierarchy.node if hierarchy else None
        super().__init__(optimizer)
        self.model_buffers = [
            b for b in (model_buffers or []) if isinstance(b, Tensor) and b.is_floating_point()
        ]
        #: The parameters, in the index order used on every rank (and in the saved state).
        self.params = params
        if self.islands is not None:
            self._check_island_replicas()
        #: Cumulative wall-clock seconds per phase (for time-per-iteration breakdowns).
        #: ``"average"`` counts only the exposed part of the exact average (with ``overlap``,
        #: the time spent at the boundary and waiting for it to land).
        self.timer = PhaseTimer(("base_comm", "average", "slow_update"))
        self.timings = self.timer.totals
        members = [[j for j, f in enumerate(split) if f == k] for k in range(self.config.fragments)]
        # Each fragment's own slow state and exchange, built (and refused) before any collective.
        owned = make_outer_states(
            self.comm,
            self.config,
            self.timer,
            len(members),
            lambda: self._levels(hierarchical, hierarchy, params),
        )
        if is_elastic_launch():
            # A worker that joins an elastic job later builds its optimizer alone while the others
            # wait in hvd.elastic's state sync: a collective here would deadlock. The same check
            # runs in that sync instead (elastic.sync_optimizer), with every worker there.
            register_state_handler(DistributedOptimizer)
        else:
            self.check_consistent()
        # The base algorithm runs between workers: between nodes in hierarchical mode.
        base_comm = hierarchy.cross if hierarchy else self.comm
        #: The outer loop: step counters, and each outer step's start, landing, skip, restart.
        parts = OuterParts(
            config=self.config,
            comm=self.comm,
            optimizer=optimizer,
            params=LocalViews(params),
            names=self.param_names,
            model_buffers=self.model_buffers,
            timer=self.timer,
        )
        self.outer = OuterLoop(
            parts,
            lambda: self.config.base(base_comm, **self.config.base_options),
            members,
            owned,
            clock,
        )
        self._watch_gradients(params)

    def _levels(
        self, hierarchical: Any, hierarchy: Hierarchy | None, params: list[Tensor]
    ) -> tuple[Hierarchy, bool] | None:
        """The levels of ``hierarchical=`` and whether a node's ranks hold identical parameters
        (None: one level); refuses a layout where the levels mean nothing. Collective where it
        builds the nodes from the launch (``hierarchical=True``, ``worker="process"``).

        Args:
            hierarchical: the argument.
            hierarchy: the levels of ``worker="node"`` (or a ``Hierarchy`` worker), or None.
            params: the parameters (an island that shards them has no level to add).
        """
        if hierarchical is False:
            return None
        given = isinstance(hierarchical, Hierarchy)
        if given and (hierarchy is not None or self.islands is not None):
            raise ValueError(
                "hierarchical=Hierarchy(...) goes with worker='process'; with worker='node' "
                "or islands pass hierarchical=True (the worker's own levels)"
            )
        if self.islands is not None:
            assert self._island_comm is not None
            return _island_levels(self._island_comm, self.comm, params), True
        if hierarchy is not None:
            return hierarchy, True
        # worker="process": the given levels, or the launch's hosts (collective), their bytes
        # counted in the exact average's counter.
        nodes = worker_hierarchy(hierarchical if given else "node", None, self.comm)
        assert nodes is not None
        return nodes, False

    @property
    def base(self) -> BaseAlgorithm:
        """The base algorithm (rebuilt after a change of workers)."""
        return self.outer.base

    @property
    def slow_states(self) -> list[SlowState]:
        """Each fragment's slow state (its anchor and slow buffer or outer optimizer, over its
        parameters: :attr:`hvd_slowmo.fragment.Fragment.members`), in period order."""
        return [f.slow_state for f in self.outer.fragments]

    @property
    def exchanges(self) -> list[Exchange]:
        """Each fragment's exchange (with what it keeps, such as a codec's residual over the
        fragment's parameters), in period order."""
        return [f.exchange for f in self.outer.fragments]

    @property
    def replica_spread(self) -> float | None:
        """This worker's RMS distance from the workers' average at the boundary of the last
        outer step that landed (over its fragment; ``overlap >= 1``; no communication), or None:
        a measure of how far the replicas drift apart between exact averages."""
        return self.outer.replica_spread

    @property
    def period(self) -> TimedPeriod | None:
        """The time-based periods (``period_seconds``): this worker's count for the current
        period (``steps``), every worker's recorded counts (``plans``) and ``replay(plans)``;
        None with ``tau`` steps per period."""
        return self.outer.period

    def __repr__(self) -> str:
        return (
            f"hvd_slowmo.DistributedOptimizer(base={self.base_name!r}, tau={self.tau}, "
            f"slow_lr={self.slow_lr}, slow_momentum={self.slow_momentum}, "
            f"buffers={self.buffers!r}, average={self.average}, workers={self.comm.size}, "
            f"optimizer={self.optimizer!r})"
        )

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a parameter group to the wrapped optimizer (collective: call it on every rank).

        Args:
            param_group: as for ``torch.optim.Optimizer.add_param_group``.
        """
        if self.config.fragments > 1:
            raise ValueError(
                "add_param_group with fragments > 1: the split into fragments is made once, at "
                "construction; put every parameter in the optimizer before wrapping it"
            )
        self.optimizer.add_param_group(param_group)
        new = self.optimizer.param_groups[-1]["params"]
        for i, p in enumerate(new):
            if not p.is_floating_point():
                self.optimizer.param_groups.pop()
                raise TypeError(
                    f"add_param_group: parameter {i} has dtype {p.dtype}; only floating-point "
                    "parameters can be averaged"
                )
        self.params.extend(new)
        self._watch_gradients(new)
        self.param_names.extend(
            f"group{len(self.param_groups) - 1}.param{i}" for i in range(len(new))
        )
        self.outer.add_params(new)

    @property
    def bytes_sent(self) -> int:
        """Payload bytes this rank has put on the wire for training: the exact average, the
        base algorithm's traffic and the node level share one counter, ``comm.bytes_sent``
        (the convention per collective: :class:`~hvd_slowmo.comm.base.Communicator`);
        :meth:`use_consensus` traffic is not counted."""
        return self.comm.bytes_sent

    # --- the algorithm --------------------------------------------------------------------
    def step(self, closure: Callable[[], Any] | None = None, samples: float | None = None) -> Any:
        """One base-algorithm step; every ``tau``-th call also runs the outer step (with
        ``period_seconds``: the call that ends this worker's planned count for the period).

        Under ``torch.amp.GradScaler`` (``scaler.step(opt)``, with or without Horovod's
        ``synchronize``/``unscale_``/``skip_synchronize`` recipe) the scaler's inf/NaN verdict is
        made common to all workers: if any worker's gradients overflowed, every worker skips this
        step as if it never happened (no update, no communication of parameters, the step
        counters and the outer-step schedule unchanged; ``skipped_steps`` counts them). Bases
        that average gradients (``base="allreduce"``) decide from the averaged gradients at no
        communication cost; the others add one scalar allreduce per step, only under a scaler.

        Args:
            closure: optional, re-evaluates the model and returns the loss (called once).
            samples: the samples (or tokens) this step processed, weighting this worker's
                pseudo-gradient under ``merge="samples"``; None counts 1 (every step the same).
        """
        count = 1.0 if samples is None else check_samples(samples)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if (self.comm.rank, self.comm.size) != self.outer.position.world:
            # Horovod elastic re-initialized with other workers and skipped its state sync
            # (workers removed at a commit): nothing may communicate with the old world's layout.
            self.adopt_world("workers changed without an elastic state sync")
        self.outer.capture_()  # once, after hvd.broadcast_parameters
        if not self._gradients_ready():
            self.skipped_steps += 1  # an overflow on some worker: every worker skips this step
            return loss
        self.base.pre_step()
        self.optimizer.step()
        with self.timer("base_comm"):
            self.base.post_step(self.num_steps)
        try:
            self.outer.advance(count)
        except Exception as e:
            # A failed collective (a dead or frozen worker) or a check that raised: say where,
            # without changing the type (hvd.elastic catches HorovodInternalError by type).
            e.add_note(
                outer_step_note(e, self.comm, self.outer_steps, self.num_steps, self.base_name)
            )
            raise
        return loss

    def flush(self) -> None:
        """Land an outer step whose average is in flight now (``overlap``), and mix in gossip
        messages in flight (OSGP). Call it on every rank at the end of training, before the
        final evaluation or checkpoint. Collective."""
        self.outer.flush()

    # --- reliability: uneven steps, membership changes (docs/reliability.md) ---------------
    def finish(self) -> None:
        """Check that every worker called :meth:`step` equally often; call it on every rank at the
        end of each epoch (before any other collective). Collective.

        Outer steps are count-based, so a worker with fewer batches (uneven data) does not fail
        at an outer step: it stops early while the others wait for it. This check and the one at
        every outer step go through the same named collective, so a worker here and a worker
        still at an outer step meet, and both raise instead of hanging.

        Under a straggler quorum (``straggler=``) rank 0 first waits for the workers still late
        and resynchronizes them, so every worker ends at the same outer step; with unequal step
        counts (a quorum, time-based periods) the outer steps are compared.

        Raises:
            RuntimeError: the workers took different numbers of steps.
        """
        self.outer.check_progress()  # a probe in flight shares the name of the one below
        for fragment in self.outer.fragments:
            fragment.exchange.settle()  # a straggler quorum: the late workers catch up first
        # Time-based periods and a quorum: the workers' step counts differ by design, their
        # outer steps not.
        unequal = self.config.timed or self.config.straggler is not None
        by = "outer_steps" if unequal else "num_steps"
        everyone = gather_progress(self.comm, "finish", True, self.num_steps, self.outer_steps, by)
        if len({p[by] for p in everyone}) > 1:
            raise RuntimeError(uneven_message(everyone))

    def reset_base(self) -> None:
        """Build a fresh base algorithm for the current workers (gossip graph, transport,
        push-sum weight); messages of the previous one still in flight are dropped."""
        self.outer.rebuild_base()

    def adopt_world(self, why: str) -> None:
        """Continue with the current workers: rebuild the base and restart the outer step from
        the anchor (:meth:`hvd_slowmo.outer_step.OuterLoop.restart`; one log line on rank 0).

        Args:
            why: what changed the workers, for the log line and errors.
        """
        self.outer.restart(why)

    def _settings(self) -> dict[str, Any]:
        """The configuration as saved and compared across ranks, with the run's layout."""
        worker = "process" if self.node_comm is None else f"node({self.node_comm.size} ranks)"
        if self.islands is not None:
            worker = f"islands({self.islands.count} x {self.islands.ranks_per_island} ranks)"
        return {
            **self.config.summary(),
            "num_model_buffers": len(self.model_buffers),
            "worker": worker,
        }

    def check_consistent(self) -> None:
        """Raise on every rank if any rank is configured differently (settings, parameter names,
        shapes, dtypes). Collective."""
        # A DTensor's shape is the whole parameter's, so with islands every rank of the job can
        # be compared: a rank of one island configured unlike its island's other ranks would
        # run another outer schedule and hang the island's FSDP collectives.
        params = [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self.param_names, self.params)]
        check_same_everywhere(self._world_comm or self.comm, {**self._settings(), "params": params})

    def _check_island_replicas(self) -> None:
        """With unsharded (DDP) islands, raise on every rank if the ranks of an island start from
        different parameters (a missing broadcast: each would train its own model). Collective
        over the job (every rank raises, none waits); FSDP islands hold one copy per shard and
        skip it."""
        if self.islands is None or self._world_comm is None:
            return
        if any(is_distributed_tensor(p) for p in self.params):
            return
        with torch.no_grad():
            mine = [float(p.double().sum()) for p in self.params]
        everyone = self._world_comm.allgather_object((self.islands.index, mine))
        first: dict[int, list[float]] = {}
        for island, sums in everyone:
            if first.setdefault(island, sums) != sums:
                raise ValueError(
                    f"worker=Islands(...): the ranks of island {island} hold different "
                    "parameters at construction; replicate the model inside each island (DDP "
                    "does when it wraps the model, or broadcast the parameters) before building "
                    "the optimizer"
                )
