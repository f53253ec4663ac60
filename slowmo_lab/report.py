"""The paper's tables from TensorBoard runs (arXiv 1910.00643, Tables 1 and 2), as mean ± std
over seeds.

    python -m slowmo_lab.report runs/ [--png report.png]

Reads every run folder under the given paths with TensorBoard's own reader. Runs whose
``config.json`` differ only in ``seed`` are repeats of one *setting*; every figure below is the
mean ± sample standard deviation over a setting's runs (n = 1: the value alone). It prints:

* Table 1: best training loss and best validation metric (accuracy, or NLL for translation),
  original base algorithm vs with SlowMo. The training loss is the averaged model's loss on the
  whole training set where the run logged it (``train/full_loss``), else the logged minibatch
  loss;
* Table 2: average time per iteration, original vs with SlowMo;
* a per-setting table: the number of seeds, lr, tau, beta, buffers, final and best metrics;
* a per-run table with the time split (compute, base communication, exact average, slow
  update), bytes sent and the mean consensus distance.

Where several settings share a cell of Tables 1 and 2 (a sweep), the cell shows the setting
with the best mean validation metric. The time per iteration is the mean of the logged windows,
leaving out the first window when there are several (it holds Horovod's one-off start-up). A
PNG is saved too (matplotlib, Agg backend): per setting, the mean training-loss and validation
curves with a band from the lowest to the highest seed, and a bar chart of the time split.
"""

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from hvd_slowmo import BASES

from .metrics import CONFIG_FILE, TAGS

__all__ = [
    "Run",
    "Setting",
    "load_runs",
    "summarize",
    "group_settings",
    "best_settings",
    "FAIL_MARGIN",
    "seed_failures",
    "mean_std",
    "fmt_mean_std",
    "text_table",
    "table1",
    "table2",
    "settings_table",
    "runs_table",
    "plot",
    "main",
]

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
    config: dict[str, Any]
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)

    @property
    def algo(self) -> str:
        return str(self.config.get("algo", "unknown"))

    @property
    def slowmo(self) -> bool:
        return bool(self.config.get("slowmo", False))

    def values(self, key: str) -> list[float]:
        """The values of one of :data:`slowmo_lab.metrics.TAGS`' keys, in step order."""
        return [v for _, v in self.scalars.get(TAGS[key], [])]


def _config_from_name(name: str) -> dict[str, Any]:
    # Names written by the examples start with "<algo>[-slowmo[-noavg]]".
    base = os.path.basename(name.rstrip("/"))
    m = re.match(r"([a-z]+)", base)
    return {
        "algo": m.group(1) if m else base,
        "slowmo": "-slowmo" in base,
        "average": "-noavg" not in base,
    }


def load_runs(paths: Sequence[str], relative_to: str | None = None) -> list[Run]:
    """Every folder holding TensorBoard event files under ``paths`` (searched recursively).

    Args:
        paths: run folders or folders of runs.
        relative_to: name each run by its path relative to this folder (default: relative to
            the path it was found under, or its own folder name for a run folder itself).

    Raises:
        ValueError: a path does not exist.
    """
    from tensorboard.backend.event_processing import plugin_event_accumulator as events
    from tensorboard.util import tensor_util

    runs = []
    for root in paths:
        if not os.path.isdir(root):
            raise ValueError(
                f"report: {root!r} is not a folder; pass the --logdir of the runs (e.g. runs/)"
            )
        for folder, _, files in sorted(os.walk(root)):
            if not any(f.startswith("events.out.tfevents") for f in files):
                continue
            rel = os.path.relpath(folder, root)
            if relative_to is not None:
                name = os.path.relpath(folder, relative_to)
            else:
                name = os.path.basename(os.path.abspath(folder)) if rel == "." else rel
            cfg_path = os.path.join(folder, CONFIG_FILE)
            if os.path.exists(cfg_path):
                with open(cfg_path, encoding="utf-8") as f:
                    config = json.load(f)
            else:
                config = _config_from_name(name)
            # This accumulator reads scalars in both forms (slowmo_lab.dashboard writes tensors,
            # SummaryWriter.add_scalar simple values) as tensors of the scalars plugin.
            acc = events.EventAccumulator(folder, size_guidance={events.TENSORS: 0})  # 0: all
            acc.Reload()
            tags = acc.PluginTagToContent("scalars") if "scalars" in acc.ActivePlugins() else {}
            value = tensor_util.make_ndarray
            scalars = {
                tag: sorted((e.step, float(value(e.tensor_proto))) for e in acc.Tensors(tag))
                for tag in tags
            }
            runs.append(Run(name=name, path=folder, config=config, scalars=scalars))
    return runs


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _steady(values: Sequence[float]) -> list[float]:
    return list(values[1:]) if len(values) > 1 else list(values)


def _train_loss_points(run: Run) -> list[tuple[int, float]]:
    """The averaged model's full training loss where logged, else the minibatch loss."""
    return run.scalars.get(TAGS["train_full_loss"]) or run.scalars.get(TAGS["train_loss"], [])


def _val_key(run: Run) -> str | None:
    for key in ("val_accuracy", "val_nll", "val_loss"):
        if run.scalars.get(TAGS[key]):
            return key
    return None


def summarize(run: Run) -> dict[str, Any]:
    """The numbers the tables show for one run.

    Args:
        run: from :func:`load_runs`.

    Returns:
        ``train_loss_kind`` (``"full"``: the averaged model on the whole training set, or
        ``"minibatch"``), ``best_train_loss`` and ``final_train_loss`` of that kind,
        ``val_kind`` (``"accuracy"``, ``"nll"``, ``"loss"`` or None), ``best_val`` and
        ``final_val``, ``iter_ms`` and the split ``compute_ms``, ``base_comm_ms``,
        ``average_ms``, ``slow_update_ms``, ``bytes_sent`` (last), ``steps`` (last logged
        step), ``consensus`` (mean); None where the run logged nothing.
    """
    out: dict[str, Any] = {"name": run.name, "algo": run.algo, "slowmo": run.slowmo}
    out["train_loss_kind"] = "full" if run.scalars.get(TAGS["train_full_loss"]) else "minibatch"
    losses = [v for _, v in _train_loss_points(run)]
    out["best_train_loss"] = min(losses) if losses else None
    out["final_train_loss"] = losses[-1] if losses else None
    key = _val_key(run)
    out["val_kind"] = key[4:] if key else None
    vals = run.values(key) if key else []
    out["best_val"] = ((max if key == "val_accuracy" else min)(vals)) if vals else None
    out["final_val"] = vals[-1] if vals else None
    for k in ("iter_ms", "compute_ms", "base_comm_ms", "average_ms", "slow_update_ms"):
        out[k] = _mean(_steady(run.values(k)))
    sent = run.scalars.get(TAGS["bytes_sent"], [])
    out["bytes_sent"] = sent[-1][1] if sent else None
    steps = [s for points in run.scalars.values() for s, _ in points]
    out["steps"] = max(steps) if steps else None
    out["consensus"] = _mean(run.values("consensus"))
    return out


def mean_std(values: Sequence[float | None]) -> tuple[float | None, float | None, int]:
    """Mean, sample standard deviation (n - 1; None for n < 2) and n of the values given
    (None entries are left out; a NaN, e.g. the loss of a diverged run, makes both NaN).

    Args:
        values: one value per run.
    """
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None, None, 0
    mean = sum(vals) / len(vals)
    if len(vals) < 2:
        return mean, None, len(vals)
    return mean, math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)), len(vals)


def fmt_mean_std(values: Sequence[float | None], spec: str, suffix: str = "") -> str:
    """``"mean ± std"`` (the value alone for one run, ``-`` for none).

    Args:
        values: one value per run.
        spec: the format of both numbers, e.g. ``".4f"``.
        suffix: appended to each number, e.g. ``"%"``.
    """
    mean, std, n = mean_std(values)
    if n == 0:
        return "-"
    if std is None:
        return f"{mean:{spec}}{suffix}"
    return f"{mean:{spec}}{suffix} ± {std:{spec}}{suffix}"


#: Points of validation accuracy by which a seed must trail to fail (:func:`seed_failures`): well
#: above the seed-to-seed noise of a stable setting (about 0.5 to 1.5 points on MNIST-1D's
#: 500-signal validation split) and well below what a diverging seed loses (10 to 80 points).
FAIL_MARGIN = 5.0


def _finite(value: float | None) -> bool:
    return value is not None and math.isfinite(value)


def seed_failures(
    final_losses: Sequence[float | None],
    finals: Sequence[float | None],
    bests: Sequence[float | None],
    margin: float | None = FAIL_MARGIN,
) -> list[str | None]:
    """Which seeds of one setting fail, and why (None: the seed is fine).

    A seed fails when

    1. its final training loss or final validation metric is missing or not finite (it
       diverged), or, for an accuracy (higher is better; ``margin`` given):
    2. its final accuracy is more than ``margin`` points below its own best one (it learned,
       then fell back toward chance), or
    3. its final accuracy is more than ``margin`` points below the best final accuracy of the
       setting's other seeds (it learned much less than its siblings).

    A tuning rule that only compares means lets a setting through whose seeds sometimes
    diverge; rejecting every setting with a failing seed does not.

    Args:
        final_losses: per seed, the final training loss.
        finals: per seed, the final validation metric (accuracy in percent for 2 and 3).
        bests: per seed, the best validation metric over the run (None: rule 2 skipped).
        margin: points of accuracy (default :data:`FAIL_MARGIN`); None applies rule 1 only
            (a metric such as an NLL has no common scale for a margin).
    """
    if not len(final_losses) == len(finals) == len(bests):
        raise ValueError(
            "seed_failures: final_losses, finals and bests need one entry per seed, got "
            f"{len(final_losses)}, {len(finals)} and {len(bests)}"
        )
    if margin is not None and not (math.isfinite(margin) and margin > 0):
        raise ValueError(f"seed_failures: margin must be a positive number of points, got {margin}")
    out: list[str | None] = []
    for i, (loss, final, best) in enumerate(zip(final_losses, finals, bests)):
        if not (_finite(loss) and _finite(final)):
            out.append(f"diverged (final loss {loss}, final metric {final})")
            continue
        assert final is not None
        if margin is not None and best is not None and _finite(best) and final < best - margin:
            out.append(f"fell back: final {final:.2f} < best {best:.2f} - {margin:g}")
            continue
        others = [f for j, f in enumerate(finals) if j != i and f is not None and _finite(f)]
        if margin is not None and others and final < max(others) - margin:
            out.append(f"trails: final {final:.2f} < best sibling {max(others):.2f} - {margin:g}")
            continue
        out.append(None)
    return out


_SEED_SUFFIX = re.compile(r"[/_-]?seed\d+$")


@dataclass
class Setting:
    """Runs that differ only in their seed: the same configuration apart from ``seed``, and the
    same name apart from a trailing ``seed<k>`` (e.g. ``localsgd-slowmo/seed0``, ``.../seed1``).

    Attributes:
        name: the runs' common name, without the seed part.
        runs: the runs, by name.
        summaries: :func:`summarize` of each run.
    """

    name: str
    runs: list[Run]
    summaries: list[dict[str, Any]]

    @property
    def config(self) -> dict[str, Any]:
        return self.runs[0].config

    @property
    def task(self) -> str:
        return str(self.config.get("task", "-"))

    def values(self, key: str) -> list[Any]:
        """One :func:`summarize` field per run."""
        return [s[key] for s in self.summaries]

    def mean(self, key: str) -> float | None:
        """The mean of one :func:`summarize` field over the runs."""
        return mean_std(self.values(key))[0]

    def failures(self, margin: float = FAIL_MARGIN) -> dict[str, str]:
        """The runs that fail (:func:`seed_failures`): run name -> why.

        Args:
            margin: see :func:`seed_failures`.
        """
        accuracy = set(self.values("val_kind")) == {"accuracy"}
        reasons = seed_failures(
            self.values("final_train_loss"),
            self.values("final_val"),
            self.values("best_val") if accuracy else [None] * len(self.runs),
            margin if accuracy else None,
        )
        return {r.name: why for r, why in zip(self.runs, reasons) if why}


def group_settings(runs: Sequence[Run]) -> list[Setting]:
    """Group runs into settings (see :class:`Setting`), in name order.

    Args:
        runs: from :func:`load_runs`.
    """
    groups: dict[tuple[str, str], list[Run]] = {}
    for run in sorted(runs, key=lambda r: r.name):
        config = json.dumps(
            {k: v for k, v in run.config.items() if k != "seed"}, sort_keys=True, default=str
        )
        groups.setdefault((_SEED_SUFFIX.sub("", run.name), config), []).append(run)
    settings = [
        Setting(name=name, runs=members, summaries=[summarize(r) for r in members])
        for (name, _), members in groups.items()
    ]
    return sorted(settings, key=lambda s: s.name)


def _label(run: Run) -> str:
    opt = "Adam" if str(run.config.get("optimizer", "sgd")).lower() == "adam" else "SGD"
    label = _LABELS.get(run.algo, run.algo).format(opt=opt)
    if run.slowmo and run.config.get("average") is False:
        label += " (noaverage)"
    return label


def _fmt(value: float | None, spec: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _fmt_vals(setting: Setting | None, key: str) -> str:
    """A validation metric of a setting as mean ± std (accuracy in %, NLL/loss plain)."""
    if setting is None:
        return "-"
    kinds = {k for k in setting.values("val_kind") if k}
    if kinds == {"accuracy"}:
        return fmt_mean_std(setting.values(key), ".2f", "%")
    return fmt_mean_std(setting.values(key), ".3f")


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Left-aligned columns with a dashed rule under the header.

    Args:
        headers: column titles.
        rows: rows of cells (strings), each as long as ``headers``.
    """
    widths = [
        max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)
    ]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    return "\n".join(out)


def _better_first(setting: Setting) -> float:
    """Sort key: the best mean validation metric first (accuracy: high; NLL/loss: low)."""
    mean = setting.mean("best_val")
    if mean is None or math.isnan(mean):
        return math.inf
    return -mean if "accuracy" in setting.values("val_kind") else mean


def _cells(runs: Sequence[Run]) -> list[tuple[str, str, Setting | None, Setting | None]]:
    """(task, baseline label, best original setting, best SlowMo setting) in the paper's order."""
    groups: dict[tuple[str, str, int], dict[bool, list[Setting]]] = {}
    for setting in group_settings(runs):
        run = setting.runs[0]
        order = _ORDER.index(run.algo) if run.algo in _ORDER else len(_ORDER)
        key = (setting.task, _label(run), order)
        groups.setdefault(key, {False: [], True: []})[run.slowmo].append(setting)

    def best(items: list[Setting]) -> Setting | None:
        return min(items, key=_better_first) if items else None

    ordered = sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][1]))
    return [(task, label, best(by[False]), best(by[True])) for (task, label, _), by in ordered]


def _seeds(o: Setting | None, s: Setting | None) -> str:
    return " / ".join("-" if x is None else str(len(x.runs)) for x in (o, s))


def table1(runs: Sequence[Run]) -> str:
    """Table 1: best training loss and best validation metric, original vs with SlowMo (mean ± std
    over seeds).

    Args:
        runs: from :func:`load_runs`.
    """
    rows = [
        [
            task,
            label,
            _seeds(o, s),
            fmt_mean_std(o.values("best_train_loss"), ".4f") if o else "-",
            fmt_mean_std(s.values("best_train_loss"), ".4f") if s else "-",
            _fmt_vals(o, "best_val"),
            _fmt_vals(s, "best_val"),
        ]
        for task, label, o, s in _cells(runs)
    ]
    headers = [
        "Task",
        "Baseline",
        "Seeds",
        "Train loss: original",
        "w/ SlowMo",
        "Best val (acc% / NLL): original",
        "w/ SlowMo",
    ]
    return (
        "Table 1: best training loss and validation metric (mean ± std over seeds)\n"
        + text_table(headers, rows)
    )


def table2(runs: Sequence[Run]) -> str:
    """Table 2: average time per iteration (ms), original vs with SlowMo (mean ± std over seeds).

    Args:
        runs: from :func:`load_runs`.
    """
    rows = [
        [
            task,
            label,
            _seeds(o, s),
            fmt_mean_std(o.values("iter_ms"), ".2f") if o else "-",
            fmt_mean_std(s.values("iter_ms"), ".2f") if s else "-",
        ]
        for task, label, o, s in _cells(runs)
    ]
    headers = ["Task", "Baseline", "Seeds", "Time/iteration (ms): original", "w/ SlowMo"]
    return "Table 2: average time per iteration (mean ± std over seeds)\n" + text_table(
        headers, rows
    )


def _final_first(setting: Setting) -> float:
    """Sort key: the best mean final validation metric first (accuracy: high; NLL/loss: low)."""
    mean = setting.mean("final_val")
    if mean is None or math.isnan(mean):
        return math.inf
    return -mean if "accuracy" in setting.values("val_kind") else mean


def best_settings(runs: Sequence[Run], margin: float = FAIL_MARGIN) -> list[Setting]:
    """Per task, algorithm and SlowMo on/off: among the *stable* settings (no seed fails,
    :meth:`Setting.failures`), the one with the best mean final validation metric over its
    seeds (what a tuning sweep chooses). A group whose every setting has a failing seed has
    no choice.

    Args:
        runs: from :func:`load_runs`.
        margin: see :func:`seed_failures`.
    """
    best: dict[tuple[str, str, bool], Setting] = {}
    for st in group_settings(runs):
        if st.failures(margin):
            continue
        key = (st.task, _label(st.runs[0]), st.runs[0].slowmo)
        if key not in best or _final_first(st) < _final_first(best[key]):
            best[key] = st
    return [best[k] for k in sorted(best)]


def settings_table(runs: Sequence[Run]) -> str:
    """Every setting (mean ± std over its seeds), best mean final validation metric first within
    each task and algorithm: what a sweep chooses from.

    Args:
        runs: from :func:`load_runs`.
    """
    settings = sorted(
        group_settings(runs),
        key=lambda st: (st.task, _label(st.runs[0]), st.runs[0].slowmo, _final_first(st)),
    )
    rows = []
    for st in settings:
        c = st.config
        slowmo = st.runs[0].slowmo
        rows.append(
            [
                st.task,
                st.name,
                str(len(st.runs)),
                _fmt(c.get("lr"), "g"),
                _fmt(c.get("tau"), "d"),
                _fmt(c.get("slow_momentum"), "g") if slowmo else "-",
                str(c.get("buffers", "-")),
                fmt_mean_std(st.values("final_train_loss"), ".4f"),
                _fmt_vals(st, "final_val"),
                _fmt_vals(st, "best_val"),
                str(len(st.failures())),
            ]
        )
    headers = [
        "Task",
        "Setting",
        "Seeds",
        "lr",
        "tau",
        "beta",
        "buffers",
        "Final train loss",
        "Final val",
        "Best val",
        "Failing seeds",
    ]
    return (
        "Settings (mean ± std over seeds; best final val first; failing seeds: see "
        "slowmo_lab.report.seed_failures)\n" + text_table(headers, rows)
    )


def runs_table(runs: Sequence[Run]) -> str:
    """Every run: best metrics, the time split per iteration, bytes sent, consensus distance.

    Args:
        runs: from :func:`load_runs`.
    """
    rows = []
    for run in sorted(runs, key=lambda r: r.name):
        s = summarize(run)
        mb = None if s["bytes_sent"] is None else s["bytes_sent"] / 1e6
        if s["best_val"] is None:
            val = "-"
        else:
            val = f"{s['best_val']:.2f}%" if s["val_kind"] == "accuracy" else f"{s['best_val']:.3f}"
        rows.append(
            [
                run.name,
                _fmt(s["steps"], "d"),
                _fmt(s["best_train_loss"], ".4f"),
                val,
                _fmt(s["iter_ms"], ".2f"),
                _fmt(s["compute_ms"], ".2f"),
                _fmt(s["base_comm_ms"], ".2f"),
                _fmt(s["average_ms"], ".2f"),
                _fmt(s["slow_update_ms"], ".2f"),
                _fmt(mb, ".2f"),
                _fmt(s["consensus"], ".4f"),
            ]
        )
    headers = [
        "Run",
        "Steps",
        "Best train loss",
        "Best val",
        "ms/iter",
        "compute",
        "base comm",
        "average",
        "slow update",
        "MB sent (rank 0)",
        "Consensus dist.",
    ]
    return "Runs (time split in ms per iteration)\n" + text_table(headers, rows)


def _band(
    points_per_run: list[list[tuple[int, float]]],
) -> tuple[list[int], list[float], list[float], list[float]]:
    """Steps logged by every run, and there the mean, the minimum and the maximum over runs."""
    common = sorted(set.intersection(*(set(s for s, _ in pts) for pts in points_per_run)))
    by_run = [dict(pts) for pts in points_per_run]
    means = [sum(d[step] for d in by_run) / len(by_run) for step in common]
    return (
        common,
        means,
        [min(d[step] for d in by_run) for step in common],
        [max(d[step] for d in by_run) for step in common],
    )


def plot(
    runs: Sequence[Run], path: str, extra_panel: Callable[[Any, list], None] | None = None
) -> str:
    """Save, per setting, the mean training-loss and validation curves with a band from the
    lowest to the highest of its seeds, and a stacked bar chart of the mean time split.

    Args:
        runs: from :func:`load_runs`.
        path: the PNG file to write.
        extra_panel: draws one more panel, ``extra_panel(axes, settings)`` (e.g.
            :func:`slowmo_lab.time_to_accuracy.seconds_panel`: accuracy against seconds).

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = group_settings(runs)
    if extra_panel is not None:
        fig, (ax_loss, ax_val, ax_extra, ax_time) = plt.subplots(1, 4, figsize=(22, 4.8))
        extra_panel(ax_extra, settings)
    else:
        fig, (ax_loss, ax_val, ax_time) = plt.subplots(1, 3, figsize=(17, 4.8))
    loss_kinds, val_kinds = set(), set()
    for st in settings:
        n = f" (n={len(st.runs)})" if len(st.runs) > 1 else ""
        series = [_train_loss_points(r) for r in st.runs]
        if all(series):
            steps, mean, low, high = _band(series)
            if steps:
                (line,) = ax_loss.plot(steps, mean, label=st.name + n)
                ax_loss.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
                loss_kinds.update(st.values("train_loss_kind"))
        keys = {_val_key(r) for r in st.runs}
        key = next(iter(keys)) if len(keys) == 1 else None
        if key is not None:
            steps, mean, low, high = _band([r.scalars[TAGS[key]] for r in st.runs])
            if steps:
                (line,) = ax_val.plot(steps, mean, marker=".", label=st.name + n)
                ax_val.fill_between(steps, low, high, color=line.get_color(), alpha=0.2)
                val_kinds.add(key[4:])
    loss_title = (
        "Training loss (averaged model, whole training set)"
        if loss_kinds == {"full"}
        else "Training loss"
    )
    loss_title += "\nmean over seeds, band: lowest to highest"
    ax_loss.set(title=loss_title, xlabel="step", yscale="log")
    kinds = ", ".join(sorted(val_kinds)) or "-"
    ax_val.set(
        title=f"Validation ({kinds})\nmean over seeds, band: lowest to highest", xlabel="step"
    )
    for ax in (ax_loss, ax_val):
        if ax.lines:
            ax.legend(fontsize=7)
    names = [st.name for st in settings]
    bottom = [0.0] * len(settings)
    for key, label in (
        ("compute_ms", "compute"),
        ("base_comm_ms", "base comm"),
        ("average_ms", "exact average"),
        ("slow_update_ms", "slow update"),
    ):
        vals = [max(st.mean(key) or 0.0, 0.0) for st in settings]
        ax_time.bar(names, vals, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax_time.set(title="Time per iteration (ms, mean over seeds)")
    ax_time.tick_params(axis="x", labelrotation=60, labelsize=7)
    ax_time.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: print the tables for the runs under the given folders and save the PNG.

    Args:
        argv: arguments (default: sys.argv[1:]).
    """
    parser = argparse.ArgumentParser(
        prog="hvd-slowmo-report",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("paths", nargs="+", help="run folders or folders of runs (e.g. runs/)")
    parser.add_argument(
        "--png", default=None, help="where to save the figure (default: <first path>/report.png)"
    )
    args = parser.parse_args(argv)
    runs = load_runs(args.paths)
    if not runs:
        print(f"report: no TensorBoard event files under {', '.join(args.paths)}", file=sys.stderr)
        return 1
    print(table1(runs))
    print()
    print(table2(runs))
    print()
    print(settings_table(runs))
    print()
    print(runs_table(runs))
    png = plot(runs, args.png or os.path.join(args.paths[0], "report.png"))
    print(f"\nFigure: {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
