"""The envelope of a saved :class:`~hvd_slowmo.DistributedOptimizer` state: its format version,
the checks every load starts with, and the upgrade of earlier formats.

Format 4 (current): each fragment's outer state is its own entry, indexed by the fragment's
parameters (their positions in ``"members"``, the fragment's parameter indices)::

    {"format": 4,
     "base_optimizer": <the wrapped optimizer's state_dict>,
     "slowmo": {"config": {...}, "num_params": int,
                "position": {"num_steps", "inner_step", "outer_steps", "world_size"},
                "fragments": [   # one per fragment, in period order
                    {"members": [param index, ...],
                     "slow_state": {"layout": "full" | "sharded", ...the layout's own keys},
                     "exchange": None | <its exchange's own state: a codec's residual>,
                     "in_flight": None | {"land_at": int, ...}  (its outer step in flight),
                     "eager_shares": None | {position: tensor}}, ...],
                "base_algorithm": {...},
                "work": {...}, "period": {...}}}   (a weighted merge, time-based periods)

Format 3 kept one model-wide entry of each (``"slow_state"`` over every parameter, or the
sharded buckets of every fragment; ``"exchange"`` with a residual over every parameter;
``"in_flight"`` naming its ``"fragment"`` and the ``"fragments"`` count; ``"eager_shares"`` by
parameter index); its upgrade splits them by the loading optimizer's fragments
(:class:`Split`). Format 2 called the landing step of the outer step in flight ``"apply_at"``
and kept the compressed exchange's state in ``slow_state["compression"]``. Format 1 kept the
counters at the top of ``"slowmo"``, wrote both layouts' keys (the other layout's as None) and
called the outer step in flight ``"overlap"``. :func:`upgrade` reads them all, one version at a
time. A format-4 state cut into other fragments than the loader's is joined into the format-3
entries and split again (what cannot be split, an outer step in flight or sharded buckets, is
refused as format 3 refused it).
"""

from collections.abc import Callable
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

import torch

__all__ = ["STATE_FORMAT", "Split", "check_in_flight", "check_saved_state", "upgrade"]

#: Version of the ``state_dict`` layout written by this version of the library.
STATE_FORMAT = 4


@dataclass(frozen=True)
class Split:
    """How the loading optimizer cuts its parameters into fragments.

    Attributes:
        members: each fragment's parameter indices, in period order.
        numels: each parameter's number of elements on this rank (a codec's residual is flat
            over them).
    """

    members: list[list[int]]
    numels: list[int]


def upgrade(state_dict: dict[str, Any], split: Split) -> dict[str, Any]:
    """The same state in the current format, its fragments' entries cut as ``split`` (a new
    dict; the tensors are shared).

    Args:
        state_dict: a saved state of any supported format.
        split: the loading optimizer's fragments.

    Raises:
        ValueError: a format this version cannot read, or fragments that cannot be re-cut
            (an outer step in flight).
    """
    version = state_dict.get("format")
    if version not in _UPGRADES and version != STATE_FORMAT:
        raise ValueError(
            f"load_state_dict: state format {version!r} is not supported (this version reads "
            f"formats 1 to {STATE_FORMAT}); it was written by a newer hvd_slowmo"
        )
    assert isinstance(version, int)  # a known format (checked above), for the type checker
    slowmo = state_dict["slowmo"]
    if version == STATE_FORMAT and _members(slowmo) not in (None, split.members):
        # Cut into other fragments: joined into format 3, then cut as the loader cuts.
        slowmo, version = _to_3(slowmo, split.numels), 3
    while version != STATE_FORMAT:
        slowmo = _UPGRADES[version](slowmo, split)
        version += 1
    return {**state_dict, "format": STATE_FORMAT, "slowmo": slowmo}


def _members(slowmo: Any) -> list[list[int]] | None:
    """A format-4 entry's fragments' members (None: damaged, left to the checks)."""
    fragments = slowmo.get("fragments") if isinstance(slowmo, dict) else None
    if not isinstance(fragments, list) or not all(isinstance(f, dict) for f in fragments):
        return None
    return [f.get("members") for f in fragments]


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


def _from_3(old: dict[str, Any], split: Split) -> dict[str, Any]:
    """Format 3's ``"slowmo"`` entry in format 4: each model-wide entry cut by the loader's
    fragments (``split``).

    Raises:
        ValueError: an outer step in flight saved with another number of fragments.
    """
    flight = old.get("in_flight")
    count = len(split.members)
    if isinstance(flight, dict):
        saved_count = flight.get("fragments", 1)
        if saved_count != count or flight.get("fragment", 0) not in range(count):
            raise ValueError(
                f"load_state_dict: the state was saved with fragments={saved_count!r} and one in "
                f"flight, this optimizer has fragments={count}: resume with the fragments it was "
                "saved with, or save when no average is in flight"
            )
    shares = old.get("eager_shares")
    fragments = []
    for k, members in enumerate(split.members):
        mine = flight if isinstance(flight, dict) and flight.get("fragment", 0) == k else None
        fragments.append(
            {
                "members": list(members),
                "slow_state": _split_slow_state(old.get("slow_state"), members),
                "exchange": _split_exchange(old.get("exchange"), members, split.numels),
                "in_flight": None
                if mine is None
                else {key: v for key, v in mine.items() if key not in ("fragment", "fragments")},
                "eager_shares": _pick(shares, members),
            }
        )
    new = {k: v for k, v in old.items() if k not in _MODEL_WIDE}
    return {**new, "fragments": fragments}


#: Format 3's model-wide entries, which format 4 keeps per fragment.
_MODEL_WIDE = ("slow_state", "exchange", "in_flight", "eager_shares")


def _pick(by_index: Any, members: list[int]) -> Any:
    """``{param index: value}`` restricted to ``members``, by position (anything else: as is,
    for the checks)."""
    if not isinstance(by_index, dict) or not all(j in by_index for j in members):
        return by_index
    return {pos: by_index[j] for pos, j in enumerate(members)}


def _split_outer(saved: Any, olds: list[int]) -> Any:
    """A torch optimizer's ``state_dict`` over the tensors ``olds`` alone, renumbered by
    position (its param groups keep their order; those left empty are dropped)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list):
        return saved
    pos = {old: k for k, old in enumerate(olds)}
    state = saved.get("state", {})
    groups = []
    for group in saved["param_groups"]:
        params = [pos[i] for i in group.get("params", []) if i in pos]
        if params:
            groups.append({**group, "params": params})
    return {"state": {pos[i]: v for i, v in state.items() if i in pos}, "param_groups": groups}


def _split_slow_state(saved: Any, members: list[int]) -> Any:
    """A format-3 slow state restricted to one fragment's parameters."""
    if not isinstance(saved, dict):
        return saved
    if saved.get("layout") != "sharded":
        out = dict(saved)
        for key in ("anchor", "slow_buffer"):
            out[key] = _pick(saved.get(key), members)
        out["outer_optimizer"] = _split_outer(saved.get("outer_optimizer"), members)
        return out
    buckets = saved.get("buckets")
    if not isinstance(buckets, list) or not all(
        isinstance(b, dict) and isinstance(b.get("indices"), (list, tuple)) and b["indices"]
        for b in buckets
    ):
        return saved  # damaged: the layout's own checks say so
    pos = {j: k for k, j in enumerate(members)}
    # Format 3 cut the buckets by fragment: a bucket is the fragment's of its first parameter.
    chosen = [i for i, b in enumerate(buckets) if b["indices"][0] in pos]
    out = {
        **saved,
        "buckets": [
            {**buckets[i], "indices": [pos.get(j, -1) for j in buckets[i]["indices"]]}
            for i in chosen
        ],
        "outer_optimizer": _split_outer(saved.get("outer_optimizer"), chosen),
    }
    for key in ("anchor_shards", "slow_buffer_shards"):
        shards = saved.get(key)
        if isinstance(shards, list) and len(shards) == len(buckets):
            out[key] = [shards[i] for i in chosen]
    return out


def _split_exchange(saved: Any, members: list[int], numels: list[int]) -> Any:
    """A format-3 exchange state (a codec's residual over every parameter) restricted to one
    fragment's parameters."""
    residual = saved.get("residual") if isinstance(saved, dict) else None
    if not isinstance(residual, torch.Tensor) or residual.numel() != sum(numels):
        return saved  # nothing to cut (a residual of another model is refused by its owner)
    offsets = [0, *accumulate(numels)]
    parts = [residual.narrow(0, offsets[j], numels[j]) for j in members]
    return {**saved, "residual": torch.cat(parts) if parts else residual[:0]}


def _to_3(new: dict[str, Any], numels: list[int]) -> dict[str, Any]:
    """A format-4 ``"slowmo"`` entry joined into format 3's model-wide entries (to cut it into
    other fragments); ``numels``: each parameter's number of elements."""
    fragments = new["fragments"]
    members = [f["members"] for f in fragments]
    flight = [(k, f["in_flight"]) for k, f in enumerate(fragments) if f.get("in_flight")]
    out = {k: v for k, v in new.items() if k != "fragments"}
    out["in_flight"] = (
        None
        if not flight
        else {**flight[0][1], "fragment": flight[0][0], "fragments": len(fragments)}
    )
    out["eager_shares"] = _join([f.get("eager_shares") for f in fragments], members)
    out["exchange"] = _join_exchange([f.get("exchange") for f in fragments], members, numels)
    out["slow_state"] = _join_slow_state([f.get("slow_state") for f in fragments], members)
    return out


def _join(entries: list[Any], members: list[list[int]]) -> Any:
    """Per-fragment ``{position: value}`` entries as one ``{param index: value}`` (None where
    every fragment has None)."""
    if all(e is None for e in entries):
        return None
    out: dict[int, Any] = {}
    for entry, mine in zip(entries, members):
        if isinstance(entry, dict):
            out.update({mine[pos]: v for pos, v in entry.items() if pos < len(mine)})
    return out


def _join_exchange(entries: list[Any], members: list[list[int]], numels: list[int]) -> Any:
    """The fragments' residuals as one flat residual in parameter order (zero where a
    fragment has none yet)."""
    if not entries or not all(isinstance(e, dict) for e in entries):
        return None  # another exchange or none: nothing to carry over
    residuals = [e.get("residual") for e in entries]
    if all(r is None for r in residuals):
        return {**entries[0], "residual": None}
    ref = next(r for r in residuals if isinstance(r, torch.Tensor))
    flat = torch.zeros(sum(numels), dtype=torch.float32, device=ref.device)
    offsets = [0, *accumulate(numels)]
    for r, mine in zip(residuals, members):
        if not isinstance(r, torch.Tensor) or r.numel() != sum(numels[j] for j in mine):
            continue  # none yet (or damaged): that fragment's parameters start from zero
        for j, part in zip(mine, r.split([numels[j] for j in mine])):
            flat.narrow(0, offsets[j], numels[j]).copy_(part)
    return {**entries[0], "residual": flat}


def _join_outer(entries: list[Any], olds: list[list[int]]) -> Any:
    """Per-fragment torch optimizer states as one, renumbered by ``olds`` (each fragment's
    tensors' model-wide numbers), param groups joined by position."""
    if not all(isinstance(e, dict) for e in entries):
        return None
    state: dict[int, Any] = {}
    groups: list[dict[str, Any]] = []
    for entry, mine in zip(entries, olds):
        state.update({mine[pos]: v for pos, v in entry.get("state", {}).items()})
        for g, group in enumerate(entry.get("param_groups", [])):
            if g == len(groups):
                groups.append({**group, "params": []})
            groups[g]["params"] += [mine[pos] for pos in group["params"]]
    for group in groups:
        group["params"].sort()
    return {"state": state, "param_groups": groups}


def _join_slow_state(entries: list[Any], members: list[list[int]]) -> Any:
    """The fragments' slow states as one model-wide slow state (a sharded one keeps its
    buckets, which only the same fragments can take back)."""
    if not entries or not all(isinstance(e, dict) for e in entries):
        return None
    first = entries[0]
    if first.get("layout") != "sharded":
        outer = [e.get("outer_optimizer") for e in entries]
        return {
            **first,
            "anchor": _join([e.get("anchor") for e in entries], members),
            "slow_buffer": _join([e.get("slow_buffer") for e in entries], members),
            "outer_optimizer": None if outer[0] is None else _join_outer(outer, members),
        }
    buckets: list[dict[str, Any]] = []
    numbers: list[list[int]] = []
    for e, mine in zip(entries, members):
        start = len(buckets)
        for b in e.get("buckets") or []:
            buckets.append({**b, "indices": [mine[pos] for pos in b["indices"]]})
        numbers.append(list(range(start, len(buckets))))
    outer = [e.get("outer_optimizer") for e in entries]
    return {
        **first,
        "buckets": buckets,
        "anchor_shards": [t for e in entries for t in e.get("anchor_shards") or []],
        "slow_buffer_shards": [t for e in entries for t in e.get("slow_buffer_shards") or []],
        "outer_optimizer": None if outer[0] is None else _join_outer(outer, numbers),
    }


#: Format version -> the upgrade of its ``"slowmo"`` entry to the next version (format 3's
#: cuts it by the loader's fragments).
_UPGRADES: dict[Any, Callable[[dict[str, Any], Split], dict[str, Any]]] = {
    1: lambda old, _: _from_1(old),
    2: lambda old, _: _from_2(old),
    3: _from_3,
}


def check_saved_state(state_dict: Any, split: Split, tau: int) -> dict[str, Any]:
    """Check the envelope and step counters of a saved optimizer state (of any supported format);
    returns its ``"slowmo"`` entry in the current format, one entry per fragment of ``split``.

    Args:
        state_dict: a :meth:`hvd_slowmo.DistributedOptimizer.state_dict` output, or not.
        split: this optimizer's fragments (and its number of parameters).
        tau: this optimizer's ``tau``.

    Raises:
        ValueError: not an optimizer state, an unknown format version, another model, a larger
            ``tau`` inside the outer step, or damaged counters or fragments.
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
    num_params = len(split.numels)
    saved = state_dict["slowmo"]
    if not isinstance(saved, dict) or saved.get("num_params") != num_params:
        raise ValueError(
            f"load_state_dict: the state has {saved.get('num_params')} parameters, this "
            f"optimizer {num_params}: it comes from another model"
        )
    saved = upgrade(state_dict, split)["slowmo"]
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
    if _members(saved) != split.members or not all(
        isinstance(f.get("slow_state"), dict) for f in saved["fragments"]
    ):
        raise ValueError(
            "load_state_dict: the state's 'fragments' are not this model's fragments, each with "
            "its 'slow_state': a damaged state"
        )
    return saved


def check_in_flight(saved: Any, position: dict[str, Any], tau: int, overlap: int) -> int:
    """Check a fragment's saved outer step in flight (current format) against the running
    configuration.

    Args:
        saved: the fragment's ``"in_flight"`` entry (not None).
        position: the saved (checked) position.
        tau, overlap: the running configuration's.

    Returns:
        The inner step at which it lands.

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
    land_at, inner = saved["land_at"], position["inner_step"]
    if not inner < land_at <= tau:
        raise ValueError(
            f"load_state_dict: the outer step in flight lands at inner step {land_at}, outside "
            f"({inner}, tau={tau}]: the state was saved with another tau or overlap"
        )
    return land_at
