"""A torch optimizer that shares the wrapped optimizer's ``param_groups`` and ``state``.

Like PyTorch's ``PostLocalSGDOptimizer``: LR schedulers, ``GradScaler`` and checkpoint tools
see one optimizer, because this one holds no groups or state of its own. It also keeps the
hook registries of a torch optimizer (``register_step_pre_hook`` & co.), with torch's semantics,
so :class:`hvd_slowmo.DistributedOptimizer` (arXiv 1910.00643) is a drop-in wherever a
``torch.optim.Optimizer`` is expected.
"""

from collections import OrderedDict, defaultdict
from typing import Any

import torch
from torch import Tensor

__all__ = ["WrappedOptimizer"]


class WrappedOptimizer(torch.optim.Optimizer):
    """The torch optimizer surface of a wrapper; subclasses implement ``step``,
    :meth:`_state_dict` and :meth:`_load_state_dict`.

    Args:
        optimizer: the wrapped optimizer (its ``param_groups`` and ``state`` are shared).
    """

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        # torch.optim.Optimizer.__init__ is not run (it would copy the param groups that this
        # wrapper shares), so create the hook registries it would, and wrap step() the same way:
        # register_step_pre_hook & co. then behave as on any torch optimizer.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._optimizer_state_dict_pre_hooks = OrderedDict()
        self._optimizer_state_dict_post_hooks = OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()
        self._patch_step_function()

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @param_groups.setter
    def param_groups(self, value: list[dict[str, Any]]) -> None:
        self.optimizer.param_groups = value

    @property
    def state(self) -> defaultdict[Tensor, Any]:
        return self.optimizer.state

    @state.setter
    def state(self, value: defaultdict[Tensor, Any]) -> None:
        self.optimizer.state = value

    @property
    def defaults(self) -> dict[str, Any]:
        return self.optimizer.defaults

    @defaults.setter
    def defaults(self, value: dict[str, Any]) -> None:
        self.optimizer.defaults = value

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the gradients, as ``torch.optim.Optimizer.zero_grad``.

        Args:
            set_to_none: drop the gradient tensors instead of zeroing them.
        """
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """:meth:`_state_dict`, with the hooks of ``register_state_dict_pre_hook``/``_post_hook``
        run as in torch."""
        for pre_hook in self._optimizer_state_dict_pre_hooks.values():
            pre_hook(self)
        state = self._state_dict()
        for post_hook in self._optimizer_state_dict_post_hooks.values():
            returned = post_hook(self, state)
            state = state if returned is None else returned
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """:meth:`_load_state_dict`, with the hooks of ``register_load_state_dict_pre_hook``/
        ``_post_hook`` run as in torch.

        Args:
            state_dict: from :meth:`state_dict`.
        """
        # A shallow copy, as torch makes
        state_dict = dict(state_dict) if isinstance(state_dict, dict) else state_dict
        for pre_hook in self._optimizer_load_state_dict_pre_hooks.values():
            returned = pre_hook(self, state_dict)
            state_dict = state_dict if returned is None else returned
        self._load_state_dict(state_dict)
        for post_hook in self._optimizer_load_state_dict_post_hooks.values():
            post_hook(self)

    def _state_dict(self) -> dict[str, Any]:
        """The state itself, without hooks (the subclass defines it)."""
        raise NotImplementedError(f"{type(self).__name__} must define _state_dict")

    def _load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load the state itself, without hooks (the subclass defines it)."""
        raise NotImplementedError(f"{type(self).__name__} must define _load_state_dict")
