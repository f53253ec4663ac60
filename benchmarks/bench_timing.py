"""Wall-clock timing shared by the benchmarks that time a function on the CPU or a GPU
(benchmarks/codec_cost.py, benchmarks/gpu_resnet50.py)."""

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["median_ms", "sync"]


def sync(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (a no-op on the CPU).

    Args:
        device: the device.
    """
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn: Callable[[], object], repeats: int, device: torch.device) -> float:
    """The median wall time of ``fn`` in ms over ``repeats`` calls, after one untimed call
    (each call synchronized on ``device`` before and after).

    Args:
        fn: the work.
        repeats: timed calls.
        device: where it runs.
    """
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
