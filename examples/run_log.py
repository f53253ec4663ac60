"""The machine-readable lines an example prints with ``--progress-lines``, and the check of a run's
log that is built on them (standard library only, so a host without torch can run it).

Rank 0 prints one line per event: :data:`PROGRESS_MARK` then a JSON object with ``"event"``
(``"start"``, ``"epoch"`` after each epoch, ``"end"`` with the run's summary) and ``"run"``.
examples/compare.py draws its progress bars from them; scripts/docker_check.sh checks that a
launch trained to its last epoch with::

    python3 examples/run_log.py LOG --workers 2 --epochs 2

The lines may carry a launcher's prefix (horovodrun writes ``[0]<stdout>:`` before rank 0's).
"""

import argparse
import json
import math
import sys
from typing import Any

__all__ = ["PROGRESS_MARK", "check_run", "event_line", "read_events"]

#: The start of every machine-readable line (then JSON).
PROGRESS_MARK = "@hvd_slowmo_progress "


def event_line(event: str, **fields: Any) -> str:
    """One machine-readable line.

    Args:
        event: ``"start"``, ``"epoch"`` or ``"end"``.
        **fields: the event's fields (JSON-serializable).
    """
    return PROGRESS_MARK + json.dumps({"event": event, **fields})


def read_events(text: str) -> list[dict[str, Any]]:
    """Every event in a log, in order; other lines are ignored.

    Args:
        text: the log (stdout of an example or of its launcher).
    """
    return [
        json.loads(line.split(PROGRESS_MARK, 1)[1])
        for line in text.splitlines()
        if PROGRESS_MARK in line
    ]


def check_run(text: str, workers: int, epochs: int) -> list[str]:
    """Check that a run trained on ``workers`` workers to its last epoch with finite losses;
    returns one human-readable line per epoch.

    Args:
        text: the run's log, printed with ``--progress-lines``.
        workers: the number of workers the run must report.
        epochs: the number of epochs it must have finished.

    Raises:
        ValueError: what is missing or wrong (no event lines: the run was not launched with
            ``--progress-lines``, or it died before its first epoch).
    """
    events = read_events(text)
    if not events:
        raise ValueError(f"no '{PROGRESS_MARK.strip()}' lines: launch with --progress-lines")
    done = [e for e in events if e["event"] == "epoch"]
    if [e["epoch"] for e in done] != list(range(1, epochs + 1)):
        raise ValueError(f"epochs finished: {[e['epoch'] for e in done]}, expected 1..{epochs}")
    ends = [e for e in events if e["event"] == "end"]
    if not ends:
        raise ValueError("no 'end' event: the run did not finish")
    summary = ends[-1]["summary"]
    if summary["workers"] != workers:
        raise ValueError(f"the run trained on {summary['workers']} workers, expected {workers}")
    if summary["diverged"] or not math.isfinite(summary["train_loss"]):
        raise ValueError(f"the run diverged (train loss {summary['train_loss']})")
    return [_describe(e) for e in done]


def _describe(event: dict[str, Any]) -> str:
    metrics = {k: v for k, v in event.items() if k not in ("event", "run", "epoch", "epochs")}
    shown = ", ".join(
        f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items()
    )
    return f"{event['run']}: epoch {event['epoch']}/{event['epochs']}: {shown}"


def main(argv: list[str] | None = None) -> int:
    """``python3 examples/run_log.py LOG --workers N --epochs E``: exit 0 and print the epochs,
    or exit 1 with what is wrong."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", help="the run's log (printed with --progress-lines)")
    parser.add_argument("--workers", type=int, required=True)
    parser.add_argument("--epochs", type=int, required=True)
    args = parser.parse_args(argv)
    with open(args.log, encoding="utf-8", errors="replace") as f:
        text = f.read()
    try:
        lines = check_run(text, args.workers, args.epochs)
    except ValueError as e:
        print(f"{args.log}: {e}", file=sys.stderr)
        return 1
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
