"""Argument checks with one rule for every user-facing option of the package.

A value of the wrong type raises ``TypeError``, a value of the right type but outside what is
allowed raises ``ValueError``; both name the argument, the value given and what to pass instead.
``bool`` is never accepted where a number is expected (``True`` is an ``int`` to Python, but
``tau=True`` is a mistake).
"""

import math
from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["check_bool", "check_choice", "check_int", "check_number"]


def _fix(fix: str) -> str:
    return f"; {fix}" if fix else ""


def check_bool(name: str, value: Any, fix: str = "") -> bool:
    """``value`` itself, which must be ``True`` or ``False``.

    Args:
        name: the argument's name, for the message.
        value: the value given.
        fix: what to do instead (appended to the message).
    """
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {value!r}{_fix(fix)}")
    return value


def check_int(name: str, value: Any, low: int, fix: str = "") -> int:
    """``value`` itself, which must be an integer ``>= low``.

    Args:
        name: the argument's name, for the message.
        value: the value given.
        low: the smallest allowed value.
        fix: what to do instead (appended to the message).
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an integer >= {low}, got {value!r}{_fix(fix)}")
    if value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}{_fix(fix)}")
    return value


def check_number(
    name: str,
    value: Any,
    low: float = -math.inf,
    high: float = math.inf,
    low_open: bool = False,
    high_open: bool = False,
    fix: str = "",
    finite: bool = True,
) -> float:
    """``value`` as a float, which must be a finite real number in the given interval.

    Args:
        name: the argument's name, for the message.
        value: the value given.
        low: the interval's lower end.
        high: the interval's upper end.
        low_open: exclude ``low`` itself.
        high_open: exclude ``high`` itself.
        fix: what to do instead (appended to the message).
        finite: refuse ``inf`` (``nan`` is always refused).
    """
    interval = f"{'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number in {interval}, got {value!r}{_fix(fix)}")
    below = value < low or (low_open and value == low)
    above = value > high or (high_open and value == high)
    if math.isnan(value) or (finite and math.isinf(value)) or below or above:
        what = "a finite number" if finite else "a number"
        raise ValueError(f"{name} must be {what} in {interval}, got {value!r}{_fix(fix)}")
    return float(value)


def check_choice(name: str, value: Any, choices: Sequence[str], fix: str = "") -> str:
    """``value`` itself, which must be one of the strings ``choices``.

    Args:
        name: the argument's name, for the message.
        value: the value given.
        choices: the allowed strings.
        fix: what to do instead (appended to the message).
    """
    allowed = ", ".join(repr(c) for c in choices)
    if not isinstance(value, str):
        raise TypeError(f"{name} must be one of {allowed}, got {value!r}{_fix(fix)}")
    if value not in choices:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}{_fix(fix)}")
    return value


def check_base_optimizer(optimizer: Any, wrapper: type) -> None:
    """Raise unless ``optimizer`` is a plain torch optimizer (not already wrapped).

    Args:
        optimizer: the ``optimizer`` argument of ``DistributedOptimizer``.
        wrapper: the ``DistributedOptimizer`` class (passed in: this module does not import it).

    Raises:
        TypeError: not a ``torch.optim.Optimizer``, or already a ``wrapper``.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}; "
            "pass e.g. torch.optim.SGD(model.parameters(), lr=0.1)"
        )
    if isinstance(optimizer, wrapper):
        raise TypeError(
            "optimizer is already a hvd_slowmo.DistributedOptimizer; wrap the base optimizer once"
        )
