"""The planner against the emulated cluster: predicted and measured ms per iteration.

Reads the ``results.json`` of ``benchmarks/cluster.py`` runs and, for every SlowMo row with
fp32, int8 or the sparse codec (over Local SGD, no eager update, mixing or averaged buffers),
gives :func:`hvd_slowmo.plan.print_calibration` the row: its hosts,
rate, codec, fragments, overlap, tau and parameters, the run's compute-only ms per iteration as
the step time, and the row's measured ms per iteration. Prints the Markdown table, the largest
relative error, and the largest among the rows inside the calibrated regime (those without a
``(!)``: :attr:`hvd_slowmo.plan.Prediction.warning`).

First it fits the model's one all-to-all constant, :data:`hvd_slowmo.plan.ALLTOALL_CONTENTION`,
on the row named by ``--fit`` (the value that predicts that row's measured time exactly), prints
it beside the code's value, and names the row used to fit and the rows held out; the table
uses the code's value (or ``--contention``'s), and the largest error among the held-out rows
is printed. Usage (the commands that make the runs: docs/planner.md)::

    python benchmarks/plan_calibration.py runs/plan_*/results.json [--codec-cost int8=1.12]

The codecs' cost defaults to :data:`RUNS_CODEC_MS_PER_MB`, what the recorded runs' code cost.
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the cluster_* modules beside it
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster_algorithms import ALGORITHM_BY_KEY

from hvd_slowmo.plan import (
    ALLTOALL_CONTENTION,
    Measured,
    calibration_rows,
    print_calibration,
)

#: The codecs' cost per MB as the calibration runs (2026-11-28) executed them: the eager torch
#: path, before the C kernels (hvd_slowmo.compression.native) made the CPU's codecs 3-8x
#: cheaper; ``hvd_slowmo.plan.CODEC_MS_PER_MB`` now holds those. The model is checked on what
#: the runs ran; ``--codec-cost`` overrides.
RUNS_CODEC_MS_PER_MB = {
    "fp32": 0.0, "fp16": 0.98, "bf16": 0.90, "int8": 1.12, "fp8": 2.54, "sparse": 4.61,
    "sparse-owners": 4.61,
}  # fmt: skip

#: The options the model covers (buffers only "reset": averaged buffers add traffic).
_MODELLED = {
    "codec", "fragments", "overlap", "error_feedback", "slow_lr", "slow_momentum", "buffers"
}  # fmt: skip


def measured_rows(runs: list[dict]) -> list[Measured]:
    """The rows the model covers, from ``{"header", "results"}`` runs.

    Args:
        runs: the runs of one or more ``results.json`` files.
    """
    rows = []
    for run in runs:
        h, results = run["header"], run["results"]
        compute = results.get("compute", {}).get("median_ms")
        if compute is None:
            continue
        for key, r in sorted(results.items()):
            algo = ALGORITHM_BY_KEY.get(key)
            if algo is None or algo.kind != "slowmo" or algo.base != "localsgd":
                continue
            if set(algo.options) - _MODELLED or algo.options.get("buffers", "reset") != "reset":
                continue
            if r.get("median_ms") is None:
                continue
            codec = algo.options.get("codec") or "fp32"
            if not isinstance(codec, str) or codec not in ("fp32", "int8", "sparse"):
                continue
            fragments = int(algo.options.get("fragments", 1))
            rows.append(
                Measured(
                    h["hosts"], h["rate"], codec, fragments, algo.overlap, algo.tau, h["params"],
                    compute, r["median_ms"],
                )
            )  # fmt: skip
    return rows


def fit_contention(row: Measured, costs: dict[str, float], **settings) -> float:
    """The all-to-all contention at which the model predicts ``row``'s measured time.

    The prediction grows with the contention (a slower all-to-all is never hidden better), so
    bisection finds it; 0 where the row is no slower than the model without the term.

    Args:
        row: the row to fit on; its exchange must have an all-to-all on the slow link that is
            not hidden behind the compute, or no contention changes its prediction.
        costs: the codecs' cost.
        settings: :func:`hvd_slowmo.plan.calibration_rows`'s other arguments.
    """

    def predicted_ms(contention: float) -> float:
        ((_, p),) = calibration_rows([row], costs, alltoall_contention=contention, **settings)
        return 1e3 * p.iteration_s

    low, high = 0.0, 64.0
    if predicted_ms(low) >= row.measured_ms:
        return low
    if predicted_ms(high) < row.measured_ms:
        sys.exit(
            f"plan_calibration: no contention up to {high} reaches {_row_name(row)}'s measured "
            "time: fit on a row whose all-to-all crosses 3 or more hosts and is not hidden"
        )
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if predicted_ms(mid) < row.measured_ms else (low, mid)
    return (low + high) / 2


def _row_name(r: Measured) -> str:
    return f"{r.hosts} hosts, {r.rate}, {r.codec}"


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("results", nargs="+", help="results.json files of benchmarks/cluster.py")
    parser.add_argument("--codec-cost", default=None, help="e.g. int8=1.12,sparse=4.61")
    parser.add_argument(
        "--link-efficiency", type=float, default=1.0, help="fraction of the rate reached (1.0)"
    )
    parser.add_argument(
        "--codec-on-compute",
        action="store_true",
        help="the codec takes its time from the compute (shared CPU cores): overlap hides only "
        "the wire",
    )
    parser.add_argument(
        "--fit",
        default="4,10mbit,int8",
        help="HOSTS,RATE,CODEC: the row that fits ALLTOALL_CONTENTION (default 4,10mbit,int8)",
    )
    parser.add_argument(
        "--contention",
        type=float,
        default=None,
        help="the all-to-all contention of the table (default: the code's ALLTOALL_CONTENTION)",
    )
    args = parser.parse_args(argv)
    runs = []
    for path in args.results:
        with open(path) as f:
            data = json.load(f)
        runs += data if isinstance(data, list) else data.get("runs", [data])
    costs = dict(RUNS_CODEC_MS_PER_MB)
    for item in filter(None, (args.codec_cost or "").split(",")):
        name, _, value = item.partition("=")
        costs[name] = float(value)
    rows = measured_rows(runs)
    if not rows:
        sys.exit("plan_calibration: no fp32/int8/sparse SlowMo row with a compute-only row")
    settings = {"link_efficiency": args.link_efficiency, "codec_hidden": not args.codec_on_compute}
    hosts, rate, codec = (args.fit.split(",") + ["", "", ""])[:3]
    fit = [r for r in rows if (str(r.hosts), r.rate, r.codec) == (hosts, rate, codec)]
    if len(fit) != 1:
        sys.exit(f"plan_calibration: --fit {args.fit!r} names {len(fit)} rows, not one")
    fitted = fit_contention(fit[0], costs, **settings)
    contention = ALLTOALL_CONTENTION if args.contention is None else args.contention
    # The held-out rows whose prediction the all-to-all term changes test it; the others
    # (no all-to-all across nodes, two nodes, or an exchange hidden either way) test that it
    # leaves them alone.
    without = calibration_rows(rows, costs, alltoall_contention=0.0, **settings)
    with_term = calibration_rows(rows, costs, alltoall_contention=contention, **settings)
    changed = [
        r
        for (r, p0), (_, p) in zip(without, with_term)
        if abs(p.iteration_s - p0.iteration_s) > 5e-4
    ]
    held_changed = [r for r in changed if r is not fit[0]]
    print(
        f"Fitted on 1 row: {_row_name(fit[0])} (measured {fit[0].measured_ms:.0f} ms): all-to-all "
        f"contention {fitted:.3f}; the table uses {contention:g} (the code's "
        f"ALLTOALL_CONTENTION: {ALLTOALL_CONTENTION:g}).\nHeld out: the other {len(rows) - 1} "
        f"rows; the term changes the prediction of {len(held_changed)} of them ("
        + ("; ".join(_row_name(r) for r in held_changed) or "none")
        + f") and leaves the other {len(rows) - 1 - len(held_changed)} as they were.\n"
    )
    worst = print_calibration(rows, costs, alltoall_contention=contention, **settings)
    errors = [(r, abs(1e3 * p.iteration_s / r.measured_ms - 1), p.warning) for r, p in with_term]
    inside = [e for _, e, warning in errors if not warning]
    held = [e for r, e, _ in errors if r is not fit[0]]
    print(
        f"\n{len(rows)} rows; the largest error {100 * worst:.1f}%; {len(held)} held out of the "
        f"fit: the largest error {100 * max(held, default=0.0):.1f}%; {len(inside)} inside the "
        f"calibrated regime (no (!)): the largest error {100 * max(inside, default=0.0):.1f}%"
    )
    return worst


if __name__ == "__main__":
    main()
