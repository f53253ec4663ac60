"""The envelope of a saved :class:`~hvd_slowmo.DistributedOptimizer` state: its format version,
the checks every load starts with, and the upgrade of earlier formats.

Format 2 (current)::

    {"format": 2,
     "base_optimizer": <the wrapped optimizer's state_dict>,
     "slowmo": {"config": {...}, "num_params": int,
                "position": {"num_steps", "inner_step", "outer_steps", "world_size"},
                "slow_state": {"layout": "full" | "sharded", ...the layout's own keys},
                "in_flight": None | <an outer step whose average is in flight>,
                "eager_shares": None | {param index: tensor}   (eager="shares"; optional),
                "base_algorithm": {...}}}

Format 1 kept the counters at the top of ``"slowmo"``, wrote both layouts' keys (the other
layout's as None) and called the outer step in flight ``"overlap"``; :func:`upgrade` reads it.
"""

from typing import Any

__all__ = ["STATE_FORMAT", "check_saved_state", "upgrade"]

#: Version of the ``state_dict`` layout written by this version of the library.
STATE_FORMAT = 2


def upgrade(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The same state in the current format (a new dict; the tensors are shared).

    Args:
        state_dict: a saved state of any supported format.

    Raises:
        ValueError: a format this version cannot read.
    """
    version = state_dict.get("format")
    if version == STATE_FORMAT:
        return state_dict
    if version != 1:
        raise ValueError(
            f"load_state_dict: state format {version!r} is not supported (this version reads "
            f"formats 1 to {STATE_FORMAT}); it was written by a newer hvd_slowmo"
        )
    old = state_dict["slowmo"]
    if old.get("sharded") is not None:
        slow_state = {"layout": "sharded", **old["sharded"]}
    else:
        slow_state = {
            "layout": "full",
            **{k: old.get(k) for k in ("anchor", "slow_buffer", "outer_optimizer")},
        }
    slowmo = {
        "config": old.get("config"),
        "num_params": old.get("num_params"),
        "position": {
            k: old.get(k) for k in ("num_steps", "inner_step", "outer_steps", "world_size")
        },
        "slow_state": slow_state,
        "in_flight": old.get("overlap"),
        "base_algorithm": old.get("base_algorithm", {}),
    }
    return {**state_dict, "format": STATE_FORMAT, "slowmo": slowmo}


def check_saved_state(state_dict: Any, num_params: int, tau: int) -> dict[str, Any]:
    """Check the envelope and step counters of a saved optimizer state (of any supported format);
    returns its ``"slowmo"`` entry in the current format.

    Args:
        state_dict: a :meth:`hvd_slowmo.DistributedOptimizer.state_dict` output, or not.
        num_params: this optimizer's number of parameters.
        tau: this optimizer's ``tau``.

    Raises:
        ValueError: not an optimizer state, an unknown format version, another model, a larger
            ``tau`` inside the outer step, or damaged counters.
    """
    if (
        not isinstance(state_dict, dict)
        or "slowmo" not in state_dict
        or "base_optimizer" not in state_dict
    ):
        raise ValueError(
            "load_state_dict: not a hvd_slowmo.DistributedOptimizer state (no 'slowmo' and "
            "'base_optimizer' keys); a plain optimizer state belongs in "
            "opt.optimizer.load_state_dict"
        )
    saved = upgrade(state_dict)["slowmo"]
    if saved.get("num_params") != num_params:
        raise ValueError(
            f"load_state_dict: the state has {saved.get('num_params')} parameters, this "
            f"optimizer {num_params}: it comes from another model"
        )
    position = saved.get("position")
    if not isinstance(position, dict):
        raise ValueError("load_state_dict: the state has no 'position' (step counters): damaged")
    inner = position.get("inner_step")
    if not isinstance(inner, int) or not 0 <= inner < tau:
        raise ValueError(
            f"load_state_dict: inner_step {inner!r} is outside [0, tau={tau}); the state "
            "was saved with a larger tau"
        )
    for key in ("num_steps", "outer_steps"):
        if not isinstance(position.get(key), int) or position[key] < 0:
            raise ValueError(
                f"load_state_dict: '{key}' is {position.get(key)!r}, not a step count: a damaged "
                "state"
            )
    if not isinstance(saved.get("slow_state"), dict):
        raise ValueError("load_state_dict: the state has no 'slow_state': a damaged state")
    return saved
