"""Bytes on the wire per exact average, for each codec of the compressed average.

The dense codecs reduce through an all-to-all and an all-gather; the sparse codec
(:class:`~hvd_slowmo.compression.SparseCodec`, docs/sparse.md) through one all-gather of
``m - 1`` packets per worker, so its bytes grow with the number of workers. Runs the reduction
for real (thread communicator: every worker a thread of this process) on a
flat float32 vector, and reads each worker's ``bytes_sent``; the ``fp32 allreduce`` row is the
uncompressed exact average (``Communicator.average_``, counted at a ring allreduce's volume).
Bytes, not timings: the numbers do not depend on the machine. Example::

    python benchmarks/compression_bytes.py --numel 10000000 --workers 2 4 8
"""

import argparse

import torch

from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.compression import CODECS, SparseCodec, compressed_mean, sparse_mean

#: The sparse rows: SparseLoCo's 2% at 2 bits, Covenant-72B's 64 of 4096 at 2 bits, 2% at 4 bits.
SPARSE = {
    "sparse 2%, 2 bits": SparseCodec(density=0.02, bits=2),
    "sparse 64/4096, 2 bits": SparseCodec(density=64 / 4096, bits=2),
    "sparse 2%, 4 bits": SparseCodec(density=0.02, bits=4),
}


def measure(numel: int, workers: int, codec: str | SparseCodec | None) -> list[int]:
    """Each worker's bytes sent for one average of ``numel`` elements (``codec`` None: the
    uncompressed allreduce)."""

    def fn(comm):
        x = torch.randn(numel, generator=torch.Generator().manual_seed(comm.rank))
        if codec is None:
            comm.average_([x], "fp32")
        elif isinstance(codec, SparseCodec):
            sparse_mean(comm, x, codec, "sparse")
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
    labelled = [("fp32 allreduce", None), *((c, c) for c in CODECS), *SPARSE.items()]
    for label, codec in labelled:
        rows = [max(measure(args.numel, m, codec)) for m in args.workers]
        baseline = baseline or rows
        ratio = sum(rows) / sum(baseline)
        print(f"| {label} | " + " | ".join(f"{b:,}" for b in rows) + f" | {ratio:.4f} |")


if __name__ == "__main__":
    main()
