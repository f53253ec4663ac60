"""What each codec of a compressed exact average costs in arithmetic, per MB of float32 payload.

For every codec (fp16, bf16, int8, fp8, the sparse one with its defaults, and any other that
:mod:`hvd_slowmo.compression` has: each is tried, and one that does not work says why) on the
CPU and, where there is one, on the GPU, the median over repeats of:
  - encode: the codec's packet of the whole vector (:meth:`~hvd_slowmo.compression.Codec.encode`);
  - decode: the packet back to float32 (:meth:`~hvd_slowmo.compression.Codec.decode`);
  - mean: one worker's whole share of a compressed mean of ``--workers`` workers with error
    feedback, run by the library's own average (:func:`~hvd_slowmo.compression.means.mean_start`,
    into a buffer kept between means, as the library's averager keeps one; int8 on a CPU runs
    the C kernels of :mod:`hvd_slowmo.compression.native`, ``HVD_SLOWMO_NATIVE_CODECS=0`` the
    eager torch path)
    over an echo communicator whose every worker sends what this one sends, so the wire is a
    copy: the error feedback, the encode, (dense codecs) the decode and sum of ``workers``
    chunks, the re-encode and the decode of the gathered chunks, (sparse) the decode and sum
    of ``workers`` packets;
  - copy: a plain ``copy_`` of the same float32 bytes, its calls alternating with the mean's
    (a drift of the machine's speed moves both alike), each of them after an untimed write of
    ``--flush-mb`` MB (both start from caches that hold none of their data, as after a
    training step; else a 16 MB copy ran from the cache in some runs and not in others), and
    the encode's, the decode's and the mean's cost as multiples of it (the issue's target: the
    mean within 5x of a copy).
Times are ms per MB of the float32 input (GPU: after ``torch.cuda.synchronize``), the median of
``--repeats``; ``uptime`` is printed before and after (timings are only worth reading from a
quiet machine: a load average near the number of cores means they are not). Printed as a
Markdown table, and with ``--json PATH`` written as JSON (scripts/gpu_summary.py reads it).

Usage: python benchmarks/codec_cost.py [--mb 64] [--repeats 10] [--workers 4] [--device cpu,cuda]
       python benchmarks/codec_cost.py --mb 0.25 --repeats 2   # seconds on a CPU
"""

import argparse
import json
import os
import subprocess
from collections.abc import Callable

import torch
from bench_timing import cache_flusher, median_ms, median_ms_beside  # benchmarks/, beside this

from hvd_slowmo.comm.base import Communicator
from hvd_slowmo.compression import CODECS, as_codec
from hvd_slowmo.compression.means import mean_start
from hvd_slowmo.compression.offload import Scratch

#: The codecs measured first, in this order; others of CODECS follow (fp32 is the baseline, no
#: codec at all, and is left out).
PREFERRED = ("fp16", "bf16", "int8", "fp8", "sparse")


def codec_names() -> list[str]:
    """The codecs to measure: PREFERRED first, then any other the library lists, never fp32."""
    names = [c for c in PREFERRED if c in CODECS] + [
        c for c in CODECS if c not in PREFERRED and c != "fp32"
    ]
    if "sparse" not in names:
        names.append("sparse")
    return names


class Echo(Communicator):
    """``size`` workers that all send what this one (rank 0) sends: a codec's mean runs its
    whole arithmetic, and the wire is a copy."""

    supports_alltoall = True

    def __init__(self, size: int) -> None:
        self.rank, self.size = 0, size
        # The gathered bytes land in a buffer kept between calls, as a transport's receive
        # buffer: a new tensor each time would time the first touch of its pages.
        self._gathered: dict[tuple, torch.Tensor] = {}

    def _average_(self, tensors: list, name: str) -> int:
        return 0

    def _allgather_object(self, obj: object) -> list:
        return [obj] * self.size

    def _broadcast_object(self, obj: object, root_rank: int) -> object:
        return obj

    def _alltoall_flat(self, sends: list, recv_numels: list, name: str) -> list:
        return [sends[0]] * self.size  # every worker's chunk 0 is this one's

    def _allgather_flat(self, shards: list, name: str) -> list:
        out = []
        for i, s in enumerate(shards):
            key = (i, s.numel(), s.dtype, s.device)
            if key not in self._gathered:
                self._gathered[key] = s.new_empty(self.size, s.numel())
            gathered = self._gathered[key]
            gathered.copy_(s.expand(self.size, -1))  # the wire: a copy of each worker's shard
            out.append(gathered.view(-1))
        return out


def _steps(codec: str, x: torch.Tensor, workers: int) -> tuple[Callable, Callable, Callable, int]:
    """The codec's encode, decode and mean of ``x`` as functions, and its packet's bytes."""
    n = x.numel()
    spec = as_codec(codec, x.device)
    packet = spec.encode(x)
    residual = torch.zeros_like(x)
    # The mean lands in a buffer kept from one mean to the next, and its packets in a scratch
    # kept likewise, as the library's averager keeps them (new tensors each time would add the
    # first touch of their pages).
    into = torch.empty(spec.sum_numel(n), dtype=torch.float32, device=x.device)
    echo, scratch = Echo(workers), Scratch()
    return (
        lambda: spec.encode(x),
        lambda: spec.decode(packet, n),
        lambda: mean_start(spec, echo, x, "cost", residual, into, scratch).wait(),
        packet.numel(),
    )


def measure(
    codec: str, device: torch.device, mb: float, repeats: int, workers: int, flush_mb: float = 0.0
) -> dict:
    """One row: ms per MB of encode, decode and mean, or the error that stopped it; with
    ``flush_mb``, the mean and the copy each after an untimed write of that many MB."""
    row: dict = {"codec": codec, "device": device.type}
    try:
        n = max(1, int(mb * 2**20 / 4))
        g = torch.Generator().manual_seed(0)
        x = torch.randn(n, generator=g).to(device)
        enc, dec, mean, nbytes = _steps(codec, x, workers)
        per_mb = n * 4 / 2**20
        out = torch.empty_like(x)
        row["encode_ms_per_mb"] = median_ms(enc, repeats, device) / per_mb
        row["decode_ms_per_mb"] = median_ms(dec, repeats, device) / per_mb
        before = cache_flusher(flush_mb, device) if flush_mb > 0 else None
        mean_ms, copy_ms = median_ms_beside(mean, lambda: out.copy_(x), repeats, device, before)
        row["mean_ms_per_mb"], row["copy_ms_per_mb"] = mean_ms / per_mb, copy_ms / per_mb
        for step in ("encode", "decode", "mean"):
            row[f"{step}_per_copy"] = row[f"{step}_ms_per_mb"] / row["copy_ms_per_mb"]
        row["wire_bytes_per_fp32_byte"] = nbytes / (n * 4)
    except (ValueError, TypeError, RuntimeError, KeyError) as e:  # a codec this torch lacks
        row["error"] = f"{type(e).__name__}: {e}"
    return row


def _uptime() -> tuple[str, float]:
    """``uptime``'s line (the load averages over 1, 5 and 15 minutes) and the 1-minute load."""
    load = os.getloadavg()[0]
    try:
        line = subprocess.run(["uptime"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):  # no uptime: the load averages alone
        line = "load average: " + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return line.strip(), load


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mb", type=float, default=64.0, help="MB of float32 (default 64)")
    parser.add_argument("--repeats", type=int, default=10, help="timed repeats (default 10)")
    parser.add_argument("--workers", type=int, default=4, help="workers of the mean (default 4)")
    parser.add_argument(
        "--flush-mb",
        type=float,
        default=128.0,
        help="MB written untimed before each timed mean and copy, to empty the caches "
        "(default 128; 0: none)",
    )
    parser.add_argument(
        "--device", default=None, help="comma-separated (default: cpu, and cuda when available)"
    )
    parser.add_argument("--json", default=None, help="also write the rows as JSON to this path")
    args = parser.parse_args(argv)
    if args.mb <= 0:
        parser.error(f"--mb must be > 0, got {args.mb}")
    if args.flush_mb < 0:
        parser.error(f"--flush-mb must be >= 0, got {args.flush_mb}")
    for name in ("repeats", "workers"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    devices = (
        args.device.split(",")
        if args.device
        else ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    )
    uptime_before, load_before = _uptime()
    rows = [
        measure(codec, torch.device(d), args.mb, args.repeats, args.workers, args.flush_mb)
        for d in devices
        for codec in codec_names()
    ]
    uptime_after, load_after = _uptime()
    where = ", ".join(
        torch.cuda.get_device_name(0) if d == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
        for d in devices
    )
    result = {
        "mb": args.mb,
        "repeats": args.repeats,
        "workers": args.workers,
        "flush_mb": args.flush_mb,
        "devices": where,
        "torch": torch.__version__,
        "load_before": load_before,
        "load_after": load_after,
        "uptime_before": uptime_before,
        "uptime_after": uptime_after,
        "rows": rows,
    }
    print(
        f"codec cost: {args.mb:g} MB of float32, median of {args.repeats}, mean of "
        f"{args.workers} workers with error feedback, caches flushed by {args.flush_mb:g} MB "
        f"before each timed mean and copy; {where}; torch {torch.__version__}"
    )
    print(f"uptime before: {uptime_before}")
    print(f"uptime after:  {uptime_after}")
    print(
        "| codec | device | encode ms/MB | decode ms/MB | mean ms/MB | copy ms/MB | encode / copy "
        "| decode / copy | mean / copy | wire bytes / fp32 bytes |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['codec']} | {r['device']} | n/a: {r['error']} | | | | | | | |")
        else:
            print(
                f"| {r['codec']} | {r['device']} | {r['encode_ms_per_mb']:.4f} | "
                f"{r['decode_ms_per_mb']:.4f} | {r['mean_ms_per_mb']:.4f} | "
                f"{r['copy_ms_per_mb']:.4f} | {r['encode_per_copy']:.1f}x | "
                f"{r['decode_per_copy']:.1f}x | {r['mean_per_copy']:.1f}x | "
                f"{r['wire_bytes_per_fp32_byte']:.3f} |"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
