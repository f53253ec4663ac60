"""The slow state of SlowMo's outer step (arXiv 1910.00643, Algorithm 1, lines 6-8): the
interface, and the slow update written once for every layout.

The slow state is the anchor ``x_{t,0}`` and either the slow buffer ``u_t`` (heavy-ball or
Nesterov slow momentum) or a custom outer optimizer over the anchor. Each fragment
(:class:`hvd_slowmo.fragment.Fragment`) owns one slow state over its own parameters; the
whole model is the one-fragment case. A layout decides how the anchor is stored: one tensor
per parameter on every worker (:class:`~.full.FullSlowState`) or one shard per bucket of
parameters on each worker (:class:`~.sharded.ShardedSlowState`). The
slow update is per element, so it is the same arithmetic over either layout: this module holds
it, the layouts only say which tensors hold the anchor and how the exact average reaches them.

Its fragment drives a slow state in this order, and never asks which layout it has (``params``
are always the fragment's parameters, in the optimizer's order)::

    capture_(params, groups)          at every step until captured
    at the fragment's outer step:  (its exchange averages params: :mod:`hvd_slowmo.exchange`)
                      update_(params, param_groups)    the slow update; params <- new anchor
    anchor, slow_buffer               read by the eager estimate and the compressed exchange
    restore_(params)                  a skipped outer step (non-finite) or a change of workers
    add_(params, groups)              after add_param_group (one fragment)
    state_dict() / prepare_load(...) / commit_load(...)

Each layout owns the keys of its saved state (``state_dict()["layout"]`` names it), and
declares the features it cannot run with (:attr:`SlowState.unsupported`, with the reason).
"""

import abc
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from ..comm.base import Communicator
from ..config import SlowMoConfig
from ..slowmo import slow_momentum_step_
from ..timing import PhaseTimer

__all__ = ["LoadedSlowState", "SlowState"]

ParamGroups = Sequence[dict[str, Any]]


@dataclass
class LoadedSlowState:
    """A checked saved slow state, ready for :meth:`SlowState.commit_load`.

    Attributes:
        anchor: the anchor tensors (None: not captured when saved, or not kept).
        slow_buffer: the slow buffer (None with a custom outer optimizer or no slow update).
        outer_optimizer: the custom outer optimizer, with its state loaded.
        groups: the param group of each anchor tensor.
        layout: what else the layout needs (the sharded buckets).
    """

    anchor: list[Tensor] | None
    slow_buffer: list[Tensor] | None = None
    outer_optimizer: torch.optim.Optimizer | None = None
    groups: list[int] | None = None
    layout: Any = None


class SlowState(abc.ABC):
    """The anchor and slow buffer (or outer optimizer) of one fragment on one worker, and the
    slow update. Its methods act on everything it holds: the fragment's parameters.

    Args:
        comm: the communicator of the exact average.
        config: the optimizer's configuration (slow_lr, slow_momentum, outer optimizer, ...).
        timer: the optimizer's phase timer; a layout's collectives inside :meth:`update_` are
            booked to ``"average"``.

    Attributes:
        anchor: the anchor tensors (per parameter of the fragment, or this rank's shards); None
            until captured.
        slow_buffer: ``u``, one tensor per anchor tensor; None with a custom outer optimizer or
            without a slow update.
        outer_optimizer: the custom outer optimizer over this fragment's anchor tensors (one
            per fragment), or None.
        per_rank: each rank holds a different part of the state (it cannot be broadcast from
            one rank, nor loaded into a job of another size).
    """

    per_rank = False
    #: The name of this layout in its saved state.
    layout = ""
    #: The setting that selects this layout, and what to use instead (for refusals).
    setting, alternative = "", ""
    #: The features this layout cannot run with (``fragments``, ``eager``, ``codec``), each
    #: with the reason; checked at construction (:meth:`check_supported`).
    unsupported: ClassVar[dict[str, str]] = {}

    def __init__(self, comm: Communicator, config: SlowMoConfig, timer: PhaseTimer) -> None:
        self.comm = comm
        self.config = config
        self.timer = timer
        self.anchor: list[Tensor] | None = None
        self.slow_buffer: list[Tensor] | None = None
        self.outer_optimizer: torch.optim.Optimizer | None = None
        self._groups: list[int] = []  # the param group of each anchor tensor (its lr)
        self._zero_lr_warned = False

    @property
    def captured(self) -> bool:
        """Whether the anchor has been captured (or loaded)."""
        return self.anchor is not None

    # --- what a layout implements ----------------------------------------------------------
    @abc.abstractmethod
    def capture_(self, params: list[Tensor], groups: list[int]) -> None:
        """Take the anchor from the fragment's current parameters, once (called at every step
        until captured, after ``hvd.broadcast_parameters``, so every rank's anchor is of the
        same vector).

        Args:
            params: the fragment's parameters (local tensors, detached), in the optimizer's
                order.
            groups: the param group of each.
        """

    @abc.abstractmethod
    def add_(self, params: list[Tensor], groups: list[int]) -> None:
        """Extend a captured state with the parameters ``add_param_group`` added to the
        fragment (their anchor: their values).

        Args:
            params: the fragment's parameters (local tensors, detached), the new ones last.
            groups: the param group of each (the new ones': the new, last group).
        """

    @abc.abstractmethod
    def update_(self, params: list[Tensor], param_groups: ParamGroups) -> None:
        """The slow update after the exact average; ``params`` hold the new anchor on return.

        Args:
            params: the fragment's averaged parameters (detached), in the optimizer's order.
            param_groups: the optimizer's param groups (their ``lr`` at the outer step).
        """

    @classmethod
    def check_supported(cls, features: dict[str, str]) -> None:
        """Refuse, before any state exists, the features this layout declares unsupported.

        Args:
            features: the features a configuration asks for, each with the setting that asks
                (:meth:`hvd_slowmo.config.SlowMoConfig.features`).

        Raises:
            ValueError: the layout does not support one of them (the message says why).
        """
        for feature, asked in features.items():
            if feature in cls.unsupported:
                raise ValueError(
                    f"{asked} with {cls.setting} is not supported: {cls.unsupported[feature]}; "
                    f"use {cls.alternative}"
                )

    @abc.abstractmethod
    def restore_(self, params: list[Tensor]) -> None:
        """Overwrite ``params`` with the anchor (collective for a sharded layout).

        Args:
            params: the fragment's parameters (detached), in the optimizer's order.
        """

    @abc.abstractmethod
    def state_dict(self) -> dict[str, Any]:
        """This layout's saved state: ``{"layout": self.layout, ...its own keys}`` (the
        fragment's entry of the optimizer's ``state_dict()["slowmo"]["fragments"]``)."""

    @abc.abstractmethod
    def prepare_load(
        self,
        saved: dict[str, Any],
        params: list[Tensor],
        groups: list[int],
        position: dict[str, Any],
        names: list[str],
    ) -> LoadedSlowState:
        """Check a saved state against this rank and fragment; changes nothing, so the caller
        can still fail atomically.

        Args:
            saved: the ``"slow_state"`` entry of the fragment's saved entry.
            params: the fragment's parameters (local tensors, detached).
            groups: the param group of each.
            position: the saved step counters (``inner_step``, ``world_size``, ...).
            names: the fragment's parameters' names, for messages.

        Raises:
            ValueError: a state from another layout, world, model or configuration.
        """

    @abc.abstractmethod
    def check_world(self, old_world: tuple[int, int], why: str) -> None:
        """Raise if the state cannot follow a change of workers.

        Args:
            old_world: ``(rank, size)`` of this worker when the state was built or loaded.
            why: what changed the workers, for the message.
        """

    # --- shared by every layout ------------------------------------------------------------
    def commit_load(self, loaded: LoadedSlowState) -> None:
        """Install what :meth:`prepare_load` returned.

        Args:
            loaded: its return value.
        """
        self.anchor = loaded.anchor
        self.slow_buffer = loaded.slow_buffer
        self.outer_optimizer = loaded.outer_optimizer
        self._groups = list(loaded.groups or [])

    def state_tensors(self) -> list[Tensor]:
        """Every tensor of the slow state this rank keeps (anchor, slow buffer, and the custom
        outer optimizer's per-element state)."""
        out = list(self.anchor or []) + list(self.slow_buffer or [])
        if self.outer_optimizer is not None:
            for entry in self.outer_optimizer.state.values():
                out.extend(v for v in entry.values() if isinstance(v, Tensor))
        return out

    def _start(self, anchor: list[Tensor], groups: list[int]) -> None:
        """Adopt a freshly captured anchor and create the slow buffer or outer optimizer."""
        self.anchor, self._groups = anchor, list(groups)
        if self.config.custom_outer:
            self.outer_optimizer = self._build_outer(anchor)
        elif self.config.slow_enabled:
            self.slow_buffer = [torch.zeros_like(a) for a in anchor]

    def _extend(self, anchor: list[Tensor], group: int) -> None:
        """Append anchor tensors of a new param group (their slow buffer starts at zero)."""
        assert self.anchor is not None
        self.anchor.extend(anchor)
        self._groups.extend([group] * len(anchor))
        if self.outer_optimizer is not None:  # else the new tensors would never leave their anchor
            self.outer_optimizer.add_param_group({"params": anchor})
        if self.slow_buffer is not None:
            self.slow_buffer.extend(torch.zeros_like(a) for a in anchor)

    def _build_outer(self, anchor: list[Tensor]) -> torch.optim.Optimizer:
        build = self.config.outer_optimizer
        assert callable(build), "built only for a custom outer optimizer (config.custom_outer)"
        opt = build(anchor)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(
                f"outer_optimizer must return a torch.optim.Optimizer, got "
                f"{type(opt).__name__}; e.g. lambda ps: torch.optim.SGD(ps, lr=0.7)"
            )
        return opt

    @torch.no_grad()
    def _slow_update_(self, averages: list[Tensor], param_groups: ParamGroups) -> None:
        """The slow update of the anchor tensors from their exact averages (one per anchor
        tensor); on return the anchor and ``averages`` both hold the new anchor."""
        assert self.anchor is not None, "the anchor is captured at the first step"
        anchors = self.anchor
        if self.outer_optimizer is not None:
            for a, x in zip(anchors, averages):
                a.grad = a - x  # the unscaled pseudo-gradient
            self.outer_optimizer.step()
            self.outer_optimizer.zero_grad(set_to_none=True)
            torch._foreach_copy_(averages, anchors)
            return
        # No slow update (slow_lr=1, slow_momentum=0): keep the average
        if self.slow_buffer is None:
            torch._foreach_copy_(anchors, averages)
            return
        cfg = self.config
        for g, group in enumerate(param_groups):
            idx = [k for k, group_of in enumerate(self._groups) if group_of == g]
            if not idx:
                continue
            anchor = [anchors[k] for k in idx]
            avg = [averages[k] for k in idx]
            lr = float(group["lr"])
            if lr <= 0:
                # The pseudo-gradient is scaled by 1/lr: undefined at lr=0 (a warm-up that starts
                # at zero). Keep the slow buffer, restart from the average.
                if not self._zero_lr_warned:
                    warnings.warn(
                        "a param group has lr=0 at an outer step: its slow update is "
                        "skipped and its anchor set to the average",
                        stacklevel=5,
                    )
                    self._zero_lr_warned = True
                torch._foreach_copy_(anchor, avg)
                continue
            slow_momentum_step_(
                avg,
                anchor,
                [self.slow_buffer[k] for k in idx],
                lr,
                cfg.slow_lr,
                cfg.slow_momentum,
                nesterov=cfg.nesterov,
            )

    def _load_slow(
        self, saved_buffer: list[Tensor] | None, saved_outer: Any, anchor: list[Tensor]
    ) -> tuple[list[Tensor] | None, torch.optim.Optimizer | None]:
        """Check and build the slow buffer or outer optimizer of a loaded anchor.

        Args:
            saved_buffer: the saved slow buffer, already checked against the layout, or None.
            saved_outer: the saved outer optimizer's ``state_dict``, or None.
            anchor: the loaded anchor tensors.
        """
        if self.config.custom_outer:
            if saved_outer is None:
                raise ValueError(
                    "load_state_dict: this optimizer has a custom outer_optimizer but "
                    "the state has no outer optimizer state; it was saved with "
                    "outer_optimizer='heavyball' or 'nesterov'"
                )
            outer = self._build_outer(anchor)
            outer.load_state_dict(saved_outer)  # into a new object: raises before anything changes
            return None, outer
        if self.config.slow_enabled and saved_buffer is None:
            raise ValueError(
                "load_state_dict: the state has an anchor but no slow buffer; it was "
                "saved with the slow update disabled (slow_lr=1, slow_momentum=0)"
            )
        return (saved_buffer if self.config.slow_enabled else None), None
