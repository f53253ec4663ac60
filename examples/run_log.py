"""The machine-readable lines an example prints with ``--progress-lines`` (or writes to
``--progress-file``), and the check of a run built on them (standard library only, so a host
without torch can run it).

Rank 0 emits one line per event: :data:`PROGRESS_MARK` then a JSON object with ``"event"``
(``"start"``, ``"epoch"`` after each epoch, ``"end"`` with the run's summary) and ``"run"``.
examples/compare.py draws its progress bars from them; scripts/docker_check.sh checks that a
launch trained to its last epoch from the file rank 0 wrote::

    python3 examples/run_log.py PROGRESS_FILE --workers 2 --epochs 2

The same command reads a launcher's log, where the lines carry its tags: horovodrun writes
``[0]<stdout>:`` before rank 0's lines, OpenMPI's ``--tag-output`` ``[1,0]<stdout>:``, and
OpenMPI 4.1 sometimes writes the next line's tag before the newline, after the JSON
(tests/data/mpi_tagged_output.log, recorded here): :func:`parse_event` ignores the tags and
whatever follows the JSON object. A file is still the better source: a launcher may change its
output format; it cannot change a file.
"""

import argparse
import json
import math
import re
import sys
from typing import Any

__all__ = ["PROGRESS_MARK", "check_run", "event_line", "parse_event", "read_events"]

#: The start of every machine-readable line (then JSON).
PROGRESS_MARK = "@hvd_slowmo_progress "


def event_line(event: str, **fields: Any) -> str:
    """One machine-readable line.

    Args:
        event: ``"start"``, ``"epoch"`` or ``"end"``.
        **fields: the event's fields (JSON-serializable).
    """
    return PROGRESS_MARK + json.dumps({"event": event, **fields})


#: A launcher's tag of a rank's output: horovodrun's ``[0]<stdout>:``, OpenMPI's
#: ``[1,0]<stdout>:`` (job, rank).
LAUNCHER_TAG = re.compile(r"\[\d+(?:,\d+)*\]<std(?:out|err)>:")

_DECODER = json.JSONDecoder()


def parse_event(line: str) -> dict[str, Any] | None:
    """The event on one line of output, or None if the line holds none.

    Launcher tags anywhere on the line are dropped (OpenMPI writes one at each chunk of output it
    forwards, which can fall before a newline), and so is anything after the JSON object.

    Args:
        line: one line of a log or of a progress file.

    Raises:
        ValueError: the line has the mark but no JSON object after it.
    """
    if PROGRESS_MARK not in line:
        return None
    text = LAUNCHER_TAG.sub("", line.split(PROGRESS_MARK, 1)[1]).strip()
    try:
        event, _ = _DECODER.raw_decode(text)
    except json.JSONDecodeError as e:
        raise ValueError(
            f"a {PROGRESS_MARK.strip()!r} line without its JSON ({e}): {line!r}"
        ) from None
    if not isinstance(event, dict):
        raise ValueError(f"a {PROGRESS_MARK.strip()!r} line without a JSON object: {line!r}")
    return event


def read_events(text: str) -> list[dict[str, Any]]:
    """Every event in a log or progress file, in order; other lines are ignored.

    Args:
        text: the log (stdout of an example or of its launcher) or the ``--progress-file``.
    """
    events = (parse_event(line) for line in text.splitlines())
    return [e for e in events if e is not None]


def check_run(text: str, workers: int, epochs: int) -> list[str]:
    """Check that a run trained on ``workers`` workers to its last epoch with finite losses;
    returns one human-readable line per epoch.

    Args:
        text: the run's ``--progress-file``, or its log printed with ``--progress-lines``.
        workers: the number of workers the run must report.
        epochs: the number of epochs it must have finished.

    Raises:
        ValueError: what is missing or wrong (no event lines: the run was not launched with
            ``--progress-file``/``--progress-lines``, or it died before its first event).
    """
    events = read_events(text)
    if not events:
        raise ValueError(
            f"no '{PROGRESS_MARK.strip()}' lines: launch with --progress-file or --progress-lines"
        )
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
    """``python3 examples/run_log.py FILE --workers N --epochs E``: exit 0 and print the epochs,
    or exit 1 with what is wrong."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "log", help="the run's --progress-file, or its log (printed with --progress-lines)"
    )
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
