"""Bytes per worker per outer step of each exchange, from 2 to 64 workers, and the check that
the communicator counts them.

For fp32 (ring allreduce), int8 (all-to-all and all-gather), the sparse all-gather
(:class:`~hvd_slowmo.compression.SparseCodec`'s defaults: 2% of 4096, 2 bits), the same codec
reduced at owners (``exchange="owners"``: :mod:`hvd_slowmo.compression.sparse_owners`) and
hierarchical
(exact fp32 inside a node of ``--per-node``, int8 or sparse across nodes:
:func:`~hvd_slowmo.compression.hierarchical_mean`), the table gives what the busiest worker
sends per outer step of ``--numel`` parameters, from the planner's formulas
(:func:`hvd_slowmo.plan.exchange_traffic`, over the codecs' real packet sizes); a hierarchical
cell also gives the part that crosses nodes. Then, at every size up to ``--check-up-to``, the
same exchanges run on thread workers over ``--check-numel`` values and each worker's byte
counter (``bytes_sent``) is compared with the formula: a mismatch stops the script. Bytes, not
timings: the numbers do not depend on the machine or its load. Example::

    python benchmarks/exchange_bytes.py --numel 10M --workers 2 4 8 16 32 64
    python benchmarks/exchange_bytes.py --check-numel 3000 --check-up-to 16   # seconds
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.compression import SparseCodec, compressed_mean, hierarchical_mean, sparse_mean
from hvd_slowmo.compression.means import mean_start
from hvd_slowmo.plan import Cluster, Setting, exchange_traffic, parse_count

#: The table's rows: label -> (codec, hierarchical).
ROWS = {
    "fp32 allreduce": ("fp32", False),
    "int8": ("int8", False),
    "sparse all-gather": ("sparse", False),
    "sparse owners": ("sparse-owners", False),
    "hierarchical int8": ("int8", True),
    "hierarchical sparse": ("sparse", True),
}


def planned(label: str, numel: int, workers: int, per_node: int) -> tuple[int, int] | None:
    """(bytes the busiest worker sends, of which across nodes) for one exchange, or None where
    the row does not apply (hierarchical with a single node)."""
    codec, hierarchical = ROWS[label]
    g = per_node if hierarchical else 1
    if hierarchical and (workers % g or workers <= g):
        return None
    t = exchange_traffic(Setting(codec, hierarchical), numel, Cluster(workers, g))
    across = sum(p.link_bytes for p in t.phases if p.link == "cross") / g
    return t.sent, round(across) if hierarchical else t.sent


def counted(numel: int, workers: int, per_node: int) -> dict[str, int]:
    """Each row's largest ``bytes_sent`` over the workers, measured on thread workers."""
    nodes = [list(range(s, s + per_node)) for s in range(0, workers, per_node)]
    peers = [[n[lr] for n in nodes] for lr in range(per_node)]
    hierarchical = workers % per_node == 0 and workers > per_node

    def fn(comm):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(comm.rank))
        out = {}
        before = comm.bytes_sent
        comm.average_([x.clone()], "fp32")
        out["fp32 allreduce"] = comm.bytes_sent - before
        before = comm.bytes_sent
        compressed_mean(comm, x, "int8", "int8")
        out["int8"] = comm.bytes_sent - before
        before = comm.bytes_sent
        sparse_mean(comm, x, SparseCodec(), "sparse")
        out["sparse all-gather"] = comm.bytes_sent - before
        before = comm.bytes_sent
        mean_start(SparseCodec(exchange="owners"), comm, x, "owners").wait()
        out["sparse owners"] = comm.bytes_sent - before
        if hierarchical:
            node, cross = comm.world.split(nodes)[comm.rank], comm.world.split(peers)[comm.rank]
            for label, codec in (("hierarchical int8", "int8"), ("hierarchical sparse", "sparse")):
                before = node.bytes_sent + cross.bytes_sent
                hierarchical_mean(node, cross, x, codec, label)
                out[label] = node.bytes_sent + cross.bytes_sent - before
        return out

    per_worker = run_threads(workers, fn, timeout=600)
    return {label: max(r[label] for r in per_worker) for label in per_worker[0]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--numel", default="10M", help="parameters per outer step (10M)")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64])
    parser.add_argument("--per-node", type=int, default=4, help="workers per node (4)")
    parser.add_argument("--check-numel", type=int, default=20_000, help="values on threads")
    parser.add_argument("--check-up-to", type=int, default=64, help="largest size checked")
    args = parser.parse_args(argv)
    numel = parse_count(args.numel, "--numel")
    print(
        f"bytes the busiest worker sends per outer step of {numel:,} float32 parameters "
        f"(hierarchical: nodes of {args.per_node}; 'x' = fp32's bytes / the row's; in "
        "brackets, the bytes that cross nodes)"
    )
    print("| exchange | " + " | ".join(f"m={m}" for m in args.workers) + " |")
    print("|---" * (len(args.workers) + 1) + "|")
    for label in ROWS:
        cells = []
        for m in args.workers:
            got = planned(label, numel, m, args.per_node)
            fp32 = planned("fp32 allreduce", numel, m, 1)
            if got is None or fp32 is None:
                cells.append("-")
                continue
            sent, across = got
            ratio = f" ({fp32[0] / sent:.1f}x)" if sent else ""
            extra = f" [{across:,} across, {fp32[0] / across:.0f}x]" if across != sent else ""
            cells.append(f"{sent:,}{ratio}{extra}")
        print(f"| {label} | " + " | ".join(cells) + " |")
    for m in [m for m in args.workers if m <= args.check_up_to]:
        got = counted(args.check_numel, m, args.per_node)
        for label, nbytes in got.items():
            want = planned(label, args.check_numel, m, args.per_node)
            if want is None or nbytes != want[0]:
                sys.exit(f"m={m} {label}: the counter says {nbytes}, the formula {want}")
        print(f"checked at m={m}: {len(got)} exchanges of {args.check_numel:,} values, every "
              "counter equal to the formula")  # fmt: skip


if __name__ == "__main__":
    main()
