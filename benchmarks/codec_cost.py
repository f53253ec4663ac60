"""CPU (or GPU) time of each codec of the compressed average, per MB of float32 input.

Times the pure codec functions alone, no communication: ``encode`` (a worker's share of the
work before the wire) and ``decode`` (after it), median of ``--repeats`` calls after one warm-up,
on a random vector of ``--numel`` elements. The dense codecs (:mod:`hvd_slowmo.compression.codecs`)
are timed on the whole vector; the sparse codec's ``decode`` is the decode of one packet into
positions and values (the exchange adds ``m`` of them). Timings: run it alone on a quiet machine.
Example::

    python benchmarks/codec_cost.py --numel 10000000 --threads 1
"""

import argparse
import statistics
import time

import torch

from hvd_slowmo.compression import CODECS, SparseCodec, decode, encode, sparse_decode, sparse_encode

SPARSE = {
    "sparse 2%, 2 bits": SparseCodec(density=0.02, bits=2),
    "sparse 2%, 4 bits": SparseCodec(density=0.02, bits=4),
}


def median_ms(fn, repeats: int, device: torch.device) -> float:
    """Median wall time of ``fn()`` in ms (after one warm-up call)."""
    fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=int, default=10_000_000, help="vector length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0)).to(device)
    mb = 4 * args.numel / 1e6
    print(f"{args.numel:,} float32 ({mb:.0f} MB) on {device}, {torch.get_num_threads()} threads")
    print("| codec | encode ms/MB | decode ms/MB |")
    print("|---|---|---|")
    for codec in CODECS:
        if codec == "fp8" and device.type == "cpu" and not hasattr(torch, "float8_e4m3fn"):
            continue
        enc = encode(x, codec)
        e = median_ms(lambda c=codec: encode(x, c), args.repeats, device)
        d = median_ms(lambda c=codec, z=enc: decode(z, c), args.repeats, device)
        print(f"| {codec} | {e / mb:.3f} | {d / mb:.3f} |")
    for label, spec in SPARSE.items():
        packet = sparse_encode(x, spec)
        e = median_ms(lambda s=spec: sparse_encode(x, s), args.repeats, device)
        d = median_ms(lambda s=spec, p=packet: sparse_decode(p, x.numel(), s), args.repeats, device)
        print(f"| {label} | {e / mb:.3f} | {d / mb:.3f} |")


if __name__ == "__main__":
    main()
