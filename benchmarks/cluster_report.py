"""The report of ``benchmarks/cluster.py``: markdown tables shaped like the paper's Table 2,
the peers beside hvd_slowmo, the load warning, the workers sweep (table and PNG) and TensorBoard
scalars (SlowMo, arXiv 1910.00643)."""

import json
import os
from typing import Any

from cluster_algorithms import ALGORITHM_BY_KEY, OVERLAP_ROWS, PEER_ROWS, TABLE2_ROWS
from cluster_stats import summarize

__all__ = [
    "DESCRIPTIONS",
    "LOAD_LIMIT",
    "human",
    "load_warning",
    "plot_sweep",
    "render_markdown",
    "sweep_markdown",
    "sweep_table",
    "write_tensorboard",
]


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
        + (f", compute {h['compute_ms']} ms (sleep)" if h.get("compute_ms") is not None else "")
        + (
            f", {100 * h['backward_fraction']:.0f}% of it inside backward"
            if h.get("backward_fraction")
            else ""
        ),
        "",
        "Emulated with network namespaces + veth + bridge, `tc tbf` both directions; "
        f"Horovod {h.get('horovod', '?')} "
        f"Gloo; {h['cpu_cores']} CPU cores shared by all hosts. "
        "ms/iteration: median over windows of one outer "
        "period (tau iterations), [min-max] over windows, timed by the slowest worker; "
        f"{h.get('repeats', 1)} repeat(s) of the whole list in alternating order; workers at nice "
        f"{h.get('nice', 0)}; 1-minute load average {_fmt(load[0], '.1f')} before, "
        f"{_fmt(load[1], '.1f')} after.",
        *([f"**{warning}**", ""] if (warning := load_warning(*load)) else []),
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
        "bytes sent / worker / it | peak bytes / worker / step |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, r in results.items():
        algo = ALGORITHM_BY_KEY[key]
        if not r.get("available", True):
            out.append(
                f"| {algo.label} | {algo.tau} | not available ({r.get('reason', '')}) | | | | | |"
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
            f"{_fmt(row['over_ideal'], '.3f', 'x')} | {sent} | "
            f"{_fmt_bytes(r.get('peak_bytes_per_step'))} |"
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


# Each scalar family's description, shown with its chart in TensorBoard (the same summaries as
# slowmo_lab's training scalars: slowmo_lab.dashboard.scalar_summary). Tags are
# SCOPE/FAMILY/ALGORITHM, SCOPE = workload_parameters/link rate.
DESCRIPTIONS = {
    "ms_per_iter_window": "Milliseconds per training iteration in each window of one outer "
    "period (`tau` iterations, so each window holds one average), the workers' clocks merged "
    "(an iteration ends when the slowest worker's does). The x axis is the window's index.",
    "ms_per_iter_median": "The median of the windows' milliseconds per iteration: the figure of "
    "the report's tables.",
    "speedup_vs_ar": "AR-SGD's (Horovod allreduce every step) median ms per iteration over this "
    "algorithm's: above 1, this algorithm is faster.",
    "over_compute": "This algorithm's median ms per iteration over the compute-only row's (no "
    "communication): 1 is compute alone.",
    "ideal_ms": "The ms per iteration of this periodic-average algorithm if its average cost "
    "AR-SGD's communication, scaled by the volume it averages (payload, relative to the "
    "parameters), once per `tau` iterations: compute + payload * (AR-SGD - compute) / tau.",
    "over_ideal": "This algorithm's median ms per iteration over its ideal (`ideal_ms`): the "
    "overhead beyond averaging less often.",
    "bytes_per_iter": "Bytes one worker sent per iteration: counted by hvd_slowmo's "
    "communicator for its algorithms, computed from Gloo's ring volume for the peers "
    "(Horovod, DDP, post-local SGD); the report marks which.",
}


def write_tensorboard(logdir: str, runs: list[dict[str, Any]]) -> None:
    """The runs' timings as TensorBoard scalars, each family with its description.

    Args:
        logdir: the event files' folder.
        runs: ``{"header": ..., "results": ...}`` of each run, as in results.json.
    """
    from torch.utils.tensorboard import SummaryWriter

    from slowmo_lab.dashboard import scalar_summary

    with SummaryWriter(logdir) as w:

        def scalar(scope: str, family: str, key: str, value: float, step: int) -> None:
            # TensorBoard keeps a tag's first metadata: the description goes with step 0 only.
            text = DESCRIPTIONS[family] if step == 0 else None
            summary = scalar_summary(f"{scope}/{family}/{key}", value, text)
            w.file_writer.add_summary(summary, step)

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
                    scalar(scope, "ms_per_iter_window", key, ms, i)
                scalar(scope, "ms_per_iter_median", key, r["median_ms"], 0)
                for name, value in summary["rows"][key].items():
                    if value is not None and name != "ms":
                        scalar(scope, name, key, value, 0)
                if r.get("bytes_per_iter") is not None:
                    scalar(scope, "bytes_per_iter", key, r["bytes_per_iter"], 0)


def human(n: int) -> str:
    for suffix, scale in (("G", 10**9), ("M", 10**6), ("k", 10**3)):
        if n >= scale:
            return f"{n / scale:.3g}{suffix}"
    return str(n)


#: A 1-minute load average above this (on the benchmark's machine) makes the times unreliable.
LOAD_LIMIT = 1.5


def load_warning(before: float | None, after: float | None) -> str | None:
    """A loud warning when the machine was busy around a measurement, else None.

    Every emulated host shares this machine's cores: other work stretches and scatters the
    times, and not every algorithm alike.

    Args:
        before: the 1-minute load average before the measurement.
        after: the same after it.
    """
    worst = max((x for x in (before, after) if x is not None), default=None)
    if worst is None or worst <= LOAD_LIMIT:
        return None
    return (
        f"WARNING: 1-minute load average {_fmt(before, '.2f')} before, {_fmt(after, '.2f')} "
        f"after (above {LOAD_LIMIT}): other work shared the CPU, so these times are not "
        "timings; rerun on a quiet machine"
    )


def _sweep_key(run: dict[str, Any]) -> tuple:
    h = run["header"]
    return (h["workload"], h.get("params_human"), h["rate"], h.get("backward_fraction", 0.0))


def sweep_table(runs: list[dict[str, Any]]) -> dict[tuple, dict[str, dict[int, float]]]:
    """ms/iteration per algorithm and number of hosts, for each (workload, size, rate, backward
    share) measured at several host counts.

    Args:
        runs: the harness's runs (each with ``header["hosts"]``).

    Returns:
        ``{(workload, size, rate, backward_fraction): {algorithm key: {hosts: median ms}}}``.
    """
    out: dict[tuple, dict[str, dict[int, float]]] = {}
    for run in runs:
        per_algo = out.setdefault(_sweep_key(run), {})
        for key, r in run["results"].items():
            if r.get("available", True):
                per_algo.setdefault(key, {})[run["header"]["hosts"]] = r["median_ms"]
    return out


def sweep_markdown(runs: list[dict[str, Any]]) -> str:
    """The sweep as markdown: one table per (workload, size, rate, backward share), a row per
    algorithm, a column per number of hosts.

    Args:
        runs: the harness's runs.
    """
    out = []
    for (workload, size, rate, back), per_algo in sweep_table(runs).items():
        hosts = sorted({n for ms in per_algo.values() for n in ms})
        out += [
            f"### ms/iteration vs workers: {workload} {size or ''} at {rate}, "
            f"{100 * back:.0f}% of the compute in backward",
            "",
            "| algorithm | " + " | ".join(f"{n} hosts" for n in hosts) + " |",
            "|---|" + "---|" * len(hosts),
        ]
        for key, ms in per_algo.items():
            cells = " | ".join(_fmt(ms.get(n), ".0f") for n in hosts)
            out.append(f"| {ALGORITHM_BY_KEY[key].label} | {cells} |")
        out.append("")
    return "\n".join(out)


def plot_sweep(runs: list[dict[str, Any]], folder: str) -> list[str]:
    """Plot ms/iteration vs workers, one line per algorithm, one PNG per (workload, size, rate,
    backward share).

    Args:
        runs: the harness's runs.
        folder: where the PNGs go.

    Returns:
        The paths written.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    for (workload, size, rate, back), per_algo in sweep_table(runs).items():
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for key, ms in per_algo.items():
            hosts = sorted(ms)
            ax.plot(hosts, [ms[n] for n in hosts], marker="o", label=ALGORITHM_BY_KEY[key].label)
        ax.set_xlabel("workers (emulated hosts)")
        ax.set_ylabel("ms / iteration (median)")
        ax.set_xticks(sorted({n for ms in per_algo.values() for n in ms}))
        ax.set_title(
            f"{workload} {size or ''}, {rate} links, {100 * back:.0f}% compute in backward"
        )
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        name = f"sweep_{workload}_{size or 'model'}_{rate}_bw{100 * back:.0f}.png"
        path = os.path.join(folder, name)
        fig.savefig(path, dpi=120)
        plt.close(fig)
        paths.append(path)
    return paths
