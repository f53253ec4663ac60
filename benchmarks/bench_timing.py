"""Wall-clock timing shared by the benchmarks that time a function on the CPU or a GPU
(benchmarks/codec_cost.py, benchmarks/gpu_resnet50.py)."""

import statistics
import time
from collections.abc import Callable

import torch

__all__ = ["cache_flusher", "median_ms", "median_ms_beside", "sync"]


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
    fn: Callable[[], object],
    baseline: Callable[[], object],
    repeats: int,
    device: torch.device,
    before: Callable[[], object] | None = None,
) -> tuple[float, float]:
    """The median wall times of ``fn`` and of ``baseline`` in ms, their calls alternating
    (after one untimed call of each): a machine whose speed drifts (a neighbour's memory
    traffic, the clock) moves both alike, so their ratio is steadier than two runs apart.

    Args:
        fn: the work.
        baseline: what it is compared with (a copy of the same bytes).
        repeats: timed calls of each.
        device: where they run.
        before: run untimed before every timed call of either (e.g. :func:`cache_flusher`'s
            function, so that both start from the same cold caches), or None.
    """
    fn()
    baseline()

    def timed(f: Callable[[], object]) -> float:
        if before is not None:
            before()
        return _call_ms(f, device)

    pairs = [(timed(fn), timed(baseline)) for _ in range(repeats)]
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def cache_flusher(mb: float, device: torch.device) -> Callable[[], object]:
    """A function that writes ``mb`` MB on ``device``: run before a timed call, it leaves the
    caches holding none of the timed work's data (as the training compute between two outer
    steps leaves them), so a small copy cannot run from the cache while the work beside it
    runs from memory.

    Args:
        mb: MB written each call (more than the last-level cache).
        device: where.
    """
    scratch = torch.empty(max(1, int(mb * 2**20 / 4)), dtype=torch.float32, device=device)
    return lambda: scratch.fill_(1.0)
