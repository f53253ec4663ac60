"""The paper's tables from TensorBoard runs (arXiv 1910.00643, Tables 1 and 2).

    python -m hvd_slowmo.tools.report runs/ [--png report.png]

Reads every run folder under the given paths with TensorBoard's own reader and prints:

* Table 1: best training loss and best validation metric (accuracy, or NLL for translation),
  original base algorithm vs with SlowMo;
* Table 2: average time per iteration, original vs with SlowMo;
* a per-run table with the time split (compute, base communication, exact average, slow
  update), bytes sent and the mean consensus distance.

Where several runs share a cell (a sweep), the cell shows the run with the best validation
metric. The time per iteration is the mean of the logged windows, leaving out the first window
when there are several (it holds Horovod's one-off start-up). A PNG with the loss/validation
curves and a bar chart of the time split is saved too (matplotlib, Agg backend).
"""
import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..bases import BASES
from .metrics import CONFIG_FILE, TAGS

__all__ = ["Run", "load_runs", "summarize", "text_table", "table1", "table2", "runs_table", "plot", "main"]

_ORDER = tuple(BASES)  # the registry's order is the paper's
_LABELS = {name: cls.label or name for name, cls in BASES.items()}


@dataclass
class Run:
    """One TensorBoard run folder.

    Attributes:
        name: the folder's path relative to the root it was found under.
        path: the folder.
        config: ``config.json`` (or what the name tells: algo and slowmo).
        scalars: tag -> [(step, value)] in step order.
    """

    name: str
    path: str
    config: Dict[str, Any]
    scalars: Dict[str, List[Tuple[int, float]]] = field(default_factory=dict)

    @property
    def algo(self) -> str:
        return str(self.config.get("algo", "unknown"))

    @property
    def slowmo(self) -> bool:
        return bool(self.config.get("slowmo", False))

    def values(self, key: str) -> List[float]:
        """The values of one of :data:`hvd_slowmo.tools.metrics.TAGS`' keys, in step order."""
        return [v for _, v in self.scalars.get(TAGS[key], [])]


def _config_from_name(name: str) -> Dict[str, Any]:
    # Names written by the examples start with "<algo>[-slowmo[-noavg]]".
    base = os.path.basename(name.rstrip("/"))
    m = re.match(r"([a-z]+)", base)
    return {"algo": m.group(1) if m else base, "slowmo": "-slowmo" in base, "average": "-noavg" not in base}


def load_runs(paths: Sequence[str]) -> List[Run]:
    """Every folder holding TensorBoard event files under ``paths`` (searched recursively).

    Args:
        paths: run folders or folders of runs.

    Raises:
        ValueError: a path does not exist.
    """
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    runs = []
    for root in paths:
        if not os.path.isdir(root):
            raise ValueError(f"report: {root!r} is not a folder; pass the --logdir of the runs (e.g. runs/)")
        for folder, _, files in sorted(os.walk(root)):
            if not any(f.startswith("events.out.tfevents") for f in files):
                continue
            rel = os.path.relpath(folder, root)
            name = os.path.basename(os.path.abspath(folder)) if rel == "." else rel
            cfg_path = os.path.join(folder, CONFIG_FILE)
            if os.path.exists(cfg_path):
                with open(cfg_path, encoding="utf-8") as f:
                    config = json.load(f)
            else:
                config = _config_from_name(name)
            acc = EventAccumulator(folder, size_guidance={SCALARS: 0})  # 0: keep every point
            acc.Reload()
            scalars = {tag: sorted((e.step, e.value) for e in acc.Scalars(tag)) for tag in acc.Tags()["scalars"]}
            runs.append(Run(name=name, path=folder, config=config, scalars=scalars))
    return runs


def _mean(values: Sequence[float]) -> Optional[float]:
    return sum(values) / len(values) if values else None


def _steady(values: Sequence[float]) -> List[float]:
    return list(values[1:]) if len(values) > 1 else list(values)


def summarize(run: Run) -> Dict[str, Any]:
    """The numbers the tables show for one run.

    Args:
        run: from :func:`load_runs`.

    Returns:
        ``best_train_loss``, ``val_kind`` (``"accuracy"``, ``"nll"``, ``"loss"`` or None),
        ``best_val``, ``iter_ms`` and the split ``compute_ms``, ``base_comm_ms``,
        ``average_ms``, ``slow_update_ms``, ``bytes_sent`` (last), ``steps`` (last logged step),
        ``consensus`` (mean); None where the run logged nothing.
    """
    out: Dict[str, Any] = {"name": run.name, "algo": run.algo, "slowmo": run.slowmo}
    losses = run.values("train_loss")
    out["best_train_loss"] = min(losses) if losses else None
    out["val_kind"], out["best_val"] = None, None
    for kind, best in (("accuracy", max), ("nll", min), ("loss", min)):
        vals = run.values(f"val_{kind}")
        if vals:
            out["val_kind"], out["best_val"] = kind, best(vals)
            break
    for key in ("iter_ms", "compute_ms", "base_comm_ms", "average_ms", "slow_update_ms"):
        out[key] = _mean(_steady(run.values(key)))
    sent = run.scalars.get(TAGS["bytes_sent"], [])
    out["bytes_sent"] = sent[-1][1] if sent else None
    steps = [s for points in run.scalars.values() for s, _ in points]
    out["steps"] = max(steps) if steps else None
    out["consensus"] = _mean(run.values("consensus"))
    return out


def _label(run: Run) -> str:
    opt = "Adam" if str(run.config.get("optimizer", "sgd")).lower() == "adam" else "SGD"
    label = _LABELS.get(run.algo, run.algo).format(opt=opt)
    if run.slowmo and run.config.get("average") is False:
        label += " (noaverage)"
    return label


def _fmt(value: Optional[float], spec: str) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _fmt_val(s: Optional[Dict[str, Any]]) -> str:
    if s is None or s["best_val"] is None:
        return "-"
    return f"{s['best_val']:.2f}%" if s["val_kind"] == "accuracy" else f"{s['best_val']:.3f}"


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns with a dashed rule under the header.

    Args:
        headers: column titles.
        rows: rows of cells (strings), each as long as ``headers``.
    """
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _cells(runs: Sequence[Run]) -> List[Tuple[str, str, Optional[Dict[str, Any]], Optional[Dict[str, Any]]]]:
    """(task, baseline label, best original summary, best SlowMo summary) rows in the paper's order."""
    groups: Dict[Tuple[str, str, int], Dict[bool, List[Dict[str, Any]]]] = {}
    for run in runs:
        label = _label(run)
        order = _ORDER.index(run.algo) if run.algo in _ORDER else len(_ORDER)
        key = (str(run.config.get("task", "-")), label, order)
        groups.setdefault(key, {False: [], True: []})[run.slowmo].append(summarize(run))

    def best(items: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
        scored = [s for s in items if s["best_val"] is not None]
        if not scored:
            return items[0] if items else None
        sign = -1.0 if scored[0]["val_kind"] == "accuracy" else 1.0
        return min(scored, key=lambda s: sign * s["best_val"])

    rows = []
    for (task, label, _), by_slowmo in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1])):
        rows.append((task, label, best(by_slowmo[False]), best(by_slowmo[True])))
    return rows


def table1(runs: Sequence[Run]) -> str:
    """Table 1: best training loss and best validation metric, original vs with SlowMo.

    Args:
        runs: from :func:`load_runs`.
    """
    rows = [[task, label, _fmt(o and o["best_train_loss"], ".4f"), _fmt(s and s["best_train_loss"], ".4f"),
             _fmt_val(o), _fmt_val(s)] for task, label, o, s in _cells(runs)]
    headers = ["Task", "Baseline", "Train loss: original", "w/ SlowMo", "Best val (acc% / NLL): original",
               "w/ SlowMo"]
    return "Table 1: best training loss and validation metric\n" + text_table(headers, rows)


def table2(runs: Sequence[Run]) -> str:
    """Table 2: average time per iteration (ms), original vs with SlowMo.

    Args:
        runs: from :func:`load_runs`.
    """
    rows = [[task, label, _fmt(o and o["iter_ms"], ".2f"), _fmt(s and s["iter_ms"], ".2f")]
            for task, label, o, s in _cells(runs)]
    headers = ["Task", "Baseline", "Time/iteration (ms): original", "w/ SlowMo"]
    return "Table 2: average time per iteration\n" + text_table(headers, rows)


def runs_table(runs: Sequence[Run]) -> str:
    """Every run: best metrics, the time split per iteration, bytes sent, consensus distance.

    Args:
        runs: from :func:`load_runs`.
    """
    rows = []
    for run in sorted(runs, key=lambda r: r.name):
        s = summarize(run)
        mb = None if s["bytes_sent"] is None else s["bytes_sent"] / 1e6
        rows.append([run.name, _fmt(s["steps"], "d"), _fmt(s["best_train_loss"], ".4f"), _fmt_val(s),
                     _fmt(s["iter_ms"], ".2f"), _fmt(s["compute_ms"], ".2f"), _fmt(s["base_comm_ms"], ".2f"),
                     _fmt(s["average_ms"], ".2f"), _fmt(s["slow_update_ms"], ".2f"), _fmt(mb, ".2f"),
                     _fmt(s["consensus"], ".4f")])
    headers = ["Run", "Steps", "Best train loss", "Best val", "ms/iter", "compute", "base comm", "average",
               "slow update", "MB sent (rank 0)", "Consensus dist."]
    return "Runs (time split in ms per iteration)\n" + text_table(headers, rows)


def plot(runs: Sequence[Run], path: str) -> str:
    """Save training-loss and validation curves and a stacked bar chart of the time split.

    Args:
        runs: from :func:`load_runs`.
        path: the PNG file to write.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_val, ax_time) = plt.subplots(1, 3, figsize=(17, 4.8))
    for run in sorted(runs, key=lambda r: r.name):
        pts = run.scalars.get(TAGS["train_loss"], [])
        if pts:
            ax_loss.plot([s for s, _ in pts], [v for _, v in pts], label=run.name)
        for key in ("val_accuracy", "val_nll", "val_loss"):
            pts = run.scalars.get(TAGS[key], [])
            if pts:
                ax_val.plot([s for s, _ in pts], [v for _, v in pts], marker=".", label=f"{run.name} ({key[4:]})")
                break
    ax_loss.set(title="Training loss", xlabel="step", yscale="log")
    ax_val.set(title="Validation (accuracy % or NLL)", xlabel="step")
    for ax in (ax_loss, ax_val):
        if ax.lines:
            ax.legend(fontsize=7)
    summaries = [summarize(r) for r in sorted(runs, key=lambda r: r.name)]
    names = [s["name"] for s in summaries]
    bottom = [0.0] * len(summaries)
    for key, label in (("compute_ms", "compute"), ("base_comm_ms", "base comm"), ("average_ms", "exact average"),
                       ("slow_update_ms", "slow update")):
        vals = [max(s[key] or 0.0, 0.0) for s in summaries]
        ax_time.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax_time.set(title="Time per iteration (ms)")
    ax_time.tick_params(axis="x", labelrotation=60, labelsize=7)
    ax_time.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Command line: print the tables for the runs under the given folders and save the PNG.

    Args:
        argv: arguments (default: sys.argv[1:]).
    """
    parser = argparse.ArgumentParser(prog="hvd-slowmo-report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("paths", nargs="+", help="run folders or folders of runs (e.g. runs/)")
    parser.add_argument("--png", default=None, help="where to save the figure (default: <first path>/report.png)")
    args = parser.parse_args(argv)
    runs = load_runs(args.paths)
    if not runs:
        print(f"report: no TensorBoard event files under {', '.join(args.paths)}", file=sys.stderr)
        return 1
    print(table1(runs))
    print()
    print(table2(runs))
    print()
    print(runs_table(runs))
    png = plot(runs, args.png or os.path.join(args.paths[0], "report.png"))
    print(f"\nFigure: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
