"""Memory per row of the emulated cluster, each row in a fresh process (issue 38, item 3).

``benchmarks/cluster.py`` runs its rows one after another in one worker process, so a row's
peak resident memory is the high-water mark of every row before it. This script runs
``cluster.py`` once per row instead (root: network namespaces), and prints per row the workers'
peak resident memory, what ``hvd_slowmo.memory.held_bytes`` says the optimizer holds, and the
rest: the peak above the compute-only row (the framework, the parameters, their gradients and
the base optimizer's state) that the optimizer's held parts do not explain, in copies of the
model. That rest is the transients: Horovod's fusion buffer (64 MB by default), the codec's
temporaries, the allocator's per-thread arenas. Bytes, not time: a busy machine gives the same
figures, so this may run beside other work.

    sudo python benchmarks/memory_rows.py --params 10M        # and 50M (about 3 GB a worker)
    # glibc's free pages returned after every step, an 8 MB fusion buffer
    # (docs/results/memory-rows.md):
    HOROVOD_FUSION_THRESHOLD=8388608 sudo -E python benchmarks/memory_rows.py --params 10M \
        --release-free-pages step
"""

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from typing import Any

ROWS = (
    "compute",
    "localsgd_slowmo",
    "localsgd_slowmo_stream4",
    "localsgd_slowmo_stream4_int8",
    "localsgd_slowmo_stream4_sparse",
)
#: The environment that decides what a freed buffer leaves behind (printed with the table):
#: glibc's arenas and its mmap threshold, and Horovod's fusion buffer.
ALLOCATOR_SETTINGS = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "HOROVOD_FUSION_THRESHOLD")
#: The parts the compute-only row holds as well (the training itself, not SlowMo's).
TRAINING_PARTS = ("parameters", "gradients", "optimizer state")


def _records(raw: Any) -> Iterator[dict[str, Any]]:
    """Every measured row record (one with ``max_rss_mb``) in cluster.py's raw JSON."""
    if isinstance(raw, dict):
        if "max_rss_mb" in raw:
            yield raw
        for value in raw.values():
            yield from _records(value)
    elif isinstance(raw, list):
        for value in raw:
            yield from _records(value)


def measure(row: str, args: argparse.Namespace, out: str) -> dict[str, Any]:
    """Run ``cluster.py`` for ``row`` alone (a fresh worker process); its peak and held bytes.

    Args:
        row: a cluster.py algorithm key.
        args: this script's flags.
        out: a folder for cluster.py's output.
    """
    cmd = [
        sys.executable,
        os.path.join(os.path.dirname(os.path.abspath(__file__)), "cluster.py"),
        "--hosts", str(args.hosts), "--rate", "1gbit", "--params", args.params,
        "--compute-ms", str(args.compute_ms), "--windows", "1", "--algorithms", row,
        "--prefix", args.prefix, "--subnet", args.subnet, "--out", out,
    ]  # fmt: skip
    env = dict(os.environ, CLUSTER_RELEASE_FREE_PAGES=args.release_free_pages)
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, env=env)
    (path,) = glob.glob(os.path.join(out, "raw_*.json"))
    with open(path) as f:
        record = next(_records(json.load(f)))
    held = record.get("held_bytes") or {}
    return {"peak_mb": record["max_rss_mb"], "held_mb": {k: v / 2**20 for k, v in held.items()}}


def table(results: dict[str, dict[str, Any]], model_mb: float) -> str:
    """The rows as a Markdown table (the compute-only row first: the baseline).

    Args:
        results: row -> :func:`measure`'s output.
        model_mb: one copy of the model's parameters, in MB.
    """
    base = results["compute"]["peak_mb"]
    lines = [
        "| row | peak RSS / worker | above compute-only | SlowMo's parts held | rest (copies) |",
        "|---|---|---|---|---|",
    ]
    for row, r in results.items():
        above = r["peak_mb"] - base
        extra = sum(v for k, v in r["held_mb"].items() if k not in TRAINING_PARTS)
        rest = above - extra
        lines.append(
            f"| {row} | {r['peak_mb']:.0f} MB | {above:+.0f} MB | {extra:.0f} MB | "
            f"{rest:+.0f} MB ({rest / model_mb:+.1f}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Measure every row and print the table with the machine's load before and after."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params", default="10M", help="the synthetic model's size: 10M, 50M")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--compute-ms", type=float, default=200.0)
    p.add_argument("--rows", default=",".join(ROWS), help="cluster.py keys; compute first")
    p.add_argument("--prefix", default="hsmm", help="network namespaces' name prefix")
    p.add_argument("--subnet", default="10.79.4", help="the emulated hosts' /24")
    p.add_argument(
        "--release-free-pages",
        choices=("no", "step", "outer"),
        default="no",
        help="the workers call hvd_slowmo.memory.release_free_pages() after every step (every "
        "row, compute-only included), or after each outer step (the SlowMo rows)",
    )
    args = p.parse_args(argv)
    rows = args.rows.split(",")
    if rows[0] != "compute":
        raise ValueError(f"--rows must start with compute (the baseline), got {args.rows!r}")
    units = {"K": 1e3, "M": 1e6, "G": 1e9}
    params = float(args.params[:-1]) * units[args.params[-1]] if args.params[-1] in units else 0
    if params <= 0:
        raise ValueError(f"--params: a size such as 10M or 50M, got {args.params!r}")
    load = os.getloadavg()[0]
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for row in rows:
            results[row] = measure(row, args, os.path.join(tmp, row))
    settings = ", ".join(f"{k} {os.environ.get(k, 'unset')}" for k in ALLOCATOR_SETTINGS)
    settings += f", free pages released (hvd_slowmo.memory): {args.release_free_pages}"
    print(f"{args.params} parameters, {args.hosts} emulated hosts, {settings}, "
          f"1-minute load {load:.1f} before, {os.getloadavg()[0]:.1f} after")  # fmt: skip
    print(table(results, params * 4 / 2**20))


if __name__ == "__main__":
    main()
