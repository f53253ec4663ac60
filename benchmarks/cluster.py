"""Time per iteration of SlowMo and its bases on an emulated multi-host cluster (arXiv 1910.00643).

Builds N emulated hosts on this machine (one network namespace each, a veth to a Linux bridge in a
switch namespace, every link limited with ``tc tbf`` in both directions), runs one Horovod (Gloo)
worker per host, and measures in the same processes: compute only (the limit), Horovod's own
``hvd.DistributedOptimizer`` (AR-SGD), the peers PyTorch ships (DDP's AR-SGD and post-local SGD,
over ``torch.distributed`` with Gloo), and hvd_slowmo's algorithms. Prints a table shaped like the
paper's Table 2 (original vs with SlowMo), one of the peers beside hvd_slowmo's rows, writes the
raw numbers as JSON and TensorBoard scalars.

Needs root and ``ip netns``. Example (4 hosts, 1 Gbit/s links, synthetic 1M-parameter model)::

    sudo .venv/bin/python benchmarks/cluster.py --hosts 4 --rate 1gbit --workload synthetic \\
        --params 1M --compute-ms 190 --iters 24 --windows 2 --repeats 2 --nice -10 \\
        --out runs/cluster

(``--compute-ms`` sets the regime: there AR-SGD spends about a third of its time communicating.)
The peers against hvd_slowmo, 10M parameters and 1 s of compute, at 1 Gbit/s and 100 Mbit/s::

    sudo .venv/bin/python benchmarks/cluster.py --hosts 4 --rate 1gbit --rate 100mbit \\
        --params 10M --compute-ms 1000 --iters 12 --windows 2 --algorithms peers

The namespaces, links and ``/etc/netns`` files are removed afterwards, also on Ctrl-C / SIGTERM,
and stale ones from a crashed run with the same ``--prefix`` are removed before starting.
Only ratios measured within one run mean anything: all hosts share this machine's CPU cores.
"""

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

# The repository's package, also when run as a script from a fresh clone.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The emulated hosts (namespaces, links, shaping, the workers' launch) live in the library.
from hvd_slowmo.tools.netns import (
    Cluster,
    ClusterPlan,
    Host,
    hosts_file,
    parse_rate,
    plan_cluster,
    setup_commands,
    shaping_commands,
    stale_namespaces,
    tbf_args,
    teardown_commands,
    worker_env,
)

__all__ = [
    "ALGORITHMS",
    "Algorithm",
    "Host",
    "ClusterPlan",
    "parse_rate",
    "parse_count",
    "tbf_args",
    "plan_cluster",
    "setup_commands",
    "shaping_commands",
    "teardown_commands",
    "stale_namespaces",
    "hosts_file",
    "worker_env",
    "Cluster",
    "cluster_stamps",
    "window_stats",
    "pool_repeats",
    "ring_bytes",
    "summarize",
    "render_markdown",
    "WARMUP_ITERS",
    "KINDS",
    "PEER_ROWS",
    "PEER_KEYS",
    "OVERLAP_ROWS",
    "ALGORITHM_SETS",
    "select_algorithms",
    "hidden_fraction",
]

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster_worker.py")


# --- the algorithms measured ----------------------------------------------------------------------
#: Untimed iterations before each algorithm's timed ones. The timed windows then start two steps
#: after an outer step, so an average started at an outer step and applied up to two steps later
#: (``overlap`` <= 2) falls in the same window as its start: every window holds one of each.
WARMUP_ITERS = 2


@dataclass(frozen=True)
class Algorithm:
    """One measured configuration.

    Args:
        key: short identifier (JSON key, TensorBoard tag).
        label: the row label in the table.
        kind: ``"compute"`` (no communication), ``"horovod"`` (``hvd.DistributedOptimizer``),
            ``"slowmo"`` (``hvd_slowmo.DistributedOptimizer``), or a PyTorch peer over
            ``torch.distributed`` (Gloo): ``"ddp"`` (``DistributedDataParallel``, AR-SGD) or
            ``"postlocal"`` (``PostLocalSGDOptimizer`` + ``PeriodicModelAverager(period=tau)``).
        base: hvd_slowmo base algorithm (``kind == "slowmo"`` only).
        tau: base steps per outer step (the averaging period for ``"postlocal"``).
        options: further ``hvd_slowmo.DistributedOptimizer`` keyword arguments.
        periodic: averages only every ``tau`` steps, so ``compute + AR_comm * payload / tau`` is
            its ideal.
        payload: exact-average volume relative to the parameters (2 when optimizer buffers are
            averaged too).
    """

    key: str
    label: str
    kind: str
    base: str = ""
    tau: int = 1
    options: dict[str, Any] = field(default_factory=dict)
    periodic: bool = False
    payload: float = 1.0

    @property
    def overlap(self) -> int:
        """Inner steps the exact average runs behind (hvd_slowmo's ``overlap`` option; 0: none)."""
        return int(self.options.get("overlap", 0))


KINDS = ("compute", "horovod", "slowmo", "ddp", "postlocal")
_SLOWMO = {"slow_lr": 1.0, "slow_momentum": 0.6}
_PLAIN = {"slow_lr": 1.0, "slow_momentum": 0.0}  # slow update off: the base algorithm alone

#: Measured in this order, every one in the same worker processes.
ALGORITHMS: tuple[Algorithm, ...] = (
    Algorithm("compute", "compute only (no communication)", "compute"),
    Algorithm("horovod_ar", "AR-SGD (hvd.DistributedOptimizer)", "horovod"),
    Algorithm("torch_ddp", "AR-SGD (torch DistributedDataParallel, Gloo)", "ddp"),
    # tau=1 with buffers kept: momentum must survive every "outer step" to be plain AR-SGD.
    Algorithm(
        "allreduce",
        "AR-SGD (hvd_slowmo base=allreduce)",
        "slowmo",
        "allreduce",
        1,
        {**_PLAIN, "buffers": "maintain"},
    ),
    # The same without the per-outer-step NaN/inf check (one small allgather): what that check
    # costs.
    Algorithm(
        "allreduce_nocheck",
        "AR-SGD (hvd_slowmo base=allreduce, nonfinite='ignore')",
        "slowmo",
        "allreduce",
        1,
        {**_PLAIN, "buffers": "maintain", "nonfinite": "ignore"},
    ),
    Algorithm(
        "torch_postlocal",
        "Local SGD (torch PostLocalSGDOptimizer, Gloo)",
        "postlocal",
        tau=12,
        periodic=True,
    ),
    Algorithm(
        "localsgd",
        "Local SGD",
        "slowmo",
        "localsgd",
        12,
        {**_PLAIN, "buffers": "reset"},
        periodic=True,
    ),
    Algorithm(
        "localsgd_slowmo",
        "Local SGD + SlowMo",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset"},
        periodic=True,
    ),
    Algorithm(
        "localsgd_slowmo_overlap1",
        "Local SGD + SlowMo, overlap=1",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset", "overlap": 1},
        periodic=True,
    ),
    Algorithm(
        "localsgd_slowmo_overlap2",
        "Local SGD + SlowMo, overlap=2",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset", "overlap": 2},
        periodic=True,
    ),
    Algorithm(
        "localsgd_slowmo_nocheck",
        "Local SGD + SlowMo, nonfinite='ignore'",
        "slowmo",
        "localsgd",
        12,
        {**_SLOWMO, "buffers": "reset", "nonfinite": "ignore"},
        periodic=True,
    ),
    Algorithm(
        "double_avg",
        "double averaging (Local SGD, buffers averaged)",
        "slowmo",
        "localsgd",
        12,
        {**_PLAIN, "buffers": "average"},
        periodic=True,
        payload=2.0,
    ),
    Algorithm("sgp", "SGP", "slowmo", "sgp", 48, {**_PLAIN, "buffers": "reset"}),
    Algorithm("sgp_slowmo", "SGP + SlowMo", "slowmo", "sgp", 48, {**_SLOWMO, "buffers": "reset"}),
    Algorithm(
        "sgp_slowmo_noavg",
        "SGP + SlowMo, no exact average",
        "slowmo",
        "sgp",
        48,
        {**_SLOWMO, "buffers": "reset", "average": False},
    ),
    Algorithm("osgp", "OSGP", "slowmo", "osgp", 48, {**_PLAIN, "buffers": "reset"}),
    Algorithm(
        "osgp_slowmo", "OSGP + SlowMo", "slowmo", "osgp", 48, {**_SLOWMO, "buffers": "reset"}
    ),
)
ALGORITHM_BY_KEY = {a.key: a for a in ALGORITHMS}
#: Rows of the paper-shaped table: (label, original, with SlowMo).
TABLE2_ROWS = (
    ("Local SGD", "localsgd", "localsgd_slowmo"),
    ("SGP", "sgp", "sgp_slowmo"),
    ("OSGP", "osgp", "osgp_slowmo"),
)
#: Rows of the peers table: (family, keys shown side by side), PyTorch's and Horovod's first.
PEER_ROWS = (
    ("AR-SGD", ("torch_ddp", "horovod_ar", "allreduce")),
    (
        "Local SGD (tau=12)",
        (
            "torch_postlocal",
            "localsgd",
            "localsgd_slowmo",
            "localsgd_slowmo_overlap1",
            "localsgd_slowmo_overlap2",
        ),
    ),
)
#: Keys of the rows that come from PyTorch or Horovod rather than hvd_slowmo.
PEER_KEYS = ("torch_ddp", "horovod_ar", "torch_postlocal")
#: Overlapped rows and the row they hide the exact average of (the same run with overlap=0).
OVERLAP_ROWS = (
    ("localsgd_slowmo_overlap1", "localsgd_slowmo"),
    ("localsgd_slowmo_overlap2", "localsgd_slowmo"),
)
#: Names ``--algorithms`` accepts for a list of keys.
ALGORITHM_SETS = {
    "all": tuple(a.key for a in ALGORITHMS),
    "peers": ("compute",) + tuple(k for _, keys in PEER_ROWS for k in keys),
}


def select_algorithms(text: str) -> list[str]:
    """The algorithm keys ``--algorithms`` names, in measuring order, each once.

    Args:
        text: comma-separated keys of :data:`ALGORITHMS` and/or set names (``all``, ``peers``).

    Raises:
        ValueError: an unknown name, or nothing selected.
    """
    names = [t.strip() for t in str(text).split(",") if t.strip()]
    unknown = [n for n in names if n not in ALGORITHM_BY_KEY and n not in ALGORITHM_SETS]
    if unknown:
        raise ValueError(
            f"--algorithms: unknown {unknown}; choose from {sorted(ALGORITHM_SETS)} "
            f"or {[a.key for a in ALGORITHMS]}"
        )
    chosen = {k for n in names for k in ALGORITHM_SETS.get(n, (n,))}
    if not chosen:
        raise ValueError(
            "--algorithms selects nothing; give e.g. 'all', 'peers' or 'compute,localsgd'"
        )
    return [a.key for a in ALGORITHMS if a.key in chosen]


# --- parsing --------------------------------------------------------------------------------------
def parse_count(text: str) -> int:
    """Parameter count from ``"10M"``, ``"1.5M"``, ``"500k"`` or ``"123456"``.

    Args:
        text: the count, with an optional ``k``/``M``/``G`` suffix.
    """
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgG]?)", str(text).strip())
    if not m:
        raise ValueError(f"--params entries must look like 1M, 10M, 500k or 123456, got {text!r}")
    value = int(float(m.group(1)) * {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2).lower()])
    if value < 1:
        raise ValueError(f"--params entries must be at least 1 parameter, got {text!r}")
    return value


# --- statistics and the table ---------------------------------------------------------------------
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
            ``rank_median_ms``, ``bytes_per_iter``, ``bytes_computed`` and, for hvd_slowmo,
            ``phase_ms_per_iter``.
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
        "bytes_computed": repeats[0]["bytes_computed"],
    }
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


def _fmt(x: float | None, spec: str = ".0f", suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def _fmt_bytes(b: float | None) -> str:
    if b is None:
        return "n/a"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if b >= scale:
            return f"{b / scale:.2f} {unit}"
    return f"{b:.0f} B"


def render_markdown(run: dict[str, Any]) -> str:
    """The report of one (workload, rate) measurement as markdown.

    Args:
        run: ``{"header": {...}, "results": {key: {...}}}`` as written by the harness; results
            entries may be ``{"available": False, "reason": ...}``.
    """
    h, results = run["header"], run["results"]
    summary = summarize({k: v for k, v in results.items() if v.get("available", True)})
    rows, tg = summary["rows"], summary["targets"]
    load = h.get("load_avg_1min", [None, None])
    out = [
        f"### {h['workload']} ({h['params_human']} parameters, "
        f"{_fmt_bytes(h['param_bytes'])} fp32), "
        f"{h['hosts']} hosts, {h['rate']} links"
        + (f", compute {h['compute_ms']} ms (sleep)" if h.get("compute_ms") is not None else ""),
        "",
        "Emulated with network namespaces + veth + bridge, `tc tbf` both directions; "
        f"Horovod {h.get('horovod', '?')} "
        f"Gloo; {h['cpu_cores']} CPU cores shared by all hosts. "
        "ms/iteration: median over windows of one outer "
        "period (tau iterations), [min-max] over windows, timed by the slowest worker; "
        f"{h.get('repeats', 1)} repeat(s) of the whole list in alternating order; workers at nice "
        f"{h.get('nice', 0)}; 1-minute load average {_fmt(load[0], '.1f')} before, "
        f"{_fmt(load[1], '.1f')} after.",
        "",
        "Paper Table 2 shape (ms/iteration, speed-up over AR-SGD):",
        "",
        "| base algorithm | tau | original | w/ SlowMo | SlowMo overhead |",
        "|---|---|---|---|---|",
    ]

    def cell(key: str) -> str:
        r = results.get(key)
        if r is None:
            return "not run"
        if not r.get("available", True):
            return "not available"
        return f"{r['median_ms']:.0f} ms ({_fmt(rows[key]['speedup_vs_ar'], '.2f', 'x')})"

    for label, orig, slow in TABLE2_ROWS:
        over = tg.get(f"{slow}_over_{orig}")
        out.append(
            f"| {label} | {ALGORITHM_BY_KEY[orig].tau} | {cell(orig)} | {cell(slow)} | "
            f"{_fmt(None if over is None else 100 * (over - 1), '+.1f', '%')} |"
        )
    out += _peer_table(results, rows, tg)
    out += [
        "",
        "| algorithm | tau | ms/it median [min-max] | speed-up vs AR-SGD | / compute | / ideal | "
        "bytes sent / worker / it |",
        "|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        algo = ALGORITHM_BY_KEY[key]
        if not r.get("available", True):
            out.append(
                f"| {algo.label} | {algo.tau} | not available ({r.get('reason', '')}) | | | | |"
            )
            continue
        row = rows[key]
        sent = _fmt_bytes(r.get("bytes_per_iter")) + (
            " (computed)" if r.get("bytes_computed") else ""
        )
        out.append(
            f"| {algo.label} | {algo.tau} | "
            f"{r['median_ms']:.1f} [{r['min_ms']:.1f}-{r['max_ms']:.1f}] | "
            f"{_fmt(row['speedup_vs_ar'], '.2f', 'x')} | {_fmt(row['over_compute'], '.2f', 'x')} | "
            f"{_fmt(row['over_ideal'], '.3f', 'x')} | {sent} |"
        )

    out += [
        "",
        f"- AR-SGD communication: {_fmt(tg['ar_comm_ms'], '.1f', ' ms')} per iteration, "
        f"{_pct(tg['ar_comm_fraction'])} of its time.",
        "- Local SGD + SlowMo vs its ideal `compute + AR_comm/12`: "
        f"{_excess(tg['localsgd_slowmo_over_ideal'])} (target: within 5%); without the "
        "per-outer-step NaN/inf check (nonfinite='ignore'): "
        f"{_excess(tg['localsgd_slowmo_nocheck_over_ideal'])}.",
        "- Local SGD + SlowMo speed-up over AR-SGD: "
        f"{_fmt(tg['localsgd_slowmo_speedup_vs_ar'], '.2f', 'x')} "
        "(target: >= 1.45x where AR-SGD spends a third of its time communicating).",
    ]
    for label, orig, slow in TABLE2_ROWS:
        over = tg.get(f"{slow}_over_{orig}")
        own = tg.get(f"{slow}_slow_update_fraction")
        out.append(
            f"- SlowMo over {label}: {_excess(over)} (target: <= 2%); its slow-update "
            f"phase, timed inside the optimizer: {_pct(own)} of the iteration."
        )
    for suffix, label in (("", "OSGP"), ("_slowmo", "OSGP + SlowMo")):
        out.append(
            f"- {label} hides {_pct(tg[f'osgp{suffix}_hidden_fraction'])} of SGP's "
            "communication time (1 - (T_OSGP - T_compute) / (T_SGP - T_compute))."
        )
    out += _peer_bullets(results, rows, tg)
    return "\n".join(out) + "\n"


def _pct(x: float | None, spec: str = ".1f") -> str:
    return _fmt(None if x is None else 100 * x, spec, "%")


def _excess(ratio: float | None, spec: str = "+.1f") -> str:
    """A time ratio as the percentage it is above (or below) 1."""
    return _pct(None if ratio is None else ratio - 1, spec)


def _peer_table(
    results: dict[str, dict[str, Any]], rows: dict[str, dict[str, float | None]], tg: dict[str, Any]
) -> list[str]:
    """The peers table's lines: PyTorch's and Horovod's rows beside hvd_slowmo's, per family
    (none when no row of :data:`PEER_ROWS` was measured)."""
    hidden = {o: tg.get(f"{o}_hidden_fraction") for o, _ in OVERLAP_ROWS}
    out = [
        "",
        "Beside the peers (same hosts, workload, run and processes; time per iteration with "
        "speed-up over Horovod's AR-SGD; exact average hidden = "
        "(T_no_overlap - T) / (T_no_overlap - T_compute)):",
        "",
        "| family | algorithm | ms/it (speed-up) | / compute | exact average hidden |",
        "|---|---|---|---|---|",
    ]
    n = len(out)
    for family, keys in PEER_ROWS:
        for key in keys:
            r = results.get(key)
            if r is None:
                continue
            label = ALGORITHM_BY_KEY[key].label
            if not r.get("available", True):
                out.append(f"| {family} | {label} | not available | | |")
                continue
            ms = f"{r['median_ms']:.0f} ({_fmt(rows[key]['speedup_vs_ar'], '.2f', 'x')})"
            comp = _fmt(rows[key]["over_compute"], ".3f", "x")
            out.append(
                f"| {family} | {label} | {ms} | {comp} | "
                f"{_pct(hidden[key], '.0f') if key in hidden else ''} |"
            )
    return out if len(out) > n else []


def _peer_bullets(
    results: dict[str, dict[str, Any]], rows: dict[str, dict[str, float | None]], tg: dict[str, Any]
) -> list[str]:
    """The targets against the peers (issue 14), for the rows that were measured."""
    out = []
    if "torch_postlocal" in results or "localsgd" in results:
        out.append(
            f"- hvd_slowmo Local SGD vs torch's post-local SGD (tau=12): "
            f"{_excess(tg['localsgd_over_torch_postlocal'])} (target: <= 0%)."
        )
    if "torch_ddp" in results or "allreduce" in results:
        out.append(
            "- hvd_slowmo AR-SGD (base=allreduce) vs torch's DDP: "
            f"{_excess(tg['allreduce_over_torch_ddp'])}."
        )
    fastest = tg.get("fastest_peer")
    for overlapped, _ in OVERLAP_ROWS:
        r = results.get(overlapped)
        if r is None:
            continue
        label = ALGORITHM_BY_KEY[overlapped].label
        if not r.get("available", True):
            out.append(f"- {label}: not available (the reason is in its row above).")
            continue
        comp = rows[overlapped]["over_compute"]
        peer = (
            f"{_excess(tg[f'{overlapped}_over_fastest_peer'])} vs the fastest peer row "
            f"({ALGORITHM_BY_KEY[fastest].label}; target: < 0%)"
            if fastest
            else "no peer row measured"
        )
        hidden = _pct(tg[f"{overlapped}_hidden_fraction"], ".0f")
        out.append(
            f"- {label}: {_excess(comp)} over compute only (target at 1gbit, 10M params, "
            f"1 s compute: within 2%); hides {hidden} of the exact average; {peer}."
        )
    return out


# --- running it (root only) -----------------------------------------------------------------------
def _terminate(signum: int, frame: Any) -> None:
    # Turn SIGTERM/SIGHUP into an exception so the finally-block teardown runs.
    print(f"signal {signum}: tearing the cluster down", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def _launch(cluster: Cluster, worker_args: list[str], timeout_s: float, nice: int) -> None:
    cluster.run([sys.executable, WORKER, *worker_args], timeout_s, nice)


def _write_tensorboard(logdir: str, runs: list[dict[str, Any]]) -> None:
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(logdir) as w:
        for run in runs:
            h = run["header"]
            scope = f"{h['workload']}_{h['params_human']}/{h['rate']}"
            w.add_text(f"{scope}/header", json.dumps(h, indent=1).replace("\n", "  \n"))
            summary = summarize(
                {k: v for k, v in run["results"].items() if v.get("available", True)}
            )
            for key, r in run["results"].items():
                if not r.get("available", True):
                    continue
                for i, ms in enumerate(r["per_window_ms"]):
                    w.add_scalar(f"{scope}/ms_per_iter_window/{key}", ms, i)
                w.add_scalar(f"{scope}/ms_per_iter_median/{key}", r["median_ms"], 0)
                for name, value in summary["rows"][key].items():
                    if value is not None and name != "ms":
                        w.add_scalar(f"{scope}/{name}/{key}", value, 0)
                if r.get("bytes_per_iter") is not None:
                    w.add_scalar(f"{scope}/bytes_per_iter/{key}", r["bytes_per_iter"], 0)


def _human(n: int) -> str:
    for suffix, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


def main(argv: Sequence[str] | None = None) -> int:
    """Parse arguments, build the cluster, measure, report, tear down.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
    """
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hosts", type=int, default=4, help="emulated hosts, one Horovod worker each")
    p.add_argument(
        "--rate", action="append", help="link rate, tc syntax (repeatable): 1gbit, 100mbit"
    )
    p.add_argument(
        "--workload", choices=["synthetic", "resnet18", "transformer"], default="synthetic"
    )
    p.add_argument(
        "--params", default="10M", help="synthetic model sizes, comma separated: 1M,10M,50M"
    )
    p.add_argument(
        "--compute-ms",
        default="100",
        help="synthetic compute per iteration (sleep), one value or one per --params entry",
    )
    p.add_argument(
        "--iters",
        type=int,
        default=48,
        help="timed iterations per algorithm (raised to at least --windows outer periods)",
    )
    p.add_argument(
        "--windows", type=int, default=3, help="minimum timed outer periods per algorithm"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measure the whole list this often, in alternating order (cancels slow drift)",
    )
    p.add_argument(
        "--batch-size", type=int, default=8, help="batch size of the resnet18/transformer workloads"
    )
    p.add_argument(
        "--algorithms",
        default="all",
        help="comma-separated keys or sets, measured in the order listed here; sets: "
        + ", ".join(ALGORITHM_SETS)
        + "; keys: "
        + ", ".join(a.key for a in ALGORITHMS),
    )
    p.add_argument(
        "--nice",
        type=int,
        default=0,
        help="scheduling priority of the workers (-20..19); negative keeps other load on a shared "
        "machine from queueing their short CPU bursts",
    )
    p.add_argument("--prefix", default="hsmc", help="prefix of every namespace and link created")
    p.add_argument("--subnet", default="10.77.0", help="a free /24 for the emulated hosts")
    p.add_argument(
        "--timeout", type=float, default=1800, help="seconds before the workers are killed"
    )
    p.add_argument(
        "--out", default="runs/cluster", help="output folder: results.json, table.md, tensorboard/"
    )
    args = p.parse_args(argv)
    command = [sys.executable, os.path.abspath(__file__), *(sys.argv[1:] if argv is None else argv)]

    rates = args.rate or ["1gbit"]
    for r in rates:
        parse_rate(r)
    sizes = [parse_count(s) for s in args.params.split(",")]
    compute = [float(c) for c in args.compute_ms.split(",")]
    if len(compute) not in (1, len(sizes)):
        p.error(
            f"--compute-ms needs one value or one per --params entry ({len(sizes)}), "
            f"got {len(compute)}"
        )
    if any(c < 0 for c in compute):
        p.error("--compute-ms must be >= 0")
    compute = compute * len(sizes) if len(compute) == 1 else compute
    try:
        algos = select_algorithms(args.algorithms)
    except ValueError as e:
        p.error(str(e))
    if not -20 <= args.nice <= 19:
        p.error(f"--nice must be in [-20, 19], got {args.nice}")
    if args.iters < 1 or args.windows < 1 or args.repeats < 1:
        p.error("--iters, --windows and --repeats must be >= 1")
    plan = plan_cluster(args.hosts, args.prefix, args.subnet)
    if os.geteuid() != 0:
        print(
            "cluster.py needs root (network namespaces and tc); rerun with sudo.", file=sys.stderr
        )
        return 2
    if shutil.which("ip") is None or shutil.which("tc") is None:
        print("cluster.py needs the `ip` and `tc` tools (iproute2).", file=sys.stderr)
        return 2

    workloads = (
        [{"workload": "synthetic", "params": n, "compute_ms": c} for n, c in zip(sizes, compute)]
        if args.workload == "synthetic"
        else [{"workload": args.workload, "compute_ms": None}]
    )
    os.makedirs(args.out, exist_ok=True)
    cluster = Cluster(plan)
    old_handlers = {s: signal.signal(s, _terminate) for s in (signal.SIGTERM, signal.SIGHUP)}
    runs: list[dict[str, Any]] = []
    try:
        stale = cluster.clean_stale()
        if stale:
            print(f"removed leftovers of an earlier run: {stale}", flush=True)
        cluster.build(rates[0])
        for rate in rates:
            cluster.shape(rate)
            for wl in workloads:
                raw = os.path.join(
                    args.out, f"raw_{wl['workload']}_{wl.get('params', 0)}_{rate}.json"
                )
                spec = {
                    **wl,
                    "algorithms": algos,
                    "iters": args.iters,
                    "windows": args.windows,
                    "repeats": args.repeats,
                    "batch_size": args.batch_size,
                    "output": os.path.abspath(raw),
                }
                size = f" {_human(wl['params'])}" if "params" in wl else ""
                print(
                    f"== {wl['workload']}{size} at {rate}: "
                    f"{len(algos)} algorithms on {args.hosts} hosts",
                    flush=True,
                )
                load_before = os.getloadavg()[0]
                _launch(cluster, ["--spec", json.dumps(spec)], args.timeout, args.nice)
                with open(raw) as f:
                    measured = json.load(f)
                header = {
                    **measured["header"],
                    "hosts": args.hosts,
                    "rate": rate,
                    "rate_bits_per_s": parse_rate(rate),
                    "tbf": " ".join(tbf_args(rate)),
                    "cpu_cores": os.cpu_count(),
                    "nice": args.nice,
                    # Other work on the machine inflates and scatters the times: say how much
                    # there was.
                    "load_avg_1min": [load_before, os.getloadavg()[0]],
                    "command": " ".join(command),
                }
                header["params_human"] = _human(header["params"])
                run = {"header": header, "results": measured["results"]}
                run["summary"] = summarize(
                    {k: v for k, v in run["results"].items() if v.get("available", True)}
                )
                runs.append(run)
                print(render_markdown(run), flush=True)
    except KeyboardInterrupt:
        print("interrupted: tearing the cluster down", file=sys.stderr)
        return 130
    finally:
        cluster.teardown()
        for s, h in old_handlers.items():
            signal.signal(s, h)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(runs, f, indent=1)
    with open(os.path.join(args.out, "table.md"), "w") as f:
        f.write("\n".join(render_markdown(r) for r in runs))
    _write_tensorboard(os.path.join(args.out, "tensorboard"), runs)
    print(f"wrote {args.out}/results.json, table.md, tensorboard/", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
