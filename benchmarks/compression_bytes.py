"""Bytes on the wire per exact average, for each codec of the compressed average.

Runs the reduction for real (thread communicator: every worker a thread of this process) on a
flat float32 vector, and reads each worker's ``bytes_sent``; the ``fp32 allreduce`` row is the
uncompressed exact average (``Communicator.average_``, counted at a ring allreduce's volume).
Bytes, not timings: the numbers do not depend on the machine. Example::

    python benchmarks/compression_bytes.py --numel 10000000 --workers 2 4 8
"""

import argparse

import torch

from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.compression import CODECS, compressed_mean


def measure(numel: int, workers: int, codec: str | None) -> list[int]:
    """Each worker's bytes sent for one average of ``numel`` elements (``codec`` None: the
    uncompressed allreduce)."""

    def fn(comm):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(comm.rank))
        if codec is None:
            comm.average_([x], "fp32")
        else:
            compressed_mean(comm, x, codec, codec)
        return comm.bytes_sent

    return run_threads(workers, fn, timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=10_000_000, help="vector length")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4, 8])
    args = parser.parse_args()
    print(f"bytes sent per worker for one exact average of {args.numel:,} float32 elements")
    print("| exchange | " + " | ".join(f"m={m}" for m in args.workers) + " | vs fp32 |")
    print("|---" * (len(args.workers) + 2) + "|")
    baseline = None
    for codec in [None, *CODECS]:
        rows = [max(measure(args.numel, m, codec)) for m in args.workers]
        baseline = baseline or rows
        ratio = sum(rows) / sum(baseline)
        label = "fp32 allreduce" if codec is None else codec
        print(f"| {label} | " + " | ".join(f"{b:,}" for b in rows) + f" | {ratio:.4f} |")


if __name__ == "__main__":
    main()
