"""Wall-clock timing shared by the benchmarks that time a function on the CPU or a GPU
(benchmarks/codec_cost.py, benchmarks/gpu_resnet50.py)."""

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["median_ms", "median_ms_beside", "sync"]


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
    return statistics.median(_call_ms(fn, device) for _ in range(repeats))


def _call_ms(fn: Callable[[], object], device: torch.device) -> float:
    """One call of ``fn`` in ms, synchronized on ``device`` before and after."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def median_ms_beside(
    fn: Callable[[], object], baseline: Callable[[], object], repeats: int, device: torch.device
) -> tuple[float, float]:
    """The median wall times of ``fn`` and of ``baseline`` in ms, their calls alternating
    (after one untimed call of each): a machine whose speed drifts (a neighbour's memory
    traffic, the clock) moves both alike, so their ratio is steadier than two runs apart.

    Args:
        fn: the work.
        baseline: what it is compared with (a copy of the same bytes).
        repeats: timed calls of each.
        device: where they run.
    """
    fn()
    baseline()
    pairs = [(_call_ms(fn, device), _call_ms(baseline, device)) for _ in range(repeats)]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)
