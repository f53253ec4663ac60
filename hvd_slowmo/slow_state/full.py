"""The full slow state: every worker keeps its fragment's whole anchor ``x_{t,0}`` and slow
buffer ``u_t``, one tensor per parameter (arXiv 1910.00643, Algorithm 1). Any exchange averages
the parameters (:mod:`hvd_slowmo.exchange`: plain or compressed); the slow update then runs on
every worker alike, over the fragment's parameters.
"""

from typing import Any

import torch
from torch import Tensor

from .base import LoadedSlowState, ParamGroups, SlowState

__all__ = ["FullSlowState"]


class FullSlowState(SlowState):
    """Anchor and slow buffer (or outer optimizer) over a fragment's whole parameters, on every
    worker.

    With the slow update disabled (``slow_lr=1, slow_momentum=0``) an anchor is kept only for
    ``nonfinite="skip"``; otherwise nothing is kept and the outer step is the exact average.

    Args:
        comm: the communicator of the exact average.
        config: the optimizer's configuration.
        timer: the optimizer's phase timer.
    """

    layout = "full"
    setting, alternative = "shard_slow_state=False", "shard_slow_state=True"

    @torch.no_grad()
    def capture_(self, params: list[Tensor], groups: list[int]) -> None:
        if self.captured or not self.config.keeps_anchor:
            return
        self._start([p.clone() for p in params], groups)

    @torch.no_grad()
    def add_(self, params: list[Tensor], groups: list[int]) -> None:
        if self.anchor is not None:
            self._extend([p.clone() for p in params[len(self.anchor) :]], groups[-1])

    def update_(self, params: list[Tensor], param_groups: ParamGroups) -> None:
        if self.captured:  # params are the averages: updated in place
            self._slow_update_(params, param_groups)

    @torch.no_grad()
    def restore_(self, params: list[Tensor]) -> None:
        assert self.anchor is not None, "restore_ needs a captured anchor"
        torch._foreach_copy_(params, self.anchor)

    def check_world(self, old_world: tuple[int, int], why: str) -> None:
        pass  # the whole state is the same on every worker: any of them can go on with it

    def state_dict(self) -> dict[str, Any]:
        outer = None if self.outer_optimizer is None else self.outer_optimizer.state_dict()
        return {
            "layout": self.layout,
            "anchor": None if self.anchor is None else dict(enumerate(self.anchor)),
            "slow_buffer": None if self.slow_buffer is None else dict(enumerate(self.slow_buffer)),
            "outer_optimizer": outer,
        }

    def prepare_load(
        self,
        saved: dict[str, Any],
        params: list[Tensor],
        groups: list[int],
        position: dict[str, Any],
        names: list[str],
    ) -> LoadedSlowState:
        if saved.get("layout") != self.layout:
            raise ValueError(
                f"load_state_dict: the slow state was saved with layout {saved.get('layout')!r} "
                "(shard_slow_state=True); load it with shard_slow_state=True"
            )
        anchor = self._load_tensors(saved, "anchor", params, names)
        buffer = self._load_tensors(saved, "slow_buffer", params, names)
        inner_step = position["inner_step"]
        saved_size = position.get("world_size") or self.comm.size  # absent in the oldest states
        if saved_size != self.comm.size and inner_step > 0 and anchor is None:
            raise ValueError(
                f"load_state_dict: the state was saved by {saved_size} workers inside an outer "
                f"step (inner_step {inner_step}) without an anchor, and this job has "
                f"{self.comm.size}: only the anchor is common to all workers. Save at an "
                "outer-step boundary (when opt.inner_step == 0), or load with the same number of "
                "workers"
            )
        if self.config.keeps_anchor and inner_step > 0 and anchor is None:
            raise ValueError(
                "load_state_dict: the state has no anchor but was saved inside an outer "
                "step; it was saved with the slow update disabled (slow_lr=1, slow_momentum=0)"
            )
        if anchor is None or not self.config.keeps_anchor:
            return LoadedSlowState(anchor=None)
        slow, outer = self._load_slow(buffer, saved.get("outer_optimizer"), anchor)
        return LoadedSlowState(
            anchor=anchor,
            slow_buffer=slow,
            outer_optimizer=outer,
            groups=list(groups),
        )

    @staticmethod
    def _load_tensors(
        saved: dict[str, Any], key: str, params: list[Tensor], names: list[str]
    ) -> list[Tensor] | None:
        tensors = saved.get(key)
        if tensors is None:
            return None
        if not isinstance(tensors, dict) or set(tensors) != set(range(len(params))):
            raise ValueError(
                f"load_state_dict: '{key}' does not cover the fragment's parameters "
                f"0..{len(params) - 1}"
            )
        for i, p in enumerate(params):
            if not isinstance(tensors[i], Tensor) or tuple(tensors[i].shape) != tuple(p.shape):
                raise ValueError(
                    f"load_state_dict: '{key}' of parameter {names[i]!r} has shape "
                    f"{tuple(getattr(tensors[i], 'shape', ()))}, the parameter "
                    f"{tuple(p.shape)}: another model"
                )
        return [tensors[i].detach().to(p.device, p.dtype).clone() for i, p in enumerate(params)]
