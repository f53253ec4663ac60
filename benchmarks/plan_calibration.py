"""The planner against the emulated cluster: predicted and measured ms per iteration.

Reads the ``results.json`` of ``benchmarks/cluster.py`` runs and, for every SlowMo row with
fp32, int8 or the sparse codec (over Local SGD, no eager update, mixing or averaged buffers),
gives :func:`hvd_slowmo.plan.print_calibration` the row: its hosts,
rate, codec, fragments, overlap, tau and parameters, the run's compute-only ms per iteration as
the step time, and the row's measured ms per iteration. Prints the Markdown table, the largest
relative error, and the largest among the rows inside the calibrated regime (those without a
``(!)``: :attr:`hvd_slowmo.plan.Prediction.warning`). Usage (the commands that make the runs:
docs/planner.md)::

    python benchmarks/plan_calibration.py runs/plan_*/results.json [--codec-cost int8=1.12]
"""

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the cluster_* modules beside it
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster_algorithms import ALGORITHM_BY_KEY

from hvd_slowmo.plan import CODEC_MS_PER_MB, Measured, calibration_rows, print_calibration

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
    args = parser.parse_args(argv)
    runs = []
    for path in args.results:
        with open(path) as f:
            data = json.load(f)
        runs += data if isinstance(data, list) else data.get("runs", [data])
    costs = dict(CODEC_MS_PER_MB)
    for item in filter(None, (args.codec_cost or "").split(",")):
        name, _, value = item.partition("=")
        costs[name] = float(value)
    rows = measured_rows(runs)
    if not rows:
        sys.exit("plan_calibration: no fp32/int8/sparse SlowMo row with a compute-only row")
    settings = {"link_efficiency": args.link_efficiency, "codec_hidden": not args.codec_on_compute}
    worst = print_calibration(rows, costs, **settings)
    inside = [
        abs(1e3 * p.iteration_s / r.measured_ms - 1)
        for r, p in calibration_rows(rows, costs, **settings)
        if not p.warning
    ]
    print(
        f"\n{len(rows)} rows; the largest error {100 * worst:.1f}%; {len(inside)} inside the "
        f"calibrated regime (no (!)): the largest error {100 * max(inside, default=0.0):.1f}%"
    )
    return worst


if __name__ == "__main__":
    main()
