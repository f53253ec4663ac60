"""The optimizer's configuration: one frozen dataclass, validated in one place.

Every setting of :class:`hvd_slowmo.DistributedOptimizer` that decides the algorithm (SlowMo,
arXiv 1910.00643, Algorithm 1) is checked here, before any state exists: a wrong type raises
``TypeError``, a wrong value ``ValueError``, each naming the argument and the fix. The
configuration is compared across ranks at construction (:func:`check_same_everywhere`), saved in
the optimizer's state and compared with the running one on load (:func:`saved_config_changes`).
"""

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from .bases import BASES, resolve_base
from .buffers import BUFFER_STRATEGIES
from .comm.base import Communicator
from .compression.codecs import check_codec
from .compression.sparse import SparseCodec
from .merge import MERGES
from .period import parse_seconds
from .straggler import Quorum
from .validation import check_bool, check_choice, check_int, check_number

__all__ = [
    "EAGER_ESTIMATES",
    "resolve_codec",
    "upgrade_saved_config",
    "NONFINITE",
    "OUTER_OPTIMIZERS",
    "SlowMoConfig",
    "check_same_everywhere",
    "param_names",
    "saved_config_changes",
]

#: What an outer step does with non-finite parameters (``nonfinite=``).
NONFINITE = ("raise", "skip", "ignore")
#: The built-in slow updates (``outer_optimizer=``); a callable is the third kind.
OUTER_OPTIMIZERS = ("heavyball", "nesterov")
#: The estimates of eager updates (``eager=``); None turns them off.
EAGER_ESTIMATES = ("shares", "local")
#: The old spellings of ``eager`` (before ``"shares"`` was its name), still accepted with a
#: DeprecationWarning.
_OLD_EAGER = {True: "shares", False: None}
#: The paper's defaults (Section 5): alpha = 1, beta = 0.5.
DEFAULT_SLOW_LR, DEFAULT_SLOW_MOMENTUM = 1.0, 0.5

OuterFactory = Callable[[list[Tensor]], torch.optim.Optimizer]


@dataclass(frozen=True)
class SlowMoConfig:
    """SlowMo's settings (arXiv 1910.00643, Algorithm 1), checked on construction: the
    arguments of :class:`hvd_slowmo.DistributedOptimizer` that decide the algorithm. ``base`` is
    stored as the base algorithm's class, ``slow_lr`` and ``slow_momentum`` with the paper's
    defaults filled in.

    Args:
        base: the base algorithm: a name from :data:`hvd_slowmo.bases.BASES` (``"localsgd"``,
            ``"allreduce"``, ``"sgp"``, ``"osgp"``, ``"dpsgd"``) or a
            :class:`~hvd_slowmo.bases.base.BaseAlgorithm` subclass (its protocol is documented
            there).
        base_options: the base algorithm's own keyword options (its ``OPTIONS``: the gossip
            bases' ``topology``, ``peers_per_step``, ``gossip_transport``, ``gossip_timeout``,
            and OSGP's ``staleness``).
        tau: base steps per outer step (>= 1).
        slow_lr: ``alpha`` (> 0); 1.0, the paper's default (None is taken for it too).
        slow_momentum: ``beta`` in ``[0, 1)``; 0.5, the paper's default (None is taken for it
            too).
        buffers: the base optimizer's state at each outer step: ``"reset"``, ``"maintain"``
            or ``"average"``.
        average: False skips the exact average (SGP-SlowMo-noaverage): the slow update then
            acts on each worker's own parameters.
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
            With ``fragments > 1`` each landing steps its own fragment's anchor tensors alone
            (the others hold no gradient, and torch optimizers skip those), so the optimizer must
            keep its state per tensor (SGD, Adam, ...); not with ``eager``.
        shard_slow_state: keep only this rank's ~1/m shard of the anchor and slow state (ZeRO-1
            style, :mod:`hvd_slowmo.slow_state.sharded`): the exact average becomes a
            reduce-scatter, the slow update runs on the shard and an all-gather returns the new
            anchor (same bytes on the wire). Each rank saves and loads its own shard, in a job of
            the same size. Works with ``fragments`` (buckets cut by fragment); not with eager
            updates nor a codec (declared in ``ShardedSlowState.unsupported``, with the reasons).
        overlap: ``d``, the base steps the exact average stays in flight (``0 <= d < tau``): at
            each outer-step boundary the average of a snapshot starts in the background, the
            workers take ``d`` more base steps, then the slow step is applied and each worker
            keeps its progress since the snapshot (:mod:`hvd_slowmo.outer_step`). 0 (default) is
            the paper's algorithm, bit for bit.
        codec: the outer exchange's pseudo-gradient codec: compress the exact average
            (:mod:`hvd_slowmo.compression`): every worker sends
            its pseudo-gradient ``anchor - parameters`` as ``"fp16"``, ``"bf16"``, ``"int8"`` or
            ``"fp8"`` codes (``"fp32"``: uncompressed, through the same all-to-all), the sums
            are float32, and every worker ends with the same parameters. Keeps an anchor even
            without slow momentum. With ``fragments``, each fragment's average is compressed
            on its own. ``"sparse"`` or a :class:`~hvd_slowmo.compression.sparse.SparseCodec`:
            chunked top-k at 2-8 bits, averaged by an all-gather (docs/sparse.md; ``"sparse"``
            is stored as ``SparseCodec()``). None: the exact average is an allreduce of the
            parameters.
        error_feedback: each worker adds what its codes lost to its next pseudo-gradient
            (needs a ``codec``); the residual is per element, so with ``fragments`` each
            fragment's residual carries into that fragment's next average.
        hierarchical: the exact average in two levels (:mod:`hvd_slowmo.exchange.hierarchical`):
            exact inside each node, and across nodes each rank averages only its ``1/G`` shard
            of the model (with ``codec``: through the codec, its residual over the shard), then
            an all-gather inside the node. For codecs at many ranks: a sparse all-gather
            receives ``G^2`` times fewer bytes. Needs a base that averages exactly, ``fragments=1``
            and no ``merge`` nor ``period_seconds``; not with ``shard_slow_state``.
        fragments: ``P``, streaming SlowMo (arXiv 2501.18512): the parameters are split by
            layer, strided, into ``P`` fragments, each with its own outer step at its own inner
            step of the tau period (:mod:`hvd_slowmo.fragments`), ``1 <= P <= tau`` and at most
            the model's number of layers; with ``overlap``, ``d <= tau // P`` (one fragment in
            flight at a time). 1 (default) is the whole model at once.
        fragment_modules: each fragment's module names (``DistributedOptimizer(fragments=[[...],
            ...])``, as torchtitan's ``module_fqns_per_model_fragment``), or None for the strided
            split; ``fragments`` is then their number.
        eager: eager updates (arXiv 2502.12996) of the overlapped outer step: while the average
            is in flight every worker continues from a provisional slow step taken with an
            estimate of the average outer gradient; the exact step replaces it at the landing.
            ``"shares"``: the paper's estimate, the worker's own fresh share plus the other
            workers' shares of the previous outer step (one more copy of the parameters);
            ``"local"``: the worker's own fresh outer gradient alone (no copy). None: off.
            Needs ``overlap >= 1``. The old spellings True (``"shares"``) and False (None) are
            accepted with a ``DeprecationWarning`` and stored as the new ones.
        mix: the mixing factor of Streaming DiLoCo (arXiv 2501.18512), in ``[0, 1)``: at an
            overlapped outer step's landing each worker's parameters become ``mix x_i + (1 -
            mix) (x0 + (x_i - s_i))``, i.e. they keep the progress since the boundary snapshot
            ``s_i`` and a fraction ``mix`` of the worker's own difference ``s_i - x0`` from the
            new anchor (:func:`hvd_slowmo.slowmo.land_`); the anchor and slow buffer are not
            touched (identical on every worker). Needs ``overlap >= 1``. 0 (default): the
            landing without mixing, bit for bit.
        merge: the exact average: ``"mean"`` (default, the paper's) or ``"samples"``, weighted
            by the samples each worker reported since the outer step's start (``step(samples=n)``;
            one per base step by default), carried in the same collective
            (:mod:`hvd_slowmo.merge`; docs/unequal-workers.md). Needs a base that does not
            communicate every step; not with eager updates, a codec or ``shard_slow_state``.
        period_seconds: time-based outer periods: ``T`` seconds (a number, or ``"30s"``,
            ``"500ms"``, ``"2min"``): after a first period of ``tau`` steps, each worker takes
            the base steps that fit in ``T`` at its measured speed, planned at each outer step
            from the step times carried in its collective (:mod:`hvd_slowmo.period`). Stored in
            seconds. Needs a base that does not communicate every step, ``fragments=1`` and
            ``overlap=0``, no codec nor ``shard_slow_state``. None (default): ``tau`` steps.
        straggler: ``Quorum(min_workers=k, grace=...)`` (:mod:`hvd_slowmo.straggler`): the outer
            step closes once ``k`` workers arrived and the grace passed; late workers are
            resynchronized from the new anchor (:mod:`hvd_slowmo.exchange.quorum`;
            docs/unequal-workers.md). Needs ``base="localsgd"``, point-to-point messages
            (torch.distributed or thread workers), ``overlap=0``, ``fragments=1``, no codec,
            ``merge``, eager updates, ``shard_slow_state``, custom outer optimizer,
            ``buffers="average"`` nor ``nonfinite="skip"``; with ``period_seconds`` rank 0 plans
            every worker's steps from the members' step times. None (default): every outer step
            waits for every worker.
    """

    base: Any = "localsgd"
    base_options: Mapping[str, Any] = field(default_factory=dict)
    tau: int = 12
    slow_lr: float = DEFAULT_SLOW_LR
    slow_momentum: float = DEFAULT_SLOW_MOMENTUM
    buffers: str = "reset"
    average: bool = True
    nonfinite: str = "raise"
    outer_optimizer: str | OuterFactory = "heavyball"
    shard_slow_state: bool = False
    overlap: int = 0
    codec: str | SparseCodec | None = None
    error_feedback: bool = False
    hierarchical: bool = False
    fragments: int = 1
    fragment_modules: tuple[tuple[str, ...], ...] | None = None
    eager: str | None = None
    mix: float = 0.0
    merge: str = "mean"
    period_seconds: float | str | None = None
    straggler: Quorum | None = None

    def __post_init__(self) -> None:
        base = resolve_base(self.base)
        self._put("base", base)
        extra = sorted(set(self.base_options) - set(base.OPTIONS))
        if extra:
            raise TypeError(
                f"unknown argument(s) {extra} for DistributedOptimizer with "
                f"base={base.display_name()!r} (its options: {list(base.OPTIONS) or 'none'})"
            )
        self._put("base_options", dict(self.base_options))
        self._check_slow()
        self._check_overlap()
        self._check_streaming(base)
        self._check_average(base)
        self._check_codec(base)
        self._check_unequal(base)
        self._check_straggler(base)
        if not base.needs_exact_average and self.buffers == "average":
            warnings.warn(
                f"buffers='average' with base={base.display_name()!r} averages buffers that "
                "are already identical on every worker; use buffers='maintain'",
                stacklevel=4,
            )

    def _put(self, name: str, value: Any) -> None:
        object.__setattr__(self, name, value)  # frozen: normalized values are set once, here

    def _check_slow(self) -> None:
        """tau, the outer optimizer, slow_lr and slow_momentum (normalized)."""
        check_int("tau", self.tau, 1, "the base steps per outer step, e.g. tau=12")
        given: tuple[Any, Any] = (self.slow_lr, self.slow_momentum)  # None: the default
        if given[0] is None:
            self._put("slow_lr", DEFAULT_SLOW_LR)
        if given[1] is None:
            self._put("slow_momentum", DEFAULT_SLOW_MOMENTUM)
        custom = callable(self.outer_optimizer)
        if not custom:
            check_choice(
                "outer_optimizer",
                self.outer_optimizer,
                OUTER_OPTIMIZERS,
                "or a callable building a torch optimizer from a list of tensors",
            )
        elif (self.slow_lr, self.slow_momentum) != (DEFAULT_SLOW_LR, DEFAULT_SLOW_MOMENTUM):
            # Set on purpose (a custom outer optimizer has its own lr and momentum).
            warnings.warn(
                "slow_lr and slow_momentum are not used with a custom outer_optimizer: set "
                "the outer optimizer's own lr and momentum instead",
                stacklevel=5,
            )
        self._put(
            "slow_lr",
            check_number(
                "slow_lr",
                self.slow_lr,
                low=0.0,
                low_open=True,
                fix=f"slow_lr={DEFAULT_SLOW_LR} is the paper's default",
            ),
        )
        self._put(
            "slow_momentum",
            check_number(
                "slow_momentum",
                self.slow_momentum,
                low=0.0,
                high=1.0,
                high_open=True,
                fix="the paper tunes it in [0.4, 0.8]; 0 disables slow momentum",
            ),
        )

    def _check_overlap(self) -> None:
        """The delay of the outer step (overlap), fragments and eager."""
        check_int("overlap", self.overlap, 0, "base steps the exact average stays in flight")
        if self.overlap >= self.tau:
            raise ValueError(
                f"overlap must be smaller than tau={self.tau} (the average must land before the "
                f"next outer step starts), got overlap={self.overlap}; e.g. overlap=1"
            )
        check_int("fragments", self.fragments, 1, "fragments=1 is the whole model at once")
        if self.fragments > self.tau:
            raise ValueError(
                f"fragments must be at most tau={self.tau} (each fragment's outer step starts at "
                f"its own inner step of the period), got fragments={self.fragments}"
            )
        if self.fragments > 1 and self.overlap > self.tau // self.fragments:
            raise ValueError(
                f"overlap={self.overlap} with fragments={self.fragments}, tau={self.tau}: a "
                f"fragment's average must land by the next fragment's boundary (overlap <= "
                f"tau // fragments = {self.tau // self.fragments}), so one fragment is in flight "
                "at a time; lower overlap or fragments"
            )
        if isinstance(self.eager, bool):
            new = _OLD_EAGER[self.eager]
            warnings.warn(
                f"eager={self.eager!r} is deprecated: pass eager={new!r}",
                DeprecationWarning,
                stacklevel=5,
            )
            self._put("eager", new)
        if not (self.eager is None or self.eager in EAGER_ESTIMATES):
            raise (ValueError if isinstance(self.eager, str) else TypeError)(
                f"eager must be None, 'shares' (the paper's estimate: own share plus the "
                f"others' previous shares) or 'local' (own outer gradient), got "
                f"eager={self.eager!r}"
            )
        if self.eager and not self.overlap:
            raise ValueError(
                f"eager={self.eager!r} needs overlap >= 1 (it acts while the average is in "
                f"flight); e.g. overlap=1, eager={self.eager!r}"
            )
        self._put(
            "mix",
            check_number(
                "mix",
                self.mix,
                low=0.0,
                high=1.0,
                high_open=True,
                fix="mix=0 lands without mixing; Streaming DiLoCo's mixing factor, e.g. 0.5",
            ),
        )
        if self.mix and not self.overlap:
            raise ValueError(
                f"mix={self.mix!r} needs overlap >= 1 (it mixes the worker's progress made "
                f"while the average was in flight); e.g. overlap=1, mix={self.mix!r}, or mix=0"
            )

    def _check_average(self, base: Any) -> None:
        """Buffers, the exact average, the non-finite policy and the sharded slow state."""
        check_choice("buffers", self.buffers, BUFFER_STRATEGIES)
        check_bool("average", self.average)
        check_choice("nonfinite", self.nonfinite, NONFINITE)
        check_bool("shard_slow_state", self.shard_slow_state)
        if self.shard_slow_state and not self.slow_enabled:
            raise ValueError(
                "shard_slow_state=True with the slow update disabled (slow_lr=1, "
                "slow_momentum=0): there is no slow state to shard; drop shard_slow_state"
            )
        if self.shard_slow_state and not self.average:
            raise ValueError(
                "shard_slow_state=True needs the exact average (its reduce-scatter is "
                "the average); use average=True or shard_slow_state=False"
            )
        if not self.average and not base.communicates_every_step:
            talkers = ", ".join(n for n, c in BASES.items() if c.communicates_every_step)
            raise ValueError(
                f"average=False with base={base.display_name()!r} would never "
                "synchronize workers; use average=False only with a base that "
                f"communicates every step ({talkers})"
            )

    def _check_codec(self, base: Any) -> None:
        """The compressed average and its error feedback."""
        if self.codec is not None:
            self._put("codec", check_codec(self.codec))
        check_bool("error_feedback", self.error_feedback)
        if isinstance(self.codec, SparseCodec) and not self.error_feedback:
            warnings.warn(
                f"codec={self.codec!r} without error_feedback drops for good the "
                f"{1 - self.codec.density:.0%} of each pseudo-gradient it does not send; pass "
                "error_feedback=True",
                stacklevel=5,
            )
        check_bool("hierarchical", self.hierarchical)
        if self.hierarchical and not (self.average and base.needs_exact_average):
            raise ValueError(
                f"hierarchical=True has nothing to exchange: base={base.display_name()!r} with "
                f"average={self.average} takes no exact average; drop hierarchical"
            )
        if self.error_feedback and self.codec is None:
            raise ValueError(
                "error_feedback=True needs a compressed average; pass e.g. codec='int8'"
            )
        if self.codec is not None and not (self.average and base.needs_exact_average):
            warnings.warn(
                f"codec={self.codec!r} has nothing to compress: base="
                f"{base.display_name()!r} with average={self.average} runs no exact average; "
                "drop codec",
                stacklevel=5,
            )

    def _check_streaming(self, base: Any) -> None:
        """Refuse the combinations of ``fragments > 1`` or ``eager`` that no layout or exchange
        can run: they depend on the base algorithm (one push-sum weight per worker), the outer
        optimizer (a torch optimizer steps all its tensors at once, and cannot step
        provisionally) and the skip policy (a skip restarts the whole model). What a layout or
        an exchange cannot run is declared there (``unsupported``) and checked when it is built."""
        what = " and ".join(
            w
            for w, on in (
                ("fragments > 1", self.fragments > 1),
                (f"eager={self.eager!r}", self.eager is not None),
            )
            if on
        )
        if not what:
            return
        if base.communicates_every_step and base.needs_exact_average:
            raise ValueError(
                f"{what} with base={base.display_name()!r}: a gossip base's push-sum weight is one "
                "per worker and returns to 1 only when the whole model is averaged at once; use "
                "base='localsgd' or 'allreduce', or fragments=1 and eager=None"
            )
        if callable(self.outer_optimizer) and self.eager is not None:
            # With fragments a landing gives gradients to its own fragment's anchor tensors only,
            # and a torch optimizer skips tensors without one: a per-fragment step. A provisional
            # step would have to be taken back, which no torch optimizer can do.
            raise ValueError(
                f"eager={self.eager!r} with a custom outer_optimizer is not supported (a torch "
                "optimizer cannot step provisionally and take the step back); use "
                "outer_optimizer='heavyball' or 'nesterov', or eager=None"
            )
        if self.fragments > 1 and self.nonfinite == "skip":
            raise ValueError(
                "fragments > 1 with nonfinite='skip' is not supported (a skip restarts every "
                "fragment from its anchor); use nonfinite='raise' or 'ignore'"
            )

    def _check_unequal(self, base: Any) -> None:
        """The weighted merge and time-based periods: what they cannot run with that belongs to
        no layout or exchange (the base algorithm, fragments, overlap, eager updates)."""
        check_choice("merge", self.merge, MERGES, "merge='samples' weights by the work done")
        if self.period_seconds is not None:
            self._put("period_seconds", parse_seconds(self.period_seconds))
        asked = [
            s
            for s, on in (
                (f"merge={self.merge!r}", self.merge != "mean"),
                (f"period_seconds={self.period_seconds!r}", self.period_seconds is not None),
            )
            if on
        ]
        if not asked:
            return
        what = " and ".join(asked)
        if base.communicates_every_step:
            raise ValueError(
                f"{what} with base={base.display_name()!r}: a base that communicates every step "
                "needs the same number of steps on every worker and keeps them in step (AR-SGD "
                "keeps them identical); use base='localsgd'"
            )
        if self.merge == "samples" and self.eager is not None:
            raise ValueError(
                f"merge='samples' with eager={self.eager!r} is not supported: the eager estimate "
                "gives every worker an equal share 1/m of the outer gradient; use eager=None"
            )
        if self.period_seconds is None:
            return
        needs_equal = [
            s
            for s, on in (
                (f"fragments={self.fragments}", self.fragments > 1),
                (f"overlap={self.overlap}", self.overlap > 0),
            )
            if on
        ]
        if needs_equal:
            raise ValueError(
                f"period_seconds={self.period_seconds!r} with {' and '.join(needs_equal)} is not "
                "supported: the fragments' boundaries and the landing of an overlapped outer "
                "step are placed by step counts within a period of tau steps; use fragments=1 "
                "and overlap=0 with time-based periods"
            )

    def _check_straggler(self, base: Any) -> None:
        """The straggler quorum: what it cannot run with that no exchange declares (the base,
        the overlap, the buffers, the skip policy, the outer optimizer)."""
        if self.straggler is None:
            return
        if not isinstance(self.straggler, Quorum):
            raise TypeError(
                f"straggler must be None or hvd_slowmo.Quorum(...), got {self.straggler!r}; "
                "e.g. straggler=Quorum(min_workers=3)"
            )
        what = f"straggler={self.straggler!r}"
        refused = [
            (base.communicates_every_step or not base.needs_exact_average,
             f"base={base.display_name()!r} (it communicates every step: use base='localsgd')"),
            (not self.average, "average=False (there is no exact average to close early)"),
            (self.overlap > 0, f"overlap={self.overlap} (use overlap=0)"),
            (self.buffers == "average",
             "buffers='average' (an average over every worker; use 'reset' or 'maintain')"),
            (self.nonfinite == "skip",
             "nonfinite='skip' (under a quorum a non-finite worker is left out and "
             "resynchronized; use nonfinite='raise')"),
            (self.shard_slow_state, "shard_slow_state=True (a late worker needs the whole slow "
             "state; use shard_slow_state=False)"),
            (self.custom_outer, "a custom outer_optimizer (its state is not resynchronized; use "
             "'heavyball' or 'nesterov')"),
        ]  # fmt: skip
        for on, why in refused:
            if on:
                raise ValueError(f"{what} is not supported with {why}")

    # --- what the settings imply -------------------------------------------------------------
    @property
    def estimate(self) -> str | None:
        """The eager estimate, normalised: None (off), ``"shares"`` (the paper's: own fresh
        share plus the others' previous shares) or ``"local"`` (own outer gradient alone)."""
        return self.eager  # the old spellings True/False were normalised at construction

    def features(self) -> dict[str, str]:
        """The features a layout or an exchange may not support, that these settings use, each
        with the setting that asks for it (for the refusal's message)."""
        asked = {
            "fragments": f"fragments={self.fragments}" if self.fragments > 1 else "",
            "eager": f"eager={self.eager!r}" if self.estimate else "",
            "codec": f"compression={self.codec!r}" if self.codec is not None else "",
            "hierarchy": "hierarchical=True" if self.hierarchical else "",
            "merge": f"merge={self.merge!r}" if self.merge != "mean" else "",
            "period": f"period_seconds={self.period_seconds!r}"
            if self.period_seconds is not None
            else "",
            "straggler": f"straggler={self.straggler!r}" if self.straggler is not None else "",
        }
        return {feature: setting for feature, setting in asked.items() if setting}

    @property
    def timed(self) -> bool:
        """Time-based periods: the workers take different numbers of base steps."""
        return self.period_seconds is not None

    @property
    def tallied(self) -> bool:
        """A tally travels with the exact average (a weighted merge, or time-based periods)."""
        return self.merge != "mean" or self.timed

    @property
    def base_name(self) -> str:
        """The base algorithm's name (its registry name, or its class name)."""
        return self.base.display_name()

    @property
    def custom_outer(self) -> bool:
        """A user-built outer optimizer replaces the built-in slow update."""
        return callable(self.outer_optimizer)

    @property
    def nesterov(self) -> bool:
        """Nesterov slow momentum instead of the paper's heavy-ball."""
        return self.outer_optimizer == "nesterov"

    @property
    def slow_enabled(self) -> bool:
        """False for ``slow_lr=1, slow_momentum=0``: plain periodic averaging, no slow state."""
        return self.custom_outer or (self.slow_lr, self.slow_momentum) != (1.0, 0.0)

    @property
    def keeps_anchor(self) -> bool:
        """An anchor is kept: for the slow update, to restart a skipped outer step, or for the
        pseudo-gradients of a compressed average, or the provisional step of eager updates."""
        return (
            self.slow_enabled
            or self.nonfinite == "skip"
            or self.codec is not None
            or self.eager is not None
        )

    @property
    def exact_average(self) -> bool:
        """The outer step averages the parameters (a base like AR-SGD keeps them identical)."""
        return self.average and self.base.needs_exact_average

    def summary(self) -> dict[str, Any]:
        """The settings as plain values: saved in the state, compared across ranks and on load."""
        outer = "custom" if self.custom_outer else self.outer_optimizer
        return {
            "base": self.base_name,
            "tau": self.tau,
            "slow_lr": self.slow_lr,
            "slow_momentum": self.slow_momentum,
            "buffers": self.buffers,
            "average": self.average,
            "nonfinite": self.nonfinite,
            "shard_slow_state": self.shard_slow_state,
            "outer_optimizer": outer,
            "overlap": self.overlap,
            "codec": self.codec.summary() if isinstance(self.codec, SparseCodec) else self.codec,
            "error_feedback": self.error_feedback,
            "fragments": self.fragments,
            **({"fragment_modules": self.fragment_modules} if self.fragment_modules else {}),
            "eager": self.eager,
            "mix": self.mix,
            # Saved only when set: states and summaries of runs without them are unchanged.
            **({"merge": self.merge} if self.merge != "mean" else {}),
            **({"hierarchical": True} if self.hierarchical else {}),
            **({"period_seconds": self.period_seconds} if self.period_seconds is not None else {}),
            **({"straggler": repr(self.straggler)} if self.straggler is not None else {}),
        }


def resolve_codec(codec: Any, compression: Any) -> tuple[Any, Any]:
    """``(codec, compression)`` of ``DistributedOptimizer``, the old spelling upgraded: a codec
    name passed as ``compression`` (``compression="int8"``) is the codec, with a
    ``DeprecationWarning``; ``compression`` keeps only Horovod's meaning (the payload cast of the
    parameters' allreduce, ``hvd.Compression.none`` / ``.fp16``).

    Args:
        codec: the ``codec`` argument (checked later, by :class:`SlowMoConfig`).
        compression: the ``compression`` argument.

    Raises:
        ValueError: a codec name in both ``codec`` and ``compression``.
    """
    if not isinstance(compression, (str, SparseCodec)):
        return codec, compression
    if codec is not None:
        raise ValueError(
            f"codec={codec!r} and compression={compression!r} both name the outer exchange's "
            "codec; pass codec= alone (compression= is Horovod's hvd.Compression of the "
            "parameters' allreduce)"
        )
    warnings.warn(
        f"compression={compression!r} is deprecated for the outer exchange's codec: pass "
        f"codec={compression!r} (compression= now means only Horovod's hvd.Compression)",
        DeprecationWarning,
        stacklevel=3,
    )
    return compression, None


def upgrade_saved_config(saved: dict[str, Any]) -> dict[str, Any]:
    """A saved configuration in today's words: ``"compression"`` (a codec name) became
    ``"codec"``, ``eager`` True/False became ``"shares"``/None.

    Args:
        saved: the ``"config"`` entry of a saved state.
    """
    out = dict(saved)
    if "compression" in out and "codec" not in out:
        out["codec"] = out.pop("compression")
    if isinstance(out.get("eager"), bool):
        out["eager"] = _OLD_EAGER[out["eager"]]
    return out


def check_same_everywhere(comm: Communicator, mine: dict[str, Any]) -> None:
    """Raise on every rank if any rank's configuration differs from rank 0's. Collective.

    One allgather at construction, so a mismatch fails with a message instead of a hang later.

    Args:
        comm: the communicator over all ranks.
        mine: this rank's settings (:meth:`SlowMoConfig.summary` plus layout facts) and, under
            ``"params"``, each parameter's ``(name, shape, dtype)``.
    """
    everyone = comm.allgather_object(mine)
    first = everyone[0]
    problems = []
    for rank, theirs in enumerate(everyone):
        if theirs == first:
            continue
        diffs = [
            f"{k}={theirs.get(k)!r} (rank 0: {first.get(k)!r})"
            for k in sorted(set(theirs) | set(first))
            if k != "params" and theirs.get(k) != first.get(k)
        ]
        if theirs["params"] != first["params"]:
            pairs = list(zip(theirs["params"], first["params"]))
            what = next(
                (f"{a} vs rank 0 {b}" for a, b in pairs if a != b),
                f"{len(theirs['params'])} parameters vs rank 0's {len(first['params'])}",
            )
            diffs.append(f"parameters differ: {what}")
        problems.append(f"rank {rank}: " + "; ".join(diffs))
    if problems:
        raise ValueError(
            "hvd_slowmo.DistributedOptimizer is configured differently across ranks: "
            + " | ".join(problems)
            + ". Build the same model and optimizer on every rank."
        )


def saved_config_changes(saved: Any, running: dict[str, Any]) -> list[str]:
    """Compare a saved configuration with the running one: refuse a state whose slow state is
    laid out differently; list every other setting that changed (the caller warns).

    Args:
        saved: the ``"config"`` entry of a saved state (ignored if absent).
        running: this optimizer's settings, as it saves them.

    Raises:
        ValueError: another base algorithm, another sharding, another layout of islands, or a
            custom outer optimizer on one side only.
    """
    if not isinstance(saved, dict):
        return []
    saved = upgrade_saved_config(saved)

    def differs(key: str) -> bool:
        return key in saved and saved[key] != running.get(key)

    for key in ("base", "shard_slow_state"):
        if differs(key):
            raise ValueError(
                f"load_state_dict: the state was saved with {key}={saved[key]!r}, this "
                f"optimizer has {key}={running[key]!r}; build it with {key}={saved[key]!r} "
                "to resume, or load only the model's weights to start a new run"
            )
    islands = [str(c.get("worker", "")).startswith("islands(") for c in (saved, running)]
    if (islands[0] or islands[1]) and differs("worker"):
        # Each rank's outer state is its shard of the model under the saved layout: under
        # another number of islands or ranks per island the shards no longer line up, and
        # loading them would silently mix pieces of different parameters.
        raise ValueError(
            f"load_state_dict: the state was saved with worker={saved['worker']}, this "
            f"optimizer has worker={running.get('worker')}: an island's outer state is sharded "
            "like its model, so it loads only into the same layout. Resume with the saved "
            "layout, or load only the model's weights (torch.distributed.checkpoint reshards "
            "them) and start a new outer state"
        )
    custom = [c.get("outer_optimizer") == "custom" for c in (saved, running)]
    if "outer_optimizer" in saved and custom[0] != custom[1]:
        raise ValueError(
            f"load_state_dict: the state was saved with outer_optimizer="
            f"{saved['outer_optimizer']!r}, this optimizer has {running['outer_optimizer']!r}: "
            "a custom outer optimizer's state and a slow buffer are not interchangeable"
        )
    return [f"{k}: {saved[k]!r} -> {running[k]!r}" for k in running if differs(k)]


def param_names(params: list[Tensor], named_parameters: Any) -> list[str]:
    """The name of each of the optimizer's parameters, checked to be floating point.

    Args:
        params: the optimizer's parameters, in order.
        named_parameters: ``model.named_parameters()``, or None (names ``param0``, ``param1``, ...).

    Raises:
        TypeError: ``named_parameters`` is not (name, tensor) pairs; a parameter is not
            floating point.
        ValueError: a parameter has no name.
    """
    if named_parameters is None:
        names = [f"param{i}" for i in range(len(params))]
    else:
        try:
            by_id: dict[int, str] = {}
            for name, p in named_parameters:
                if not isinstance(name, str) or not isinstance(p, Tensor):
                    raise TypeError
                by_id.setdefault(id(p), name)
        except (TypeError, ValueError):
            raise TypeError(
                "named_parameters must be an iterable of (name, tensor) pairs, "
                "as returned by model.named_parameters()"
            ) from None
        missing = [i for i, p in enumerate(params) if id(p) not in by_id]
        if missing:
            more = "..." if len(missing) > 5 else ""
            raise ValueError(
                f"named_parameters lacks {len(missing)} of the optimizer's parameters "
                f"(indices {missing[:5]}{more}); pass named_parameters=model.named_parameters() "
                "for the model the optimizer trains"
            )
        names = [by_id[id(p)] for p in params]
    for p, n in zip(params, names):
        if not p.is_floating_point():
            raise TypeError(
                f"parameter {n!r} has dtype {p.dtype}; only floating-point parameters can "
                "be averaged: keep integer tensors out of the optimizer (as buffers)"
            )
    return names
