"""Statistics of ``benchmarks/cluster.py``: per-window times, pooled repeats, ratios against
AR-SGD, the compute-only limit and the peers (SlowMo, arXiv 1910.00643)."""

import statistics
from collections.abc import Sequence
from typing import Any

from cluster_algorithms import ALGORITHM_BY_KEY, OVERLAP_ROWS, PEER_KEYS, TABLE2_ROWS

__all__ = [
    "cluster_stamps",
    "hidden_fraction",
    "pool_repeats",
    "ring_bytes",
    "summarize",
    "window_stats",
]


def window_stats(stamps: Sequence[float], window: int) -> dict[str, Any]:
    """Milliseconds per iteration over consecutive windows of ``window`` iterations.

    A window of one outer period (``tau`` iterations) contains exactly one outer step, so every
    window holds the same mix of cheap inner steps and the expensive average.

    Args:
        stamps: ``perf_counter`` seconds: the start, then the end of each iteration.
        window: iterations per window (>= 1); trailing iterations that fill no window are ignored.
    """
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    n = (len(stamps) - 1) // window
    if n < 1:
        raise ValueError(
            f"need at least {window} timed iterations for one window, got {len(stamps) - 1}"
        )
    per = [1e3 * (stamps[(i + 1) * window] - stamps[i * window]) / window for i in range(n)]
    return {
        "median_ms": statistics.median(per),
        "min_ms": min(per),
        "max_ms": max(per),
        "mean_ms": statistics.fmean(per),
        "windows": n,
        "window": window,
        "per_window_ms": per,
    }


def pool_repeats(repeats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One result from repeated measurements of the same algorithm: statistics over all their
    windows together, per-iteration averages of the counters, and each repeat's median (drift).

    Args:
        repeats: :func:`window_stats` outputs extended with ``iteration_ms``, ``iterations``,
            ``rank_median_ms``, ``bytes_per_iter``, ``peak_bytes_per_step``, ``bytes_computed``
            and, for hvd_slowmo, ``phase_ms_per_iter`` and ``bytes_per_outer_step``; the
            workers' peak resident memory ``max_rss_mb`` where measured (the largest is kept), and
            hvd_slowmo's ``held_bytes`` per part (:func:`hvd_slowmo.memory.held_bytes`).
    """
    if not repeats:
        raise ValueError("pool_repeats needs at least one measurement")
    per = [ms for r in repeats for ms in r["per_window_ms"]]
    out: dict[str, Any] = {
        "median_ms": statistics.median(per),
        "min_ms": min(per),
        "max_ms": max(per),
        "mean_ms": statistics.fmean(per),
        "windows": len(per),
        "window": repeats[0]["window"],
        "per_window_ms": per,
        "iteration_ms": [ms for r in repeats for ms in r["iteration_ms"]],
        "iterations": sum(r["iterations"] for r in repeats),
        "repeat_median_ms": [r["median_ms"] for r in repeats],
        "rank_median_ms": [r["rank_median_ms"] for r in repeats],
        "bytes_per_iter": statistics.fmean(r["bytes_per_iter"] for r in repeats),
        "peak_bytes_per_step": max(r.get("peak_bytes_per_step", 0) for r in repeats),
        "bytes_computed": repeats[0]["bytes_computed"],
    }
    if all("max_rss_mb" in r for r in repeats):
        out["max_rss_mb"] = max(r["max_rss_mb"] for r in repeats)
    if all(r.get("held_bytes") for r in repeats):  # hvd_slowmo's parts (the last repeat's)
        out["held_bytes"] = repeats[-1]["held_bytes"]
    if all("bytes_per_outer_step" in r for r in repeats):
        out["bytes_per_outer_step"] = statistics.fmean(r["bytes_per_outer_step"] for r in repeats)
    if "phase_ms_per_iter" in repeats[0]:
        out["phase_ms_per_iter"] = {
            k: statistics.fmean(r["phase_ms_per_iter"][k] for r in repeats)
            for k in repeats[0]["phase_ms_per_iter"]
        }
    return out


def cluster_stamps(rank_stamps: Sequence[Sequence[float]]) -> list[float]:
    """When every worker had finished each iteration: the element-wise max over ranks of their
    stamps relative to their own start (all start right after a barrier).

    A synchronous job runs at its slowest worker's pace, so the compute-only limit is the
    slowest worker's time, not rank 0's.

    Args:
        rank_stamps: per rank, ``perf_counter`` seconds at the start and after each iteration.
    """
    lengths = {len(s) for s in rank_stamps}
    if len(lengths) != 1:
        raise ValueError(
            f"every rank must report the same number of stamps, got lengths {sorted(lengths)}"
        )
    return [max(s[k] - s[0] for s in rank_stamps) for k in range(lengths.pop())]


def ring_bytes(payload_bytes: int, size: int) -> int:
    """Bytes one worker sends in a ring allreduce of ``payload_bytes`` over ``size`` workers.

    Args:
        payload_bytes: the reduced tensors' total size.
        size: number of workers.
    """
    return int(2 * (size - 1) / size * payload_bytes) if size > 1 else 0


def hidden_fraction(
    t_exposed: float | None, t_overlapped: float | None, t_compute: float | None
) -> float | None:
    """The share of some communication that overlapping hides behind compute:
    ``(t_exposed - t_overlapped) / (t_exposed - t_compute)``.

    1 means the overlapped run reached the compute-only limit, 0 that it gained nothing; load noise
    can push it past either end. ``None`` when a time is missing or the exposed run shows no
    communication to hide (``t_exposed <= t_compute``).

    Args:
        t_exposed: ms/iteration without overlap (e.g. Local SGD + SlowMo, or SGP).
        t_overlapped: ms/iteration of the same algorithm with overlap (``overlap=d``, or OSGP).
        t_compute: ms/iteration of compute only.
    """
    if t_exposed is None or t_overlapped is None or t_compute is None or t_exposed <= t_compute:
        return None
    return (t_exposed - t_overlapped) / (t_exposed - t_compute)


def summarize(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Ratios of every measured algorithm against AR-SGD and the compute-only limit.

    Args:
        results: ``{algorithm key: {"median_ms": ..., ...}}``; absent or unavailable entries are
            skipped.

    Returns:
        ``{"rows": {key: ratios}, "targets": {...}}``: ``speedup_vs_ar`` = T_AR / T;
        ``over_compute`` = T / T_compute; ``over_ideal`` = T / (T_compute + payload * AR_comm / tau)
        for the periodic-average algorithms, where AR_comm = T_AR - T_compute.
    """

    def t(key: str) -> float | None:
        r = results.get(key)
        return r["median_ms"] if r and r.get("median_ms") is not None else None

    comp, ar = t("compute"), t("horovod_ar")
    ar_comm = ar - comp if ar is not None and comp is not None else None
    rows: dict[str, dict[str, float | None]] = {}
    for key, _ in results.items():
        ms = t(key)
        if ms is None:
            continue
        algo = ALGORITHM_BY_KEY.get(key)
        ideal = None
        if algo is not None and algo.periodic and ar_comm is not None:
            ideal = comp + algo.payload * ar_comm / algo.tau
        rows[key] = {
            "ms": ms,
            "speedup_vs_ar": ar / ms if ar is not None else None,
            "over_compute": ms / comp if comp else None,
            "ideal_ms": ideal,
            "over_ideal": ms / ideal if ideal else None,
        }

    def ratio(a: str, b: str) -> float | None:
        return t(a) / t(b) if t(a) is not None and t(b) else None

    targets: dict[str, Any] = {
        "ar_comm_ms": ar_comm,
        "ar_comm_fraction": ar_comm / ar if ar_comm is not None and ar else None,
        "localsgd_slowmo_over_ideal": rows.get("localsgd_slowmo", {}).get("over_ideal"),
        "localsgd_slowmo_speedup_vs_ar": rows.get("localsgd_slowmo", {}).get("speedup_vs_ar"),
        "localsgd_slowmo_nocheck_over_ideal": rows.get("localsgd_slowmo_nocheck", {}).get(
            "over_ideal"
        ),
    }
    for _, orig, slow in TABLE2_ROWS:
        targets[f"{slow}_over_{orig}"] = ratio(slow, orig)
        # What SlowMo itself costs, timed inside the optimizer (the slow update, anchor copy and
        # buffer reset): unlike the difference of two runs, this is not scattered by other load.
        phases = results.get(slow, {}).get("phase_ms_per_iter")
        targets[f"{slow}_slow_update_fraction"] = (
            phases["slow_update"] / t(slow) if phases and t(slow) else None
        )
    # The part of SGP's gossip overhead (over compute only) that OSGP's overlap removes.
    for suffix in ("", "_slowmo"):
        targets[f"osgp{suffix}_hidden_fraction"] = hidden_fraction(
            t("sgp" + suffix), t("osgp" + suffix), comp
        )
    # The part of the exact average (the overhead over compute only) that overlap=d hides.
    for overlapped, exposed in OVERLAP_ROWS:
        targets[f"{overlapped}_hidden_fraction"] = hidden_fraction(t(exposed), t(overlapped), comp)
    # Against the peers: hvd_slowmo's row over PyTorch's same algorithm (< 1: hvd_slowmo faster).
    targets["localsgd_over_torch_postlocal"] = ratio("localsgd", "torch_postlocal")
    targets["allreduce_over_torch_ddp"] = ratio("allreduce", "torch_ddp")
    peers = [k for k in PEER_KEYS if t(k) is not None]
    fastest = min(peers, key=lambda k: t(k)) if peers else None
    targets["fastest_peer"] = fastest
    for overlapped, _ in OVERLAP_ROWS:
        targets[f"{overlapped}_over_fastest_peer"] = ratio(overlapped, fastest) if fastest else None
    return {"rows": rows, "targets": targets}
