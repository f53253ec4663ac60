"""The envelope of a saved :class:`~hvd_slowmo.DistributedOptimizer` state: its format version,
the checks every load starts with, and the upgrade of earlier formats.

Format 3 (current)::

    {"format": 3,
     "base_optimizer": <the wrapped optimizer's state_dict>,
     "slowmo": {"config": {...}, "num_params": int,
                "position": {"num_steps", "inner_step", "outer_steps", "world_size"},
                "slow_state": {"layout": "full" | "sharded", ...the layout's own keys},
                "in_flight": None | {"land_at": int, "fragment": int, ...}
                             (an outer step whose average is in flight),
                "eager_shares": None | {param index: tensor}   (eager="shares"; optional),
                "exchange": None | <the exchange's own state: a codec's residual>,
                "base_algorithm": {...}}}

Format 2 called the landing step of the outer step in flight ``"apply_at"`` and kept the
compressed exchange's state in ``slow_state["compression"]``. Format 1 kept the counters at the
top of ``"slowmo"``, wrote both layouts' keys (the other layout's as None) and called the outer
step in flight ``"overlap"``. :func:`upgrade` reads both, one version at a time.
"""

from collections.abc import Callable
from typing import Any

__all__ = ["STATE_FORMAT", "check_in_flight", "check_saved_state", "upgrade"]

#: Version of the ``state_dict`` layout written by this version of the library.
STATE_FORMAT = 3


def upgrade(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The same state in the current format (a new dict; the tensors are shared).

    Args:
        state_dict: a saved state of any supported format.

    Raises:
        ValueError: a format this version cannot read.
    """
    version = state_dict.get("format")
    if version not in _UPGRADES and version != STATE_FORMAT:
        raise ValueError(
            f"load_state_dict: state format {version!r} is not supported (this version reads "
            f"formats 1 to {STATE_FORMAT}); it was written by a newer hvd_slowmo"
        )
    assert isinstance(version, int)  # a known format (checked above), for the type checker
    while version != STATE_FORMAT:
        state_dict = {
            **state_dict,
            "format": version + 1,
            "slowmo": _UPGRADES[version](state_dict["slowmo"]),
        }
        version += 1
    return state_dict


def _from_1(old: dict[str, Any]) -> dict[str, Any]:
    """Format 1's ``"slowmo"`` entry in format 2."""
    if old.get("sharded") is not None:
        slow_state = {"layout": "sharded", **old["sharded"]}
    else:
        slow_state = {
            "layout": "full",
            **{k: old.get(k) for k in ("anchor", "slow_buffer", "outer_optimizer")},
        }
    return {
        "config": old.get("config"),
        "num_params": old.get("num_params"),
        "position": {
            k: old.get(k) for k in ("num_steps", "inner_step", "outer_steps", "world_size")
        },
        "slow_state": slow_state,
        "in_flight": old.get("overlap"),
        "base_algorithm": old.get("base_algorithm", {}),
    }


def _from_2(old: dict[str, Any]) -> dict[str, Any]:
    """Format 2's ``"slowmo"`` entry in format 3: the landing step is ``"land_at"``, and the
    compressed exchange's state moves from the slow state to ``"exchange"``."""
    new = dict(old)
    flight = old.get("in_flight")
    if isinstance(flight, dict) and "apply_at" in flight:
        new["in_flight"] = {
            **{k: v for k, v in flight.items() if k != "apply_at"},
            "land_at": flight["apply_at"],
        }
    slow_state = old.get("slow_state")
    if isinstance(slow_state, dict):
        new["slow_state"] = {k: v for k, v in slow_state.items() if k != "compression"}
        new["exchange"] = slow_state.get("compression")
    return new


#: Format version -> the upgrade of its ``"slowmo"`` entry to the next version.
_UPGRADES: dict[Any, Callable[[dict[str, Any]], dict[str, Any]]] = {1: _from_1, 2: _from_2}


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


def check_in_flight(
    saved: Any, position: dict[str, Any], tau: int, overlap: int, fragments: int
) -> tuple[int, int]:
    """Check a saved outer step in flight (current format) against the running configuration.

    Args:
        saved: the ``"in_flight"`` entry (not None).
        position: the saved (checked) position.
        tau, overlap, fragments: the running configuration's.

    Returns:
        Its fragment and the inner step at which it lands.

    Raises:
        ValueError: the entry is damaged, or belongs to another configuration.
    """
    if not overlap:
        raise ValueError(
            "load_state_dict: the state was saved with an outer step in flight (overlap >= 1);"
            " resume with the overlap it was saved with, or save when no average is in flight"
        )
    if not isinstance(saved, dict) or not isinstance(saved.get("land_at"), int):
        raise ValueError("load_state_dict: 'in_flight' is not an outer step: a damaged state")
    fragment = saved.get("fragment", 0)
    if saved.get("fragments", 1) != fragments or fragment not in range(fragments):
        raise ValueError(
            f"load_state_dict: the state was saved with fragments={saved.get('fragments', 1)!r}"
            f" and one in flight, this optimizer has fragments={fragments}: resume with the "
            "fragments it was saved with, or save when no average is in flight"
        )
    land_at, inner = saved["land_at"], position["inner_step"]
    if not inner < land_at <= tau:
        raise ValueError(
            f"load_state_dict: the outer step in flight lands at inner step {land_at}, outside "
            f"({inner}, tau={tau}]: the state was saved with another tau or overlap"
        )
    return fragment, land_at
