"""The cost model's compute utilization from 8 to 1024 workers: predictions, not measurements.

For one model size, step time, ``tau`` and workers per node, and one or more links and
latencies, prints per link and latency a Markdown table of :func:`hvd_slowmo.plan.predict`'s
compute utilization for each curve's setting (taken from
:func:`hvd_slowmo.plan.default_settings`) at each worker count, and with ``--png`` draws the
curves, one panel per link and latency, with the published utilization of
Streaming DiLoCo (simulated, arXiv 2501.18512) and Covenant-72B (measured over its run, arXiv
2603.08163) beside them. Arithmetic only, no timing: the numbers do not depend on the machine.
The figure of docs/planner.md::

    python benchmarks/plan_curves.py --params 1.3e9 --step-time 1.2 --per-node 8 \\
        --links 10gbit 100gbit --latency 1ms 20ms --codec-cost 0 --png docs/figures/plan_curves.png
"""

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvd_slowmo.plan import (
    CODEC_MS_PER_MB,
    Cluster,
    Prediction,
    Setting,
    default_settings,
    parse_count,
    parse_duration,
    parse_rate,
    predict,
)

WORKERS = (8, 16, 32, 64, 128, 256, 512, 1024)


@dataclass(frozen=True)
class Published:
    """A compute utilization someone else published, drawn beside the curves.

    Attributes:
        label: the legend's text: who, what setting.
        utilization: the fraction published.
        workers: the GPUs it refers to, or None where the figure is not for one worker count
            (drawn as a horizontal line).
    """

    label: str
    utilization: float
    workers: int | None = None


#: The published figures (docs/planner.md gives each source and setting in full). Streaming
#: DiLoCo: Figure 4 of arXiv 2501.18512, a simulation: 95% for 1B, 10B and 100B models at about
#: 1-5 Gbit/s, overlapped FP4 communication. Covenant-72B: arXiv 2603.08163, measured over the
#: run: 94.5%, about 17 contributing peers of 8 B200 each (136 GPUs), SparseLoCo over commodity
#: internet links.
PUBLISHED = (
    Published("Streaming DiLoCo, simulated: 95% at 1-5 Gbit/s (1B-100B, FP4)", 0.95),
    Published("Covenant-72B, measured: 94.5% (~17 peers x 8 B200, internet links)", 0.945, 136),
)


def curve_settings(tau: int, per_node: int) -> list[Setting]:
    """The settings drawn, out of :func:`~hvd_slowmo.plan.default_settings`: fp32 without
    overlap (plain SlowMo), each flat codec streamed (``fragments=4, overlap=tau // 4``) and, with
    several workers per node, each hierarchical codec with ``overlap=1`` (the optimizer's
    hierarchical exchange takes the whole model, so it cannot stream).

    Args:
        tau: base steps per outer period (at least 4, for the streamed rows).
        per_node: workers per node.

    Raises:
        ValueError: a ``tau`` below 4.
    """
    if isinstance(tau, bool) or not isinstance(tau, int) or tau < 4:
        raise ValueError(f"tau={tau!r}: the streamed curves need tau >= 4 (fragments=4)")
    chosen = []
    for s in default_settings(tau, per_node):
        plain = s == Setting("fp32")
        streamed = not s.hierarchical and s.fragments == 4
        if plain or streamed or (s.hierarchical and s.runnable and s.overlap == 1):
            chosen.append(s)
    return chosen


def curves(
    params: int,
    step_time_s: float,
    tau: int,
    per_node: int,
    link_bits_per_s: float,
    latency_s: float,
    workers: Sequence[int],
    codec_ms_per_mb: Mapping[str, float] | None = None,
) -> dict[Setting, list[Prediction]]:
    """Each curve's predictions at each worker count on one kind of link.

    Args:
        params: the model's parameters.
        step_time_s: one base step's compute.
        tau: base steps per outer period.
        per_node: workers per node.
        link_bits_per_s: each node's link to the others.
        latency_s: one round's latency on it.
        workers: the worker counts, each a multiple of ``per_node``.
        codec_ms_per_mb: the codecs' cost (default :data:`hvd_slowmo.plan.CODEC_MS_PER_MB`).

    Raises:
        ValueError: a worker count that is not a whole number of nodes (from
            :class:`~hvd_slowmo.plan.Cluster`), or what :func:`~hvd_slowmo.plan.predict` refuses.
    """
    clusters = [Cluster(p, per_node, link_bits_per_s, latency_s) for p in workers]
    return {
        s: [predict(s, params, step_time_s, tau, c, codec_ms_per_mb) for c in clusters]
        for s in curve_settings(tau, per_node)
    }


def table(per_setting: Mapping[Setting, Sequence[Prediction]], workers: Sequence[int]) -> str:
    """A Markdown table: one row per setting, one column per worker count, utilization in %.

    Args:
        per_setting: from :func:`curves`.
        workers: the worker counts, in the order of each row's predictions.
    """
    lines = [
        "| setting | " + " | ".join(str(p) for p in workers) + " |",
        "|---|" + "---|" * len(workers),
    ]
    for s, row in per_setting.items():
        cells = " | ".join(f"{100 * p.utilization:.1f}%" for p in row)
        lines.append(f"| {s.label} | {cells} |")
    return "\n".join(lines)


def plot(
    panels: Mapping[tuple[str, str], Mapping[Setting, Sequence[Prediction]]],
    workers: Sequence[int],
    title: str,
    path: str,
) -> None:
    """Draw each panel's curves (utilization against workers, log scale) with :data:`PUBLISHED`
    beside them, to a PNG: one row of panels per latency, one column per link.

    Args:
        panels: (link, latency) -> :func:`curves`.
        workers: the worker counts.
        title: the figure's title.
        path: the PNG to write.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    links = list(dict.fromkeys(link for link, _ in panels))
    latencies = list(dict.fromkeys(latency for _, latency in panels))
    fig, axes = plt.subplots(
        len(latencies), len(links), figsize=(6 * len(links), 3.6 * len(latencies) + 1.6),
        squeeze=False,
    )  # fmt: skip
    for (link, latency), per_setting in panels.items():
        ax = axes[latencies.index(latency)][links.index(link)]
        for s, row in per_setting.items():
            style = "--" if s.hierarchical else "-"
            ax.plot(workers, [100 * p.utilization for p in row], style, marker="o", label=s.label)
        for pub, color in zip(PUBLISHED, ("tab:gray", "black")):
            if pub.workers is None:
                ax.axhline(100 * pub.utilization, color=color, linestyle=":", label=pub.label)
            else:
                ax.plot([pub.workers], [100 * pub.utilization], "*", color=color, markersize=13,
                        label=pub.label)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(workers), [str(p) for p in workers])
        ax.set_ylim(0, 102)
        ax.set_xlabel("workers (GPUs)")
        ax.set_ylabel("utilization, % (predicted)")
        ax.set_title(f"link {link}, latency {latency}", fontsize=10)
        ax.grid(alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=3, fontsize=7.5)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout(rect=(0, 0.12 / len(latencies) + 0.04, 1, 1))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> str:
    """The command line; prints and returns the tables.

    Args:
        argv: the arguments (default: ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--params", default="1.3e9", help="model parameters (default 1.3e9)")
    parser.add_argument("--step-time", default="1.2", help="one base step (default 1.2 s)")
    parser.add_argument("--tau", type=int, default=12, help="steps per outer period (12)")
    parser.add_argument("--per-node", type=int, default=8, help="workers per node (8)")
    parser.add_argument("--links", nargs="+", default=["10gbit", "100gbit"], help="node links")
    parser.add_argument(
        "--latency", nargs="+", default=["1ms", "20ms"], help="per round on the links"
    )
    parser.add_argument("--workers", type=int, nargs="+", default=list(WORKERS))
    parser.add_argument(
        "--codec-cost",
        type=float,
        default=None,
        help="ms per MB of float32 for every codec, e.g. 0 on GPUs (default: the planner's CPU "
        "measurement, hvd_slowmo.plan.CODEC_MS_PER_MB)",
    )
    parser.add_argument("--png", default=None, help="write the figure here")
    args = parser.parse_args(argv)
    params = parse_count(args.params, "--params")
    step = parse_duration(args.step_time, "--step-time")
    if not step > 0:
        raise ValueError(f"--step-time={args.step_time!r} must be above zero, e.g. 1.2")
    if args.codec_cost is not None and not args.codec_cost >= 0:
        raise ValueError(f"--codec-cost={args.codec_cost!r} must be >= 0, e.g. 0 on GPUs")
    costs = None
    if args.codec_cost is not None:
        costs = {name: 0.0 if name == "fp32" else args.codec_cost for name in CODEC_MS_PER_MB}
    panels = {}
    for latency in args.latency:
        for link in args.links:
            rate, seconds = parse_rate(link, "--links"), parse_duration(latency, "--latency")
            per_setting = curves(
                params, step, args.tau, args.per_node, rate, seconds, args.workers, costs
            )
            panels[(link, latency)] = per_setting
    cost_text = "the CPU default" if costs is None else f"{args.codec_cost:g} ms/MB"
    title = (
        f"Predictions of the cost model (hvd_slowmo.plan), not measured: {args.params} "
        f"parameters, {step * 1e3:g} ms per step, tau={args.tau}, {args.per_node} per node, "
        f"codec cost {cost_text}"
    )
    text = "\n\n".join(
        [title]
        + [
            f"link {link}, latency {latency}:\n\n{table(c, args.workers)}"
            for (link, latency), c in panels.items()
        ]
    )
    print(text)
    if args.png:
        plot(panels, args.workers, title, args.png)
        print(f"\nwrote {args.png}")
    return text


if __name__ == "__main__":
    try:
        main()
    except (ValueError, TypeError) as e:
        sys.exit(f"plan_curves: {e}")
