"""``DistributedOptimizer``: SlowMo (arXiv 1910.00643, Algorithm 1) around any torch optimizer.

The wrapper shares ``param_groups`` and ``state`` with the wrapped optimizer (like PyTorch's
``PostLocalSGDOptimizer``), so LR schedulers, ``GradScaler`` and checkpoint tools see one
optimizer. Each :meth:`DistributedOptimizer.step` is one base-algorithm step; every ``tau``
steps it runs the outer step: exact average, slow momentum update, base-buffer strategy.
"""
import contextlib
import logging
import math
import time
import warnings
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch
from torch import Tensor

from .amp import any_nonfinite, unscale_grads_
from .bases import BASES, grads_or_zeros
from .buffers import BUFFER_STRATEGIES, averageable_buffers, reset_buffers
from .comm.base import Communicator
from .sharded import ShardedSlowState, check_shard_option
from .elastic import is_elastic_launch, register_state_handler
from .hierarchy import Hierarchy, horovod_node_hierarchy
from .slowmo import slow_momentum_step_

__all__ = ["DistributedOptimizer", "broadcast_optimizer_state", "STATE_FORMAT"]

log = logging.getLogger("hvd_slowmo")

#: Version of the ``state_dict`` layout; :meth:`DistributedOptimizer.load_state_dict` refuses others.
STATE_FORMAT = 1


def _check_number(name: str, value: Any, low: float, high: float, high_open: bool, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite number, got {value!r}; {fix}")
    if value < low or value > high or (high_open and value == high):
        bracket = ")" if high_open else "]"
        raise ValueError(f"{name} must be in [{low}, {high}{bracket}, got {value!r}; {fix}")
    return float(value)


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
        base: the base algorithm: ``"localsgd"`` or ``"allreduce"`` (plus the gossip bases
            when registered).
        tau: base steps per outer step (>= 1).
        slow_lr: ``alpha`` (> 0).
        slow_momentum: ``beta`` in ``[0, 1)``.
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
            style, :mod:`hvd_slowmo.sharded`): the exact average becomes a reduce-scatter, the slow
            update runs on the shard and an all-gather returns the new anchor (same bytes on the
            wire). Each rank saves and loads its own shard, in a job of the same size.
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

    #: ``torch.amp.GradScaler.step`` always calls :meth:`step` and passes its verdict, so the
    #: decision to skip an overflowed step is made the same on every worker (see :meth:`step`).
    _step_supports_amp_scaling = True

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        named_parameters: Optional[Iterable[Tuple[str, Tensor]]] = None,
        base: str = "localsgd",
        tau: int = 12,
        slow_lr: float = 1.0,
        slow_momentum: float = 0.5,
        buffers: str = "reset",
        average: bool = True,
        model_buffers: Optional[Iterable[Tensor]] = None,
        compression: Any = None,
        nonfinite: str = "raise",
        outer_optimizer: Union[str, Callable[[List[Tensor]], torch.optim.Optimizer]] = "heavyball",
        shard_slow_state: bool = False,
        worker: Union[str, Hierarchy] = "process",
        communicator: Optional[Communicator] = None,
        **base_options: Any,
    ) -> None:
        # Everything is validated before any state is created, so a bad argument leaves nothing behind.
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
                "pass e.g. torch.optim.SGD(model.parameters(), lr=0.1)")
        if isinstance(optimizer, DistributedOptimizer):
            raise TypeError("optimizer is already a hvd_slowmo.DistributedOptimizer; wrap the base optimizer once")
        if not isinstance(base, str) or base not in BASES:
            raise ValueError(f"base must be one of {sorted(BASES)}, got {base!r}")
        if isinstance(tau, bool) or not isinstance(tau, int) or tau < 1:
            raise ValueError(f"tau must be an integer >= 1 (base steps per outer step), got {tau!r}")
        slow_lr = _check_number("slow_lr", slow_lr, 0.0, math.inf, True, "use e.g. slow_lr=1.0")
        if slow_lr == 0:
            raise ValueError("slow_lr must be > 0, got 0; slow_lr=1.0 is the paper's default")
        slow_momentum = _check_number("slow_momentum", slow_momentum, 0.0, 1.0, True,
                                      "the paper tunes it in [0.4, 0.8]; 0 disables slow momentum")
        if buffers not in BUFFER_STRATEGIES:
            raise ValueError(f"buffers must be one of {list(BUFFER_STRATEGIES)}, got {buffers!r}")
        if not (outer_optimizer in ("heavyball", "nesterov") or callable(outer_optimizer)):
            raise ValueError(f"outer_optimizer must be 'heavyball', 'nesterov' or a callable building a torch "
                             f"optimizer from a list of tensors, got {outer_optimizer!r}")
        if callable(outer_optimizer) and (slow_lr, slow_momentum) != (1.0, 0.5):
            warnings.warn("slow_lr and slow_momentum are not used with a custom outer_optimizer: set the "
                          "outer optimizer's own lr and momentum instead", stacklevel=2)
        if nonfinite not in ("raise", "skip", "ignore"):
            raise ValueError(f"nonfinite must be 'raise', 'skip' or 'ignore', got {nonfinite!r}")
        if not isinstance(average, bool):
            raise TypeError(f"average must be True or False, got {average!r}")
        check_shard_option(shard_slow_state, callable(outer_optimizer) or (slow_lr, slow_momentum) != (1.0, 0.0), average)
        if compression is not None and not (callable(getattr(compression, "compress", None))
                                             and callable(getattr(compression, "decompress", None))):
            raise TypeError(f"compression must be a hvd.Compression (none or fp16), got {compression!r}")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        names = self._check_names(params, named_parameters)
        for p, n in zip(params, names):
            if not p.is_floating_point():
                raise TypeError(f"parameter {n!r} has dtype {p.dtype}; only floating-point parameters can be "
                                "averaged: keep integer tensors out of the optimizer (as buffers)")
        base_cls = BASES[base]
        extra = sorted(set(base_options) - set(base_cls.OPTIONS))
        if extra:
            raise TypeError(f"unknown argument(s) {extra} for DistributedOptimizer with base={base!r} "
                            f"(its options: {list(base_cls.OPTIONS) or 'none'})")
        if not average and not base_cls.communicates_every_step:
            raise ValueError(f"average=False with base={base!r} would never synchronize workers; "
                             "use average=False only with a gossip base (sgp, osgp, dpsgd)")
        model_buffers = [b for b in (model_buffers or []) if isinstance(b, Tensor) and b.is_floating_point()]

        if not (worker in ("process", "node") or isinstance(worker, Hierarchy)):
            raise ValueError(f"worker must be 'process', 'node' or a hvd_slowmo.hierarchy.Hierarchy, got {worker!r}")
        if worker == "node" and communicator is not None:
            raise ValueError("worker='node' builds Horovod process sets; with your own communicator pass "
                             "worker=Hierarchy(node=..., cross=...) instead")
        if communicator is None:
            from .comm.horovod import HorovodCommunicator

            communicator = HorovodCommunicator(compression=compression)
        elif compression is not None:
            raise ValueError("compression is applied by the default Horovod communicator; "
                             "pass compression to your communicator instead")
        hierarchy = horovod_node_hierarchy() if worker == "node" else (worker if isinstance(worker, Hierarchy) else None)
        #: Averages gradients inside this rank's node every step (hierarchical mode only).
        self.node_comm: Optional[Communicator] = hierarchy.node if hierarchy else None
        self.comm = communicator
        # The base algorithm runs between workers: between nodes in hierarchical mode.
        self.base = base_cls(hierarchy.cross if hierarchy else communicator, **base_options)
        self.base_name = base
        self._base_options = dict(base_options)  # to rebuild the base for other workers (elastic)
        self.optimizer = optimizer
        self.tau = tau
        self.slow_lr = slow_lr
        self.slow_momentum = slow_momentum
        self.buffers = buffers
        self.average = average
        self.nonfinite = nonfinite
        self.model_buffers = model_buffers
        self.param_names = names
        self._params = params
        self.outer_optimizer_factory = outer_optimizer if callable(outer_optimizer) else None
        self.outer_optimizer: Optional[torch.optim.Optimizer] = None  # built with the anchor
        self.nesterov = outer_optimizer == "nesterov"
        #: This rank's shards of the slow state (shard_slow_state=True); self.anchor/slow_buffer then stay None.
        self.sharded = (ShardedSlowState(communicator, slow_lr, slow_momentum, self.nesterov,
                                         self.outer_optimizer_factory) if shard_slow_state else None)
        if is_elastic_launch():
            # A worker that joins an elastic job later builds its optimizer alone while the others
            # wait in hvd.elastic's state sync: a collective here would deadlock. The same check
            # runs in that sync instead (hvd_slowmo.elastic.sync_optimizer), with every worker there.
            register_state_handler(DistributedOptimizer)
        else:
            self._check_same_everywhere()
        if base == "allreduce" and buffers == "average":
            warnings.warn("buffers='average' with base='allreduce' averages buffers that are already "
                          "identical on every worker; use buffers='maintain'", stacklevel=2)

        self.base.attach(params)
        #: Slow update disabled: plain periodic averaging with no anchor or buffer memory.
        self.slow_enabled = callable(outer_optimizer) or not (slow_lr == 1.0 and slow_momentum == 0.0)
        self.inner_step = 0  # base steps taken in the current outer step
        self.num_steps = 0  # base steps taken in total
        self._world = (self.comm.rank, self.comm.size)  # the workers the base was built for
        self.outer_steps = 0
        self.anchor: Optional[List[Tensor]] = None  # captured lazily: after hvd.broadcast_parameters
        self.slow_buffer: Optional[List[Tensor]] = None
        self._synchronized = False  # this backward's gradients are communicated
        self._skip_synchronize = False
        self._zero_lr_warned = False
        #: Steps skipped on every worker because a GradScaler found inf/NaN gradients on any worker.
        self.skipped_steps = 0
        #: Cumulative wall-clock seconds per phase (for time-per-iteration breakdowns).
        self.timings: Dict[str, float] = {"base_comm": 0.0, "average": 0.0, "slow_update": 0.0}
        self._grad_hooks: List[Any] = []
        self._watch_backward(params)
        # torch.optim.Optimizer.__init__ is not run (it would copy the param groups that this
        # wrapper shares), so create the hook registries it would, and wrap step() the same way:
        # register_step_pre_hook & co. then behave as on any torch optimizer.
        self._optimizer_step_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_step_post_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_state_dict_post_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks: Dict[int, Callable] = OrderedDict()
        self._optimizer_load_state_dict_post_hooks: Dict[int, Callable] = OrderedDict()
        self._patch_step_function()

    def _watch_backward(self, params: List[Tensor]) -> None:
        """Mark the gradients as not yet communicated whenever a backward pass accumulates into
        any parameter: a step skipped after :meth:`synchronize` (an AMP overflow) must not make
        the next step reuse that synchronization with fresh, uncommunicated gradients."""
        me = weakref.ref(self)  # the parameters must not keep the optimizer alive

        def fresh_gradient(_: Tensor) -> None:
            opt = me()
            if opt is not None:
                opt._synchronized = False

        self._grad_hooks += [p.register_post_accumulate_grad_hook(fresh_gradient) for p in params]

    # --- the torch.optim.Optimizer surface, shared with the wrapped optimizer ---------------
    @property
    def param_groups(self) -> List[Dict[str, Any]]:  # type: ignore[override]
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: List[Dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> Dict[Tensor, Any]:  # type: ignore[override]
        return self.optimizer.state

    @state.setter
    def state(self, value: Dict[Tensor, Any]) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> Dict[str, Any]:  # type: ignore[override]
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: Dict[str, Any]) -> None:
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
        self._synchronized = False

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
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
        self._watch_backward(new)
        self.param_names.extend(f"group{len(self.param_groups) - 1}.param{i}" for i in range(len(new)))
        if self.anchor is not None:
            new_anchor = [p.detach().clone() for p in new]
            self.anchor.extend(new_anchor)
            if self.outer_optimizer is not None:  # else the new parameters would never leave their anchor
                self.outer_optimizer.add_param_group({"params": new_anchor})
        if self.slow_buffer is not None:
            self.slow_buffer.extend(torch.zeros_like(p) for p in new)
        self.base.attach(self._params)
        if self.sharded is not None:
            self.sharded.add_group_(self.param_groups)

    # --- Horovod's AMP protocol -----------------------------------------------------------
    def synchronize(self) -> None:
        """Run this step's gradient communication now (Horovod's recipe for ``GradScaler``:
        ``synchronize()``, ``scaler.unscale_(opt)``, then ``with opt.skip_synchronize(): scaler.step(opt)``).

        It touches gradients only, so a step skipped after it changes nothing; it runs once per
        backward pass (a new backward, or ``zero_grad``, makes the next call communicate again).
        """
        if not self._synchronized:
            t0 = time.perf_counter()
            if self.node_comm is not None and self.node_comm.size > 1:
                self.node_comm.average_(grads_or_zeros(self._params), name="hvd_slowmo.node_grad_average")
            self.base.communicate_gradients()
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
    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """One base-algorithm step; every ``tau``-th call also runs the outer step.

        Under ``torch.amp.GradScaler`` (``scaler.step(opt)``, with or without Horovod's
        ``synchronize``/``unscale_``/``skip_synchronize`` recipe) the scaler's inf/NaN verdict is
        made common to all workers: if any worker's gradients overflowed, every worker skips this
        step as if it never happened (no update, no communication of parameters, the step
        counters and the outer-step schedule unchanged; ``skipped_steps`` counts them). Bases
        that average gradients (``base="allreduce"``) decide from the averaged gradients at no
        communication cost; the others add one scalar allreduce per step, only under a scaler.

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
            self._adopt_world("workers changed without an elastic state sync")
        if self.anchor is None and self._keeps_anchor:
            self._capture_anchor()
        # Set by GradScaler.step around this call (see _step_supports_amp_scaling).
        found_inf: Optional[Tensor] = getattr(self, "found_inf", None)
        grad_scale: Optional[Tensor] = getattr(self, "grad_scale", None)
        overflow = found_inf is not None and bool(found_inf.sum().item())
        if grad_scale is not None and not self._synchronized:
            # scaler.step(opt) without scaler.unscale_(opt): unscale before communicating, since
            # the workers' loss scales differ once one of them has backed off from an overflow.
            overflow = unscale_grads_(self._grads(), grad_scale) or overflow
            grad_scale = None
        if not self._skip_synchronize:
            self.synchronize()
        self._synchronized = False
        if found_inf is not None:
            if grad_scale is not None:  # communicated by an explicit synchronize(), still scaled
                overflow = unscale_grads_(self._grads(), grad_scale) or overflow
            if self._overflow_anywhere(overflow):
                self.skipped_steps += 1
                return loss
        self.base.pre_step()
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
                hint = ("; a worker died, froze (HOROVOD_GLOO_TIMEOUT_SECONDS), or stopped calling step() "
                        "early (uneven data or hvd.join(): see DistributedOptimizer.finish)"
                        if type(e).__name__ == "HorovodInternalError" else "")
                if hasattr(e, "add_note"):  # Python >= 3.11
                    e.add_note(f"hvd_slowmo: raised on rank {self.comm.rank} of {self.comm.size} at outer step "
                               f"{self.outer_steps} (after step {self.num_steps}), base {self.base_name!r}{hint}")
                raise
        return loss

    def _grads(self) -> List[Tensor]:
        return [p.grad for p in self._params if p.grad is not None]

    def _overflow_anywhere(self, overflow: bool) -> bool:
        """Whether any worker's gradients overflowed this step: the same answer on every worker.

        Args:
            overflow: whether this worker's gradients held inf/NaN, as the scaler saw them.
        """
        if self.base.averages_gradients:
            # Every worker holds the same averaged gradients, and an inf/NaN on any worker is
            # non-finite in the average: a local check of them agrees everywhere with no
            # collective (the scaler may have checked this worker's gradients before averaging).
            return any_nonfinite(self._grads())
        flag = torch.tensor([1.0 if overflow else 0.0], dtype=torch.float64)
        self.comm.average_([flag], name="hvd_slowmo.amp_overflow")
        return flag.item() > 0

    @property
    def _keeps_anchor(self) -> bool:
        return self.slow_enabled or self.nonfinite == "skip"

    def _capture_anchor(self) -> None:
        if self.sharded is not None:
            self.sharded.capture_(self.param_groups)  # self.anchor stays None: returns at once once captured
            return
        with torch.no_grad():
            self.anchor = [p.detach().clone() for p in self._params]
            if self.outer_optimizer_factory is not None:
                self.outer_optimizer = self._build_outer_optimizer(self.anchor)
            elif self.slow_enabled:
                self.slow_buffer = [torch.zeros_like(p) for p in self._params]

    def _build_outer_optimizer(self, anchor: List[Tensor]) -> torch.optim.Optimizer:
        assert self.outer_optimizer_factory is not None
        opt = self.outer_optimizer_factory(anchor)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"outer_optimizer must return a torch.optim.Optimizer, got {type(opt).__name__}")
        return opt

    @torch.no_grad()
    def _outer_step(self) -> None:
        self.base.before_average()
        t0 = time.perf_counter()
        params = [p.detach() for p in self._params]
        if self.nonfinite != "ignore" and not self._all_finite_everywhere(params):
            # Every worker restarts from the anchor, a consensus point: push-sum weights reset too.
            self.base.after_average(True)
            self.inner_step = 0
            self.outer_steps += 1
            return
        if self.average and self.base.needs_exact_average and self.sharded is None:
            self.comm.average_(params + self.model_buffers, name="hvd_slowmo.exact_average")
        elif self.average and self.model_buffers:
            self.comm.average_(self.model_buffers, name="hvd_slowmo.exact_average")
        self.base.after_average(self.average)
        if self.buffers == "average":
            self.comm.average_(averageable_buffers(self.optimizer.state, self._params),
                               name="hvd_slowmo.buffer_average")
        t1 = time.perf_counter()
        if self.sharded is not None:
            # Reduce-scatter, slow update of this rank's shard, all-gather; the collectives count as averaging.
            t1 += self.sharded.outer_step_(params, self.param_groups, exact=self.base.needs_exact_average)
        elif self.slow_enabled:
            self._slow_update()
        elif self.anchor is not None:
            torch._foreach_copy_(self.anchor, params)
        if self.buffers == "reset":
            reset_buffers(self.optimizer.state, self._params)
        self.timings["average"] += t1 - t0
        self.timings["slow_update"] += time.perf_counter() - t1
        self.inner_step = 0
        self.outer_steps += 1

    def _all_finite_everywhere(self, params: List[Tensor]) -> bool:
        """Agree across ranks on whether every worker's parameters are finite, before any averaging.

        One tiny collective per outer step; with ``nonfinite="skip"`` a failed check restores the
        anchor on every rank, so one worker's NaN never reaches the others.
        """
        local_ok = bool(torch.stack(torch._foreach_norm(params, float("inf"))).isfinite().all()) if params else True
        bad = [r for r, p in enumerate(self._gather_progress("outer step", local_ok)) if not p["finite"]]
        if not bad:
            return True
        where = (f"non-finite parameters (NaN/inf) on rank(s) {bad} after step {self.num_steps} "
                 f"(outer step {self.outer_steps})")
        if self.nonfinite == "raise":
            raise FloatingPointError(
                f"{where}; they were not averaged into the other workers. Lower the learning rate or clip "
                "gradients, or pass nonfinite='skip' to restart the outer step from the last anchor")
        warnings.warn(f"{where}: outer step skipped, every worker restarts from the previous anchor", stacklevel=3)
        if self.sharded is not None:
            self.sharded.restore_(params)  # all-gathers the full anchor
        else:
            assert self.anchor is not None  # nonfinite="skip" always keeps an anchor
            torch._foreach_copy_(params, self.anchor)
        reset_buffers(self.optimizer.state, self._params)
        return False

    def _slow_update(self) -> None:
        assert self.anchor is not None
        if self.outer_optimizer is not None:
            params = [p.detach() for p in self._params]
            for a, x in zip(self.anchor, params):
                a.grad = a - x  # the unscaled pseudo-gradient
            self.outer_optimizer.step()
            self.outer_optimizer.zero_grad(set_to_none=True)
            torch._foreach_copy_(params, self.anchor)
            return
        assert self.slow_buffer is not None
        start = 0
        for group in self.param_groups:
            n = len(group["params"])
            idx = range(start, start + n)
            start += n
            lr = float(group["lr"])
            params = [self._params[i].detach() for i in idx]
            anchor = [self.anchor[i] for i in idx]
            if lr <= 0:
                # The pseudo-gradient is scaled by 1/lr: undefined at lr=0 (a warm-up that starts
                # at zero). Keep the slow buffer, restart from the average.
                if not self._zero_lr_warned:
                    warnings.warn("a param group has lr=0 at an outer step: its slow update is skipped "
                                  "and its anchor set to the average", stacklevel=3)
                    self._zero_lr_warned = True
                torch._foreach_copy_(anchor, params)
                continue
            slow_momentum_step_(params, anchor, [self.slow_buffer[i] for i in idx], lr,
                                self.slow_lr, self.slow_momentum, nesterov=self.nesterov)

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
        everyone = self._gather_progress("finish", True)
        if len({p["num_steps"] for p in everyone}) > 1:
            raise RuntimeError(self._uneven_message(everyone))

    def _gather_progress(self, at: str, finite: bool) -> List[Dict[str, Any]]:
        # The same collective for every call (Horovod matches collectives by name), so finish() on
        # one rank meets an outer step on another instead of stalling. Normally it is one 4-element
        # allreduce: every rank gets the same averages, so all take the same branch below, and only
        # when something is wrong do they pay for an allgather of the details.
        mine = {"at": at, "finite": finite, "num_steps": self.num_steps, "outer_steps": self.outer_steps}
        n = float(self.num_steps)
        probe = torch.tensor([0.0 if finite else 1.0, 1.0 if at == "finish" else 0.0, n, n * n], dtype=torch.float64)
        self.comm.average_([probe], name="hvd_slowmo.progress")
        any_bad, finishing, mean, mean_sq = probe.tolist()
        # All counts equal <=> mean(n^2) == mean(n)^2; exact in float64 while m * n^2 < 2^53.
        if any_bad == 0.0 and finishing in (0.0, 1.0) and mean_sq == mean * mean:
            return [mine] * self.comm.size
        everyone = self.comm.allgather_object(mine)
        if any(p["at"] != at for p in everyone):
            raise RuntimeError(self._uneven_message(everyone))
        return everyone

    @staticmethod
    def _uneven_message(everyone: List[Dict[str, Any]]) -> str:
        where = "; ".join(f"rank {r} at {p['at']} after {p['num_steps']} steps" for r, p in enumerate(everyone))
        return (f"hvd_slowmo: workers called step() different numbers of times ({where}). SlowMo's outer "
                "steps need the same number of steps on every worker: give every rank the same number of "
                "batches (DistributedSampler(drop_last=True) with a DataLoader(drop_last=True), or "
                "hvd.elastic.ElasticSampler); hvd.join() cannot even out outer steps, which are not allreduces")

    def _rebuild_base(self) -> None:
        """A fresh base algorithm for the current workers (gossip graph, transport, push-sum
        weight); messages of the previous one still in flight are dropped."""
        comm = self.base.comm
        self.base = BASES[self.base_name](comm, **self._base_options)
        self.base.attach(self._params)

    @torch.no_grad()
    def _adopt_world(self, why: str) -> None:
        """Continue with the current workers: rebuild the base and restart the outer step from
        the anchor, identical on every worker (the base steps since the anchor are dropped).

        Without an anchor (``slow_lr=1, slow_momentum=0`` and ``nonfinite != "skip"``) there is no
        common point: the outer step continues from the parameters as they are.
        """
        if self.sharded is not None and self._world[1] != self.comm.size:
            raise RuntimeError(f"hvd_slowmo: {why}: the workers changed from {self._world[1]} to {self.comm.size}, "
                               "but shard_slow_state=True splits the anchor and slow buffer by the number of "
                               "workers and cannot reshard them; use shard_slow_state=False for elastic training")
        old, self._world = self._world, (self.comm.rank, self.comm.size)
        self._rebuild_base()
        dropped = 0
        if self.anchor is not None and self.inner_step > 0:
            dropped = self.inner_step
            torch._foreach_copy_([p.detach() for p in self._params], self.anchor)
            if self.buffers == "reset":
                reset_buffers(self.optimizer.state, self._params)
            self.num_steps -= dropped
            self.inner_step = 0
        if self.comm.rank == 0 and (old != self._world or dropped):
            change = f"{old[1]} -> {self.comm.size} workers, " if old[1] != self.comm.size else ""
            what = (f"outer step {self.outer_steps} restarts from its anchor ({dropped} base steps dropped, "
                    f"num_steps back to {self.num_steps})" if dropped else
                    f"continuing at step {self.num_steps} (inner step {self.inner_step})")
            log.warning("hvd_slowmo: %s (%sbase %r rebuilt for %d workers): %s. The learning rate is yours: "
                        "rescale it in a reset callback if it depends on the number of workers",
                        why, change, self.base_name, self.comm.size, what)

    # --- checks ---------------------------------------------------------------------------
    @staticmethod
    def _check_names(params: List[Tensor], named_parameters: Optional[Iterable[Tuple[str, Tensor]]]) -> List[str]:
        if named_parameters is None:
            return [f"param{i}" for i in range(len(params))]
        try:
            named = list(named_parameters)
            by_id = {}
            for name, p in named:
                if not isinstance(name, str) or not isinstance(p, Tensor):
                    raise TypeError
                by_id.setdefault(id(p), name)
        except (TypeError, ValueError):
            raise TypeError("named_parameters must be an iterable of (name, tensor) pairs, "
                            "as returned by model.named_parameters()") from None
        missing = [i for i, p in enumerate(params) if id(p) not in by_id]
        if missing:
            raise ValueError(f"named_parameters lacks {len(missing)} of the optimizer's parameters "
                             f"(indices {missing[:5]}{'...' if len(missing) > 5 else ''}); pass "
                             "named_parameters=model.named_parameters() for the model the optimizer trains")
        return [by_id[id(p)] for p in params]

    def _config(self) -> Dict[str, Any]:
        return {
            "base": self.base_name, "tau": self.tau, "slow_lr": self.slow_lr, "slow_momentum": self.slow_momentum,
            "buffers": self.buffers, "average": self.average, "num_model_buffers": len(self.model_buffers),
            "nonfinite": self.nonfinite, "shard_slow_state": self.sharded is not None,
            "worker": "process" if self.node_comm is None else f"node({self.node_comm.size} ranks)",
            "outer_optimizer": "custom" if self.outer_optimizer_factory else ("nesterov" if self.nesterov else "heavyball"),
        }

    def _check_same_everywhere(self) -> None:
        mine = {**self._config(),
                "params": [(n, tuple(p.shape), str(p.dtype)) for n, p in zip(self.param_names, self._params)]}
        everyone = self.comm.allgather_object(mine)
        problems = []
        for rank, theirs in enumerate(everyone):
            if theirs == everyone[0]:
                continue
            diffs = [f"{k}={theirs.get(k)!r} (rank 0: {everyone[0].get(k)!r})"
                     for k in sorted(set(theirs) | set(everyone[0])) if k != "params" and theirs.get(k) != everyone[0].get(k)]
            if theirs["params"] != everyone[0]["params"]:
                pairs = list(zip(theirs["params"], everyone[0]["params"]))
                first = next((f"{a} vs rank 0 {b}" for a, b in pairs if a != b),
                             f"{len(theirs['params'])} parameters vs rank 0's {len(everyone[0]['params'])}")
                diffs.append(f"parameters differ: {first}")
            problems.append(f"rank {rank}: " + "; ".join(diffs))
        if problems:
            raise ValueError("hvd_slowmo.DistributedOptimizer is configured differently across ranks: "
                             + " | ".join(problems) + ". Build the same model and optimizer on every rank.")

    # --- checkpoints ----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """Everything needed to continue exactly, keyed by parameter index (not tensor identity).

        Contains the base optimizer's ``state_dict``, the anchor and slow buffer, the step
        counters (position inside the outer step), and the base algorithm's own state.
        Tensors are references, as in torch's own ``state_dict``; ``torch.save`` copies them.
        Hooks registered with ``register_state_dict_pre_hook``/``_post_hook`` run as in torch.
        """
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state = {
            "format": STATE_FORMAT,
            "base_optimizer": self.optimizer.state_dict(),
            "slowmo": {
                "config": self._config(),
                "num_params": len(self._params),
                "inner_step": self.inner_step,
                "num_steps": self.num_steps,
                "world_size": self.comm.size,  # a state from another world size restarts its outer step
                "outer_steps": self.outer_steps,
                "anchor": None if self.anchor is None else dict(enumerate(self.anchor)),
                "slow_buffer": None if self.slow_buffer is None else dict(enumerate(self.slow_buffer)),
                "base_algorithm": self.base.state_dict(),
                "outer_optimizer": None if self.outer_optimizer is None else self.outer_optimizer.state_dict(),
                "sharded": None if self.sharded is None else self.sharded.state_dict(),
            },
        }
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            returned = post_hook(self, state)
            state = state if returned is None else returned
        return state

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        """Restore :meth:`state_dict` output; on any error the optimizer is left unchanged.

        Hooks registered with ``register_load_state_dict_pre_hook``/``_post_hook`` run as in torch.

        Args:
            state_dict: from :meth:`state_dict` (any rank's, or rank 0's broadcast).

        Raises:
            ValueError: a state from another format version, model, or configuration.
        """
        state_dict = dict(state_dict) if isinstance(state_dict, dict) else state_dict  # shallow, as torch
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre_hook(self, state_dict)
            state_dict = state_dict if returned is None else returned
        self._load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _load_state_dict(self, state_dict: Dict[str, Any]) -> None:
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
        if self.sharded is None and s.get("sharded") is not None:
            raise ValueError("load_state_dict: the state holds one rank's shard (saved with shard_slow_state=True); "
                             "load it into an optimizer built with shard_slow_state=True, in a job of the same size")
        sharded = None if self.sharded is None else self.sharded.prepare_load(s.get("sharded"), self.param_groups, inner)
        new_tensors: Dict[str, Optional[List[Tensor]]] = {}
        for key in ("anchor", "slow_buffer"):
            saved = s.get(key)
            if saved is None:
                new_tensors[key] = None
                continue
            if set(saved) != set(range(len(self._params))):
                raise ValueError(f"load_state_dict: '{key}' does not cover parameters 0..{len(self._params) - 1}")
            for i, p in enumerate(self._params):
                if tuple(saved[i].shape) != tuple(p.shape):
                    raise ValueError(f"load_state_dict: '{key}' of parameter {self.param_names[i]!r} has shape "
                                     f"{tuple(saved[i].shape)}, the parameter {tuple(p.shape)}: another model")
            new_tensors[key] = [saved[i].detach().to(p.device, p.dtype).clone() for i, p in enumerate(self._params)]
        if self._keeps_anchor and inner > 0 and new_tensors["anchor"] is None and self.sharded is None:
            raise ValueError("load_state_dict: the state has no anchor but was saved inside an outer step; "
                             "it was saved with the slow update disabled (slow_lr=1, slow_momentum=0)")
        if (self.slow_enabled and self.outer_optimizer_factory is None and new_tensors["anchor"] is not None
                and new_tensors["slow_buffer"] is None):
            raise ValueError("load_state_dict: the state has an anchor but no slow buffer; it was saved with "
                             "the slow update disabled (slow_lr=1, slow_momentum=0)")
        outer = None
        if self.outer_optimizer_factory is not None and new_tensors["anchor"] is not None:
            if s.get("outer_optimizer") is None:
                raise ValueError("load_state_dict: this optimizer has a custom outer_optimizer but the state has no "
                                 "outer optimizer state; it was saved with outer_optimizer='heavyball'/'nesterov'")
            outer = self._build_outer_optimizer(new_tensors["anchor"])
            outer.load_state_dict(s["outer_optimizer"])  # into a new object: raises before anything changes
        self.base.check_state_dict(s.get("base_algorithm", {}))
        saved_size = s.get("world_size")  # absent in states written before it was recorded
        if (saved_size is not None and saved_size != self.comm.size and inner > 0
                and new_tensors["anchor"] is None):
            raise ValueError(f"load_state_dict: the state was saved by {saved_size} workers inside an outer "
                             f"step (inner_step {inner}) without an anchor, and this job has {self.comm.size}: "
                             "only the anchor is common to all workers. Save at an outer-step boundary "
                             "(when opt.inner_step == 0), or load with the same number of workers")
        # All checks passed; the wrapped optimizer's own load checks group sizes before it mutates.
        self.optimizer.load_state_dict(state_dict["base_optimizer"])
        self.inner_step = inner
        self.num_steps = int(s["num_steps"])
        self.outer_steps = int(s["outer_steps"])
        if self._keeps_anchor:
            self.anchor = new_tensors["anchor"]
            self.slow_buffer = new_tensors["slow_buffer"] if self.outer_optimizer_factory is None else None
            self.outer_optimizer = outer
        if self.sharded is not None:
            self.sharded.commit_load(sharded)
        self.base.load_state_dict(s.get("base_algorithm", {}))
        if saved_size is not None and saved_size != self.comm.size:
            # Inside an outer step each worker's parameters and base state are its own: with
            # another number of workers only the anchor is common, so restart from it.
            self._adopt_world(f"a state saved by {saved_size} workers was loaded by {self.comm.size}")


def broadcast_optimizer_state(optimizer: DistributedOptimizer, root_rank: int = 0) -> None:
    """Give every rank ``root_rank``'s full optimizer state (base state, anchor, slow buffer,
    counters), e.g. after rank 0 alone loaded a checkpoint. Collective.

    Args:
        optimizer: the optimizer on this rank.
        root_rank: the rank whose state is sent.
    """
    if not isinstance(optimizer, DistributedOptimizer):
        raise TypeError("broadcast_optimizer_state expects a hvd_slowmo.DistributedOptimizer; "
                        "use hvd.broadcast_optimizer_state for plain optimizers")
    if optimizer.sharded is not None:
        raise ValueError("broadcast_optimizer_state: with shard_slow_state=True each rank holds its own shard of "
                         "the slow state; have every rank load the state it saved instead")
    state = optimizer.comm.broadcast_object(optimizer.state_dict() if optimizer.comm.rank == root_rank else None,
                                            root_rank=root_rank)
    optimizer.load_state_dict(state)
