"""The checkpoint side of :class:`hvd_slowmo.DistributedOptimizer`: its ``state_dict`` (the
envelope of :mod:`hvd_slowmo.state_format`), an atomic ``load_state_dict`` of this or an earlier
format, and the broadcast of one rank's state to all (SlowMo, arXiv 1910.00643)."""

import warnings
from typing import TYPE_CHECKING, Any

import torch

from .bases.base import BaseAlgorithm
from .comm.base import Communicator
from .config import saved_config_changes
from .outer_step import OuterLoop
from .progress import outer_step_note
from .state_format import STATE_FORMAT, check_saved_state

__all__ = ["SavedState"]


class SavedState:
    """A mixin: the optimizer provides the attributes annotated here, ``_settings()`` and
    ``adopt_world()``; :class:`~hvd_slowmo.wrapper.WrappedOptimizer` wraps these methods in
    torch's state-dict hooks."""

    optimizer: torch.optim.Optimizer
    outer: OuterLoop
    comm: Communicator
    params: list[torch.Tensor]
    param_names: list[str]
    param_groups: list[dict[str, Any]]
    tau: int

    if TYPE_CHECKING:  # provided by the optimizer and by WrappedOptimizer

        @property
        def base(self) -> BaseAlgorithm: ...

        def _settings(self) -> dict[str, Any]: ...

        def adopt_world(self, why: str) -> None: ...

        def state_dict(self) -> dict[str, Any]: ...

        def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def _state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly, keyed by parameter index (not tensor identity):
        the base optimizer's ``state_dict``, the position (step counters), each fragment's entry
        (its slow state, exchange state such as a codec's residual, outer step in flight and
        eager shares), the base algorithm's own state and the configuration (layout:
        :mod:`hvd_slowmo.state_format`).
        Tensors are references, as in torch's own ``state_dict``; ``torch.save`` copies them."""
        try:
            outer = self.outer.state_dict()  # waits for an average in flight: collective
        except Exception as e:
            # A dead or frozen peer surfaces here when the checkpoint comes before the landing:
            # say where, as step() does, without changing the type.
            o = self.outer
            pos, name = o.position, o.config.base_name
            note = outer_step_note(e, o.comm, pos.outer_steps, pos.num_steps, name)
            e.add_note(f"{note} (in state_dict, finishing the average in flight)")
            raise
        return {
            "format": STATE_FORMAT,
            "base_optimizer": self.optimizer.state_dict(),
            "slowmo": {
                "config": self._settings(),
                "num_params": len(self.params),
                **outer,
                "base_algorithm": self.base.state_dict(),
            },
        }

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (of this or an earlier format); on any error the
        optimizer is left unchanged.

        Args:
            state_dict: from :meth:`state_dict` (any rank's, or rank 0's broadcast).

        Raises:
            ValueError: a state from an unknown format version, another model, or configuration.
        """
        s = check_saved_state(state_dict, self.outer.split(), self._inner_limit(state_dict))
        position = s["position"]
        changes = saved_config_changes(s.get("config"), self._settings())
        loaded = self.outer.prepare_load(s, state_dict["base_optimizer"])
        self.base.check_state_dict(s.get("base_algorithm", {}))
        # All checks passed; the wrapped optimizer's own load checks group sizes before it mutates.
        self.optimizer.load_state_dict(state_dict["base_optimizer"])
        self.outer.commit_load(position, loaded)
        self.outer.load_unequal(s.get("work"), s.get("period"))
        self.base.load_state_dict(s.get("base_algorithm", {}))
        if changes:
            warnings.warn(
                f"load_state_dict: the state was saved with other settings ({'; '.join(changes)}); "
                "training continues with this optimizer's",
                stacklevel=2,
            )
        saved_size = position.get("world_size")  # absent in states written before it was recorded
        if saved_size is not None and saved_size != self.comm.size:
            # Inside an outer step each worker's parameters and base state are its own: with
            # another number of workers only the anchor is common, so restart from it.
            self.adopt_world(
                f"a state saved by {saved_size} workers was loaded by {self.comm.size}"
            )

    def _inner_limit(self, state_dict: Any) -> int:
        """The bound of a saved ``inner_step``: ``tau``, or with time-based periods the saved
        period's planned count (a worker may take more than ``tau`` steps in a period)."""
        saved = state_dict.get("slowmo") if isinstance(state_dict, dict) else None
        period = saved.get("period") if isinstance(saved, dict) else None
        steps = period.get("steps") if isinstance(period, dict) else None
        if self.outer.period is None or not isinstance(steps, int):
            return self.tau
        return max(self.tau, steps)

    def broadcast_state(self, root_rank: int = 0) -> None:
        """Give every rank ``root_rank``'s full optimizer state (base state, anchor, slow buffer,
        counters), e.g. after rank 0 alone loaded a checkpoint. Collective.

        Args:
            root_rank: the rank whose state is sent.

        Raises:
            ValueError: each rank holds its own part of the slow state (``shard_slow_state=True``).
        """
        if self.outer.per_rank:
            raise ValueError(
                "broadcast_optimizer_state: with shard_slow_state=True each rank holds its own "
                "shard of the slow state; have every rank load the state it saved instead"
            )
        mine = self.state_dict() if self.comm.rank == root_rank else None
        self.load_state_dict(self.comm.broadcast_object(mine, root_rank=root_rank))
