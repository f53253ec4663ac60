"""The codec's temporaries, phase by phase, in one worker of a compressed outer step (issue 38,
item 3: what of a row's peak the held parts do not explain).

Two thread workers average one fragment of ``--numel`` float32 parameters through
:class:`~hvd_slowmo.compression.averager.PseudoGradientAverage`, running the sequence its codec
thread runs (the pseudo-gradient and the encode, the dense codecs' reduce, the decode or sum,
the landing values written into the parameters) as one job on rank 0's codec thread, as the
optimizer does, under ``torch.profiler`` with ``profile_memory``: every CPU allocation and free
on that thread, in order. Per phase it prints the peak of the bytes allocated above what was
live when the phase began, and what is still live at its end (a buffer that outlives the
phase), in fragment copies (``4 * numel`` bytes). The transport's copies made on the other
worker's thread are not seen; the held buffers (the residual, the codec's scratch:
:func:`hvd_slowmo.memory.held_bytes`) are made at the first outer step, so the second step,
the one printed, is the steady state. Bytes, not time: it may run beside other work.

    python benchmarks/codec_memory.py --numel 2500000     # a 10M model's fragment of four
"""

import argparse
import threading
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from hvd_slowmo.comm.local import run_threads
from hvd_slowmo.compression.averager import PseudoGradientAverage
from hvd_slowmo.compression.exchange import PendingMean

#: The rows: (label, codec, error feedback).
ROWS = (
    ("int8", "int8", False),
    ("int8 + error feedback", "int8", True),
    ("sparse", "sparse", False),
    ("sparse + error feedback", "sparse", True),
)
PHASES = ("encode", "reduce", "decode", "land")


def _outer_step(average: PseudoGradientAverage, params: list[torch.Tensor], anchor: list) -> None:
    """One outer step, the codec thread's job run here, phase by phase."""
    with record_function("phase:step"):
        with record_function("phase:encode"):
            pending = average._begin(params, anchor, "mem")
        with record_function("phase:reduce"):
            if isinstance(pending, PendingMean):  # a dense codec: its chunk summed, re-encoded
                pending._reduce()
        with record_function("phase:decode"):
            pending.wait()
        with record_function("phase:land"):
            average._land(pending, params, anchor)
        del pending


def phases(prof: Any) -> dict[str, tuple[int, int]]:
    """Per phase: (peak bytes above its start, bytes live at its end above its start); and
    ``"step"``: the same over the whole outer step."""
    events = list(prof.profiler.kineto_results.events())
    memory = sorted((e for e in events if e.name() == "[memory]"), key=lambda e: e.start_ns())
    out = {}
    for phase in (*PHASES, "step"):
        (span,) = [e for e in events if e.name() == f"phase:{phase}"]
        begin, end = span.start_ns(), span.start_ns() + span.duration_ns()
        live = peak = 0
        for e in memory:
            if begin <= e.start_ns() <= end:
                live += e.nbytes()
                peak = max(peak, live)
        out[phase] = (peak, live)
    return out


def measure(codec: str, error_feedback: bool, numel: int, layers: int) -> dict[str, tuple]:
    """Two outer steps on two thread workers; rank 0's second step profiled."""
    lock = threading.Lock()
    result: dict[str, tuple] = {}

    def worker(comm: Any) -> None:
        torch.manual_seed(comm.rank)
        sizes = [numel // layers] * layers
        sizes[-1] += numel - sum(sizes)
        anchor = [torch.randn(s) for s in sizes]
        params = [a + 1e-3 * torch.randn(s) for a, s in zip(anchor, sizes)]
        average = PseudoGradientAverage(comm, codec, error_feedback)
        assert average.thread is not None, "the thread workers run the codec on its thread"

        def job(profiled: bool) -> None:
            # On the codec thread, as the optimizer runs it (the profiler sees the thread that
            # started it).
            if not profiled:
                return _outer_step(average, params, anchor)
            with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
                _outer_step(average, params, anchor)
            with lock:
                result.update(phases(prof))

        average.thread.submit(lambda: job(False)).wait()
        average.thread.submit(lambda: job(comm.rank == 0)).wait()

    run_threads(2, worker, timeout=600)
    return result


def main(argv: list[str] | None = None) -> None:
    """Print the phases of every row as a Markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--numel", type=int, default=2_500_000, help="the fragment's parameters")
    p.add_argument("--layers", type=int, default=2, help="tensors the fragment is made of")
    args = p.parse_args(argv)
    copy = 4 * args.numel
    print(
        f"one fragment of {args.numel} float32 ({copy / 2**20:.1f} MB) in {args.layers} tensors, "
        "2 thread workers; rank 0's bytes allocated per phase, in fragment copies: "
        "peak above the phase's start / still live at its end"
    )
    print("| codec | " + " | ".join(PHASES) + " | whole step |")
    print("|---|" + "---|" * (len(PHASES) + 1))
    for label, codec, feedback in ROWS:
        got = measure(codec, feedback, args.numel, args.layers)
        cells = [f"{got[ph][0] / copy:.2f} / {got[ph][1] / copy:+.2f}" for ph in (*PHASES, "step")]
        print(f"| {label} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
