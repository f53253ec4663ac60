"""Compute utilization of the outer exchange's codecs on the emulated cluster: measured against
analytic, at several link rates (SlowMo, arXiv 1910.00643; the table diloco-measured reports).

From the ``results.json`` of ``benchmarks/cluster.py`` runs (one per ``--rate``, or several rates
in one), for fp32, int8 and the sparse codec, each without overlap (one exact average every tau
steps) and streamed (``fragments=4, overlap=3``):

* **measured** utilization: the compute-only row's ms/iteration over the row's ms/iteration,
  both from the same run;
* **analytic** utilization: ``compute / (compute + exposed wire time)`` per iteration, the wire
  time from the bytes the row itself sent per outer step (its recorded
  ``bytes_per_outer_step``: the averages started in the timed periods, the last one flushed;
  results without it: ``bytes_per_iter`` times tau) at the link rate; an average in flight
  for ``overlap`` steps hides up to ``overlap`` steps of compute, each of the ``fragments``
  averages of a period its own share (:func:`analytic_utilization`). The codec's CPU time and
  the wire's latency are left out: the gap between the two columns is what they cost.

Usage::

    python benchmarks/utilization.py runs/util_10mbit/results.json runs/util_50mbit/results.json ...
    python benchmarks/utilization.py --estimate --params 10M --rate 10mbit,100mbit
"""

import argparse
import json
import math
import os
import sys
from collections.abc import Sequence
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the cluster_* modules beside it
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cluster_algorithms import ALGORITHM_BY_KEY, ALGORITHM_SETS, WARMUP_ITERS
from cluster_report import human

__all__ = [
    "ROWS",
    "analytic_utilization",
    "estimate_wall_s",
    "outer_step_bytes",
    "utilization_markdown",
    "utilization_rows",
]

#: The table's rows: (codec, streamed) -> the cluster row measured for it.
ROWS = {
    ("fp32", False): "localsgd_slowmo",
    ("int8", False): "localsgd_slowmo_int8",
    ("sparse", False): "localsgd_slowmo_sparse",
    ("fp32", True): "localsgd_slowmo_stream4",
    ("int8", True): "localsgd_slowmo_stream4_int8",
    ("sparse", True): "localsgd_slowmo_stream4_sparse",
}


def analytic_utilization(
    compute_ms: float,
    outer_bytes: float,
    rate_bits_per_s: float,
    tau: int,
    fragments: int = 1,
    overlap: int = 0,
) -> float:
    """``compute / (compute + exposed wire time)`` over one outer period.

    The period holds ``tau`` steps of compute and ``fragments`` averages of ``outer_bytes /
    fragments`` each; an average's wire time beyond ``overlap`` steps of compute is exposed (the
    worker waits for it at its landing): ``exposed = fragments * max(0, W / fragments - overlap
    * compute)`` with ``W = 8 * outer_bytes / rate``.

    Args:
        compute_ms: compute per iteration (ms).
        outer_bytes: bytes one worker sends per outer step (all fragments).
        rate_bits_per_s: the link rate.
        tau: steps per outer period.
        fragments: averages per period (streaming), each of an equal share of the bytes.
        overlap: steps each average runs behind.

    Raises:
        ValueError: a rate, tau or fragment count below 1, or a negative time, byte count or
            overlap.
    """
    if rate_bits_per_s <= 0 or tau < 1 or fragments < 1:
        raise ValueError(
            f"analytic_utilization: need rate > 0, tau >= 1, fragments >= 1, got rate="
            f"{rate_bits_per_s}, tau={tau}, fragments={fragments}"
        )
    if compute_ms < 0 or outer_bytes < 0 or overlap < 0:
        raise ValueError(
            f"analytic_utilization: need compute_ms, outer_bytes, overlap >= 0, got "
            f"{compute_ms}, {outer_bytes}, {overlap}"
        )
    wire_ms = 8e3 * outer_bytes / rate_bits_per_s
    exposed = fragments * max(0.0, wire_ms / fragments - overlap * compute_ms)
    busy = tau * compute_ms
    return busy / (busy + exposed) if busy + exposed > 0 else 1.0


def _shape(key: str) -> tuple[int, int, int]:
    """(tau, fragments, overlap) of a cluster row."""
    algo = ALGORITHM_BY_KEY[key]
    return algo.tau, int(algo.options.get("fragments", 1)), algo.overlap


def utilization_rows(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per (run, table row) measured: parameters, rate, codec, streamed, bytes per
    outer step, measured and analytic utilization.

    Args:
        runs: the runs of one or more ``results.json`` files (``{"header", "results"}`` each);
            a run without a compute-only row, or a row not measured or not available, gives
            nothing.
    """
    out = []
    for run in runs:
        h, results = run["header"], run["results"]
        compute = results.get("compute", {})
        if not compute.get("available", True) or compute.get("median_ms") is None:
            continue
        c = compute["median_ms"]
        for (codec, streamed), key in ROWS.items():
            r = results.get(key)
            if r is None or not r.get("available", True) or r.get("median_ms") is None:
                continue
            tau, fragments, overlap = _shape(key)
            # The averages of whole periods, flushed (older results: the timed steps' bytes).
            outer = r.get("bytes_per_outer_step", r["bytes_per_iter"] * tau)
            out.append(
                {
                    "params": h.get("params"),
                    "rate": h["rate"],
                    "rate_bits_per_s": h["rate_bits_per_s"],
                    "codec": codec,
                    "streamed": streamed,
                    "key": key,
                    "outer_bytes": outer,
                    "measured": c / r["median_ms"],
                    "analytic": analytic_utilization(
                        c, outer, h["rate_bits_per_s"], tau, fragments, overlap
                    ),
                }
            )
    return out


def utilization_markdown(runs: Sequence[dict[str, Any]]) -> str:
    """The table, one per model size: a row per (codec, streamed), a column per rate (slowest
    first), each cell ``measured / analytic`` in percent.

    Args:
        runs: as for :func:`utilization_rows`.
    """
    records = utilization_rows(runs)
    out = []
    for params in sorted({r["params"] for r in records}, key=lambda p: p or 0):
        mine = [r for r in records if r["params"] == params]
        rates = sorted({(r["rate_bits_per_s"], r["rate"]) for r in mine})
        out += [
            f"### {human(params or 0)} parameters: utilization, measured / analytic",
            "",
            "| codec | streamed | bytes / worker / outer step | "
            + " | ".join(name for _, name in rates)
            + " |",
            "|---|---|---|" + "---|" * len(rates),
        ]
        for codec, streamed in ROWS:
            row = {r["rate"]: r for r in mine if (r["codec"], r["streamed"]) == (codec, streamed)}
            if not row:
                continue
            sent = sorted({human(round(r["outer_bytes"])) + "B" for r in row.values()})
            cells = [
                f"{100 * row[name]['measured']:.1f}% / {100 * row[name]['analytic']:.1f}%"
                if name in row
                else "-"
                for _, name in rates
            ]
            label = "fragments=4, overlap=3" if streamed else "no overlap"
            out.append(f"| {codec} | {label} | {', '.join(sent)} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def outer_step_bytes(key: str, params: int, workers: int) -> float:
    """Bytes one worker sends per outer step in row ``key``, from the exchange's formula (what
    the communicator counts): a ring allreduce of fp32, int8's all-to-all and all-gather of
    codes and block scales, the sparse all-gather of ``workers - 1`` packets.

    Args:
        key: a row of :data:`ROWS`.
        params: the model's parameters.
        workers: the workers.
    """
    from hvd_slowmo.compression import SparseCodec, encoded_nbytes, packet_nbytes

    codec = ALGORITHM_BY_KEY[key].options.get("codec")
    share = (workers - 1) / workers
    if codec is None:
        return 2 * share * 4 * params
    if codec == "int8":
        return 2 * share * encoded_nbytes(params, "int8")
    fragments = int(ALGORITHM_BY_KEY[key].options.get("fragments", 1))
    return (workers - 1) * fragments * packet_nbytes(math.ceil(params / fragments), SparseCodec())


def estimate_wall_s(
    keys: Sequence[str],
    params: int,
    rate_bits_per_s: float,
    compute_ms: float,
    iters: int,
    workers: int = 4,
    startup_s: float = 30.0,
) -> float:
    """A rough wall time of one ``cluster.py`` workload at one rate: per row its warm-up and
    timed iterations of compute plus the exposed wire time of the outer steps they hold (from
    :func:`outer_step_bytes` and :func:`analytic_utilization`), plus ``startup_s`` per row
    (model, optimizer, the outer steps flushed at the end) and per launch.

    Args:
        keys: the rows (``"compute"`` included or not).
        params: the model's parameters.
        rate_bits_per_s: the link rate.
        compute_ms: compute per iteration.
        iters: timed iterations per row.
        workers: the hosts.
        startup_s: seconds of fixed cost per row.
    """
    total = startup_s
    steps = iters + WARMUP_ITERS
    for key in keys:
        total += startup_s / 3 + steps * compute_ms / 1e3
        if key in ROWS.values():
            tau, fragments, overlap = _shape(key)
            outer = outer_step_bytes(key, params, workers)
            u = analytic_utilization(compute_ms, outer, rate_bits_per_s, tau, fragments, overlap)
            total += steps * compute_ms / 1e3 * (1 / u - 1) + 8 * outer / rate_bits_per_s
    return total


def main(argv: Sequence[str] | None = None) -> int:
    """The command line (see the module docstring).

    Args:
        argv: the arguments (None: ``sys.argv[1:]``).
    """
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("results", nargs="*", help="results.json files of benchmarks/cluster.py")
    p.add_argument("--estimate", action="store_true", help="print estimated wall times instead")
    p.add_argument("--params", default="10M", help="--estimate: the model size")
    p.add_argument("--rate", default="10mbit,50mbit,100mbit,200mbit,1gbit", help="--estimate")
    p.add_argument("--compute-ms", type=float, default=1000.0, help="--estimate")
    p.add_argument("--iters", type=int, default=12, help="--estimate")
    p.add_argument("--algorithms", default="utilization", help="--estimate: keys or a set")
    args = p.parse_args(argv)
    if args.estimate:
        from cluster import parse_count

        from slowmo_lab.netns import parse_rate

        keys = [k for n in args.algorithms.split(",") for k in ALGORITHM_SETS.get(n, (n,))]
        params = parse_count(args.params)
        for rate in args.rate.split(","):
            s = estimate_wall_s(keys, params, parse_rate(rate), args.compute_ms, args.iters)
            print(f"{args.params} at {rate}: about {s / 60:.1f} min ({len(keys)} rows)")
        return 0
    if not args.results:
        p.error("give results.json files, or --estimate")
    runs = []
    for path in args.results:
        with open(path) as f:
            runs += json.load(f)
    print(utilization_markdown(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
