"""The bytes each part of a SlowMo optimizer holds (arXiv 1910.00643): parameters, gradients,
the base optimizer's state, the anchor, the slow buffer (or outer optimizer's state), the
codec's error-feedback residual, the outer step in flight and the codec's scratch buffers.

Each tensor's storage is counted once, in the first part that holds it (a snapshot that is the
parameters themselves is not counted twice), so the parts add up to what the optimizer keeps
alive; the process's own memory (the framework, activations, the allocator's free pages) is
not in it. The benchmarks print it beside the measured peak; the planner predicts it
(:func:`hvd_slowmo.plan.memory_parts`).

:func:`release_free_pages` hands the pages of freed buffers back to the system (glibc's
``malloc_trim``): called after every step on a CPU (with an 8 MB ``HOROVOD_FUSION_THRESHOLD``
for an unstreamed exchange), it kept the emulated cluster's resident peak within one model copy
of what the optimizer holds, at 10M and 50M parameters (``docs/results/memory-rows.md``).
"""

import ctypes
import ctypes.util
from collections.abc import Iterable, Iterator
from typing import Any

from torch import Tensor

__all__ = ["PARTS", "held_bytes", "release_free_pages"]

#: The parts, in the order they are counted.
PARTS = (
    "parameters",
    "gradients",
    "optimizer state",
    "anchor",
    "slow buffer",
    "residual",
    "in flight",
    "codec scratch",
)


def _tensors(value: Any) -> Iterator[Tensor]:
    """Every tensor in a nest of lists, tuples and dicts."""
    if isinstance(value, Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def _parts(opt: Any) -> dict[str, Iterable[Any]]:
    anchor, slow, residual, scratch, in_flight = [], [], [], [], []
    for f in opt.outer.fragments:  # each fragment owns its part of every kind
        state = f.slow_state
        anchor.append(state.anchor)
        slow.append(state.slow_buffer)
        slow.append(state.outer_optimizer.state if state.outer_optimizer is not None else {})
        residual.append(getattr(f.exchange, "residual", None))
        average = getattr(f.exchange, "average", None)
        scratch.append(average.scratch if average is not None else [])
        flight = f.in_flight
        if flight is not None:
            in_flight += [flight.sent, flight.snapshot, flight.extra_sent, flight.extra_snapshot]
            in_flight += [flight.state_sent, flight.state_snapshot]
    return {
        "parameters": opt.params,
        "gradients": [p.grad for p in opt.params],
        "optimizer state": [opt.state],
        "anchor": anchor,
        "slow buffer": slow,
        "residual": residual,
        "in flight": in_flight,
        "codec scratch": scratch,
    }


def held_bytes(opt: Any) -> dict[str, int]:
    """The bytes each part of ``opt`` holds now (:data:`PARTS`), each storage counted once.

    Args:
        opt: a :class:`hvd_slowmo.DistributedOptimizer`.
    """
    seen: set[tuple[Any, int]] = set()
    out = {}
    for part, values in _parts(opt).items():
        total = 0
        for t in _tensors(list(values)):
            storage = t.untyped_storage()
            key = (t.device, storage.data_ptr())
            if key in seen or storage.nbytes() == 0:
                continue
            seen.add(key)
            total += storage.nbytes()
        out[part] = total
    return out


_TRIM: Any = None


def release_free_pages() -> bool:
    """Give the pages of freed host memory back to the system: glibc's ``malloc_trim(0)``,
    which returns every whole free page of every heap arena, not only the top of the heap.

    glibc keeps a freed block below its mmap threshold (which grows up to 32 MiB as mapped
    blocks are freed) in its arena, counted in the resident set, for the next allocation of a
    fitting size. The outer step's transients (a fragment's pseudo-gradient, packets, the
    landing's differences) are sizes the training step does not ask for again. Call it after
    every ``opt.step()`` (once per outer step was not enough on the emulated cluster: a step's
    freed pages are kept again before the next one). Costs a walk of the free lists and a
    fault for each returned page used again; no step time was measurable on a CPU ResNet-18.

    Returns:
        True where it ran (glibc), False elsewhere (another C library: nothing done).
    """
    global _TRIM
    if _TRIM is None:
        try:
            _TRIM = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
            _TRIM.argtypes, _TRIM.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):  # no glibc (musl, macOS): keep the allocator's own
            _TRIM = False
    if _TRIM is False:
        return False
    _TRIM(0)
    return True
