"""What the examples write while they train, read as a log: the progress bars redraw one line
with carriage returns, which a ``horovodrun`` or CI log keeps as one endless line, so they are
drawn only when stderr is a terminal; in a log only whole lines are written."""

import fcntl
import os
import pty
import select
import struct
import sys
import termios
from types import SimpleNamespace

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))

import common  # noqa: E402
import compare  # noqa: E402

ARGS = SimpleNamespace(no_progress=False)


class Terminal:
    """stderr on a pseudo-terminal (isatty() is True, 100 columns), whose output is read back."""

    def __enter__(self):
        self.leader, follower = pty.openpty()
        # A new pty has 0 columns, and tqdm draws nothing in 0 columns.
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))
        self.file = os.fdopen(follower, "w", buffering=1)
        return self

    def read(self) -> str:
        """What was written so far ("" if nothing, without waiting more than a second)."""
        self.file.flush()
        ready, _, _ = select.select([self.leader], [], [], 1.0)
        return os.read(self.leader, 65536).decode(errors="replace") if ready else ""

    def __exit__(self, *exc):
        self.file.close()
        os.close(self.leader)


def test_epoch_bar_only_on_a_terminal(capsys, monkeypatch):
    # In a log (pytest's captured stderr is not a terminal): the plain iterable, nothing written.
    assert list(common.progress(range(3), 0, ARGS, total=3)) == [0, 1, 2]
    assert type(common.progress(range(3), 0, ARGS)) is range
    assert capsys.readouterr().err == ""
    with Terminal() as term:
        monkeypatch.setattr(sys, "stderr", term.file)
        assert list(common.progress(range(3), 0, ARGS, total=3, desc="epoch 0")) == [0, 1, 2]
        drawn = term.read()
    assert "epoch 0" in drawn and "\r" in drawn  # a real bar where a person watches
    # Other ranks and --no-progress: never a bar.
    assert type(common.progress(range(3), 1, ARGS)) is range
    assert type(common.progress(range(3), 0, SimpleNamespace(no_progress=True))) is range


EVENTS = [
    {"event": "start", "run": "localsgd/seed0", "epochs": 2, "start_epoch": 0},
    {"event": "epoch", "run": "localsgd/seed0", "val_accuracy": 81.5, "train_full_loss": 0.5},
    {"event": "epoch", "run": "localsgd/seed0", "val_accuracy": 90.25, "train_full_loss": 0.3},
]
SUMMARY = {"run": "localsgd/seed0", "wall_s": 12.5, "val_accuracy": 90.25, "train_loss": 0.3}
SUMMARY.update(ms_per_iter=4.0)


@pytest.mark.parametrize("terminal", [False, True], ids=["log", "terminal"])
def test_main_job_progress_writes_whole_lines_in_a_log(capsys, monkeypatch, terminal):
    summaries = {}
    with Terminal() as term:
        if terminal:
            monkeypatch.setattr(sys, "stderr", term.file)
        bars = compare._ProgressBars(False, summaries)
        for event in [*EVENTS, {"event": "end", "summary": SUMMARY}]:
            bars.on_event(event)
        drawn = term.read()
    captured = capsys.readouterr()
    out = captured.out
    assert summaries == {"localsgd/seed0": SUMMARY}
    # One whole line per finished run on stdout, either way.
    assert out.count("\n") == 1 and "\r" not in out and "test acc 90.25%" in out
    if terminal:
        assert "\r" in drawn and "localsgd/seed0" in drawn
    else:
        assert drawn == "" and captured.err == ""
