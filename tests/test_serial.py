"""The background runner of the thread workers and the codec (hvd_slowmo/comm/serial.py): jobs in
submission order, and a process that exits with one still running ends cleanly.

The second test is the CI failure of round 5: the portability tier passed (603 tests), then the
interpreter aborted at exit (code 134, "terminate called without an active exception") because a
daemon thread was inside a torch operation when finalization began.
"""

import subprocess
import sys
import textwrap
import threading

import pytest

from hvd_slowmo.comm.serial import SerialRunner


class _Record:
    def __init__(self, log: list[int], i: int, done: threading.Event | None = None) -> None:
        self.log, self.i, self.done = log, i, done

    def run(self) -> None:
        self.log.append(self.i)
        if self.done is not None:
            self.done.set()


def test_jobs_run_in_submission_order_and_drain_returns_the_rest():
    runner = SerialRunner("test-serial")
    log: list[int] = []
    running, gate, done = threading.Event(), threading.Event(), threading.Event()

    class _Blocker:
        def run(self) -> None:
            running.set()
            gate.wait(10)

    runner.submit(_Blocker())  # holds the thread so the next jobs queue up
    assert running.wait(10)
    for i in range(3):
        runner.submit(_Record(log, i))
    left = runner.drain()
    assert [job.i for job in left] == [0, 1, 2]  # type: ignore[attr-defined]
    gate.set()
    for i in range(5):
        runner.submit(_Record(log, i, done if i == 4 else None))
    assert done.wait(10)
    assert log == [0, 1, 2, 3, 4]


EXIT_WITH_A_JOB_RUNNING = """
    import threading
    import torch
    from hvd_slowmo.comm.local import ThreadWorld

    world = ThreadWorld(1)
    returning = threading.Event()

    def reduce(inputs):
        returning.wait(10)
        a = torch.randn(200, 200)
        for _ in range(400):  # torch work still running when the interpreter exits
            a = (a @ a).tanh()
        print("reduce finished", flush=True)
        return inputs

    world.start(0, "average", "x", 1, reduce, "a long reduce")
    print("main returns", flush=True)
    returning.set()
"""


EXIT_WITH_A_THREAD_IN_TORCH = """
    import threading
    import torch
    from hvd_slowmo.comm.serial import join_at_exit

    returning = threading.Event()

    def wait():
        returning.wait(10)
        a = torch.randn(200, 200)
        for _ in range(400):
            a = (a @ a).tanh()
        print("wait finished", flush=True)

    thread = threading.Thread(target=wait, daemon=True)
    thread.start()
    join_at_exit(thread)
    print("main returns", flush=True)
    returning.set()
"""


@pytest.mark.parametrize(
    "script, last",
    [(EXIT_WITH_A_JOB_RUNNING, "reduce"), (EXIT_WITH_A_THREAD_IN_TORCH, "wait")],
    ids=["runner-job", "join_at_exit"],
)
def test_an_exit_with_torch_work_running_waits_for_it_and_ends_cleanly(script, last):
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "terminate called" not in out.stderr
    assert out.stdout.split() == ["main", "returns", last, "finished"]
