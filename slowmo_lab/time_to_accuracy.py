"""Time to accuracy: how many seconds of training each method's averaged model needs to first
reach given test accuracies, mean ± std over seeds (the question a slow network asks of
SlowMo, arXiv 1910.00643 Sec. 6: the same accuracy sooner?). For a language model the same
question is asked of the validation loss (lower is better): the seconds to given losses, and
the loss each method has reached at equal training seconds (:func:`loss_table`).

A run's curve is its (training seconds, metric) at every evaluation, from its TensorBoard
events: ``time/train_s`` (rank 0's summed iteration times: evaluation and the consensus
measurement excluded) and ``val/accuracy`` (or ``val/loss``), joined by step. The metric is
only known at evaluations (epoch ends), so a time to a target is the training seconds at the
first evaluation that reaches it: its resolution is one epoch.
"""

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .metrics import TAGS
from .report import Run, fmt_mean_std, mean_std, text_table

__all__ = [
    "Curve",
    "run_curve",
    "time_to_accuracy",
    "default_targets",
    "MethodTimes",
    "time_to_accuracy_rows",
    "time_to_accuracy_table",
    "value_at_seconds",
    "loss_targets",
    "loss_table",
    "plot_accuracy_vs_seconds",
    "seconds_panel",
]

#: (training seconds, accuracy in percent) at each evaluation, in time order.
Curve = list[tuple[float, float]]


def run_curve(run: Run, tag: str = TAGS["val_accuracy"]) -> Curve:
    """The (training seconds, metric) points of a run, at the steps that logged both.

    Args:
        run: from :func:`slowmo_lab.report.load_runs`.
        tag: the metric's TensorBoard tag (default: the validation accuracy).

    Raises:
        ValueError: the run logged no training seconds or no such metric (not written by
            :class:`slowmo_lab.metrics.TrainingMonitor` of this version, or no evaluation).
    """
    seconds = dict(run.scalars.get(TAGS["train_s"], []))
    metric = run.scalars.get(tag, [])
    if not seconds or not metric:
        raise ValueError(
            f"run {run.name!r} has no {TAGS['train_s']!r} or {tag!r} scalars: a time to a "
            "target needs both (runs written by this version's TrainingMonitor)"
        )
    return [(seconds[step], value) for step, value in metric if step in seconds]


def _checked(curve: Sequence[tuple[float, float]]) -> Sequence[tuple[float, float]]:
    """The curve, after checking that its seconds never decrease (one run's curve)."""
    for (s0, _), (s1, _) in zip(curve, curve[1:]):
        if s1 < s0:
            raise ValueError(
                f"the curve's seconds must not decrease, got {s1} after {s0} (not one run's curve)"
            )
    return curve


def time_to_accuracy(
    curve: Sequence[tuple[float, float]], target: float, lower_is_better: bool = False
) -> float | None:
    """Training seconds at the first evaluation that reaches ``target`` (None: never reached).

    Args:
        curve: (seconds, metric) in time order (:func:`run_curve`).
        target: accuracy in percent (or the metric's value).
        lower_is_better: a loss: reached at or below ``target`` (default: at or above).

    Raises:
        ValueError: the seconds go backwards (not one run's curve).
    """
    for seconds, value in _checked(curve):
        if (value <= target) if lower_is_better else (value >= target):
            return seconds
    return None


def value_at_seconds(curve: Sequence[tuple[float, float]], seconds: float) -> float | None:
    """The metric of the last evaluation at or before ``seconds`` of training (None: none
    was that early): what the run had reached with that much training time.

    Args:
        curve: (seconds, metric) in time order (:func:`run_curve`).
        seconds: the training-time budget.

    Raises:
        ValueError: the seconds go backwards (not one run's curve).
    """
    reached = None
    for t, value in _checked(curve):
        if t > seconds:
            break
        reached = value
    return reached


def default_targets(
    finals: Mapping[str, Sequence[float | None]], fixed: Sequence[float] = (85.0, 90.0)
) -> list[float]:
    """The accuracies to time, in increasing order: ``fixed`` and the best method's mean final
    accuracy minus one point (rounded down to 0.1), which at least the best method reaches.

    Args:
        finals: method -> its seeds' final accuracies.
        fixed: accuracies every table shows.
    """
    means = [m for m in (mean_std(v)[0] for v in finals.values()) if m is not None]
    targets = set(fixed)
    if means:
        targets.add(math.floor((max(means) - 1.0) * 10 + 1e-9) / 10)
    return sorted(targets)


@dataclass
class MethodTimes:
    """One method's seeds: final accuracy, training seconds, and per target the seconds each
    seed took to reach it (None: never).

    Attributes:
        final: per seed, the last evaluation's accuracy.
        seconds: per seed, the training seconds at the last evaluation.
        to: target -> per seed, :func:`time_to_accuracy`.
    """

    final: list[float | None]
    seconds: list[float | None]
    to: dict[float, list[float | None]]


def time_to_accuracy_rows(
    curves: Mapping[str, Sequence[Curve]], targets: Sequence[float], lower_is_better: bool = False
) -> dict[str, MethodTimes]:
    """Per method, :class:`MethodTimes` of its seeds.

    Args:
        curves: method -> one curve per seed.
        targets: accuracies in percent (or the metric's values).
        lower_is_better: the metric is a loss.
    """
    return {
        method: MethodTimes(
            final=[c[-1][1] if c else None for c in seeds],
            seconds=[c[-1][0] if c else None for c in seeds],
            to={t: [time_to_accuracy(c, t, lower_is_better) for c in seeds] for t in targets},
        )
        for method, seeds in curves.items()
    }


def _reached(values: Sequence[float | None], spec: str = ".1f", none: str = "never") -> str:
    """Mean ± std over the seeds that have a value (reached the target, or evaluated by the
    budget), and how many do when not all; ``none`` when no seed has one."""
    got = [v for v in values if v is not None]
    if not got:
        return none
    cell = fmt_mean_std(got, spec)
    return cell if len(got) == len(values) else f"{cell} ({len(got)}/{len(values)} seeds)"


def _all_mean(times: Sequence[float | None]) -> float | None:
    """The mean when every seed has a time, else None."""
    return None if not times or any(t is None for t in times) else mean_std(times)[0]


def time_to_accuracy_table(
    curves: Mapping[str, Sequence[Curve]],
    targets: Sequence[float],
    reference: str | None = "allreduce",
    speedup_at: float | None = 90.0,
) -> str:
    """Seconds to each target accuracy (mean ± std over the seeds that reached it), the final
    accuracy and training seconds, and the speed-up over ``reference`` to ``speedup_at``: the
    ratio of the mean times, where every seed of both reached it.

    Args:
        curves: method -> one curve per seed, in the table's order.
        targets: accuracies in percent.
        reference: the method the speed-up is against (None or absent: no such column).
        speedup_at: the target of the speed-up column (one of ``targets``).
    """
    rows = time_to_accuracy_rows(curves, targets)
    speedup: tuple[str, float] | None = None  # (reference, target) of the speed-up column
    if reference in rows and speedup_at in targets:
        assert reference is not None and speedup_at is not None
        speedup = (reference, speedup_at)
    ref = _all_mean(rows[speedup[0]].to[speedup[1]]) if speedup else None
    table = []
    for method, r in rows.items():
        cells = [
            method,
            str(len(r.final)),
            fmt_mean_std(r.final, ".2f"),
            fmt_mean_std(r.seconds, ".1f"),
        ]
        cells += [_reached(r.to[t]) for t in targets]
        if speedup:
            mine = _all_mean(r.to[speedup[1]])
            cells.append(f"{ref / mine:.2f}x" if ref and mine else "-")
        table.append(cells)
    headers = ["Method", "Seeds", "Final acc %", "Train s (total)"]
    headers += [f"s to {t:g}%" for t in targets]
    if speedup:
        headers.append(f"speed-up to {speedup_at:g}% vs {reference}")
    return text_table(headers, table)


def loss_targets(finals: Mapping[str, Sequence[float | None]]) -> list[float]:
    """The losses to time, in decreasing order: each method's mean final loss, rounded up to
    0.01 (so that each method, on average, reaches its own).

    Args:
        finals: method -> its seeds' final losses.
    """
    means = [m for m in (mean_std(v)[0] for v in finals.values()) if m is not None]
    return sorted({math.ceil(m * 100 - 1e-9) / 100 for m in means}, reverse=True)


def loss_table(
    curves: Mapping[str, Sequence[Curve]],
    targets: Sequence[float],
    reference: str | None = "allreduce",
) -> str:
    """The validation loss at equal training seconds and the seconds to each target loss.

    The equal-seconds budget is the shortest run's training time, so every run is compared at
    a time it reached; each run contributes its last evaluation at or before it. The speed-up
    is ``reference``'s mean time to the highest (loosest) target over the method's, where
    every seed of both reached it.

    Args:
        curves: method -> one curve per seed (``val/loss``), in the table's order.
        targets: losses, e.g. :func:`loss_targets`.
        reference: the method the speed-up is against (None or absent: no such column).
    """
    rows = time_to_accuracy_rows(curves, targets, lower_is_better=True)
    ends = [s for r in rows.values() for s in r.seconds if s is not None]
    budget = min(ends) if ends else None
    loosest = max(targets) if targets else None
    ref = None
    if reference in rows and loosest is not None:
        ref = _all_mean(rows[reference].to[loosest])
    table = []
    for method, r in rows.items():
        at = [
            value_at_seconds(c, budget) if c and budget is not None else None
            for c in curves[method]
        ]
        cells = [method, str(len(r.final)), fmt_mean_std(r.final, ".3f")]
        cells += [fmt_mean_std(r.seconds, ".1f"), _reached(at, ".3f", none="-")]
        cells += [_reached(r.to[t]) for t in targets]
        if ref is not None:
            mine = _all_mean(r.to[loosest])
            cells.append(f"{ref / mine:.2f}x" if mine else "-")
        table.append(cells)
    headers = ["Method", "Seeds", "Final loss", "Train s (total)"]
    headers.append(f"loss at {budget:.1f} s" if budget is not None else "loss at equal s")
    headers += [f"s to {t:g}" for t in targets]
    if ref is not None:
        headers.append(f"speed-up to {loosest:g} vs {reference}")
    return text_table(headers, table)


def plot_accuracy_vs_seconds(
    ax: Any, curves: Mapping[str, Sequence[Curve]], metric: str = "accuracy (%)"
) -> None:
    """Draw each method's accuracy (or another metric) against training seconds on a
    matplotlib axis: at every evaluation, the mean over seeds of both, with a band from the
    lowest to the highest value.

    Args:
        ax: a matplotlib ``Axes``.
        curves: method -> one curve per seed.
        metric: the y axis's label.
    """
    for method, seeds in curves.items():
        n = min((len(c) for c in seeds), default=0)
        if n == 0:
            continue
        xs = [sum(c[k][0] for c in seeds) / len(seeds) for k in range(n)]
        accs = [[c[k][1] for c in seeds] for k in range(n)]
        (line,) = ax.plot(
            xs, [sum(a) / len(a) for a in accs], marker=".", label=f"{method} (n={len(seeds)})"
        )
        ax.fill_between(
            xs, [min(a) for a in accs], [max(a) for a in accs], color=line.get_color(), alpha=0.2
        )
    ax.set(
        title=f"{metric.split(' (')[0].capitalize()} vs training seconds\n"
        "mean over seeds, band: lowest to highest",
        xlabel="training seconds (evaluation excluded)",
        ylabel=metric,
    )
    if ax.lines:
        ax.legend(fontsize=7)


def seconds_panel(ax: Any, settings: Sequence[Any], tag: str = TAGS["val_accuracy"]) -> None:
    """The accuracy-vs-seconds panel of :func:`slowmo_lab.report.plot` (its
    ``extra_panel``; ``functools.partial`` it with ``tag`` for the validation loss): each
    setting's runs' curves.

    Args:
        ax: the matplotlib axes.
        settings: :func:`slowmo_lab.report.group_settings` output.
        tag: the metric's TensorBoard tag.
    """
    curves = {st.name: [run_curve(r, tag) for r in st.runs] for st in settings}
    metric = "accuracy (%)" if tag == TAGS["val_accuracy"] else "validation loss"
    plot_accuracy_vs_seconds(ax, curves, metric)
