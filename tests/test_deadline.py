"""The collective deadline (issue 29, "Timeouts"): a peer that never joins a collective ends the
wait within the deadline with a ``CollectiveTimeout`` naming the waiting rank and the collective,
on the thread transport and under ``mpirun`` (docs/timeouts.md)."""

import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

from hvd_slowmo.comm.deadline import ENV, CollectiveTimeout, collective_timeout
from hvd_slowmo.comm.local import ThreadWorld, WorldAborted, run_threads

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "tests", "workers", "mpi_collectives_worker.py")
DEADLINE = 0.5
#: What a loaded 2-core CI machine may add to a deadline before the error is raised.
SLACK = 2.5


def _collective(comm, kind):
    """Run one blocking collective of ``kind``, named ``"frozen"`` where it takes a name."""
    if kind == "average":
        comm.average_([torch.ones(3)], "frozen")
    elif kind == "reduce_scatter":
        comm.reduce_scatter_mean([torch.ones(4)], "frozen")
    elif kind == "allgather":
        comm.allgather_flat([torch.ones(2)], "frozen")
    elif kind == "alltoall":
        comm.alltoall_flat([torch.ones(1)] * comm.size, [1] * comm.size, "frozen")
    elif kind == "allgather_object":
        comm.allgather_object("frozen")
    else:
        comm.broadcast_object("frozen")


KINDS = ["average", "reduce_scatter", "allgather", "alltoall", "allgather_object", "broadcast"]
NAMES = {"allgather_object": "allgather_object", "broadcast": "broadcast_object"}


@pytest.mark.parametrize("kind", KINDS)
def test_thread_worker_never_arriving_is_a_timeout_naming_rank_and_collective(kind):
    gave_up = threading.Event()
    took = []

    def worker(comm):
        _collective(comm, "average")  # both workers are up
        if comm.rank == 1:  # frozen: joins nothing more until rank 0 has given up
            gave_up.wait(30)
            return
        began = time.monotonic()
        try:
            _collective(comm, kind)
        finally:
            took.append(time.monotonic() - began)
            gave_up.set()

    what = NAMES.get(kind, f"{kind} 'frozen'")
    with pytest.raises(CollectiveTimeout) as err:
        run_threads(2, worker, timeout=DEADLINE)
    message = str(err.value)
    assert f"rank 0 waited {DEADLINE:g} s for {what}" in message, message
    assert "rank(s) [1] never started it" in message, message
    assert ENV in message  # says how to raise the deadline
    assert DEADLINE <= took[0] < DEADLINE + SLACK, took


def test_a_failing_worker_ends_the_others_waits_at_once():
    """A worker that raises aborts the world: the others' collectives fail with WorldAborted
    long before the deadline, and run_threads re-raises the first worker's own error."""
    took = []

    def worker(comm):
        if comm.rank == 1:
            time.sleep(0.2)
            raise ValueError("rank 1 broke")
        began = time.monotonic()
        try:
            comm.average_([torch.ones(2)], "never")
        except WorldAborted as e:
            took.append((time.monotonic() - began, str(e)))
            raise

    with pytest.raises(ValueError, match="rank 1 broke"):
        run_threads(2, worker, timeout=60)
    assert took[0][0] < 10, took
    assert "rank 1 raised ValueError: rank 1 broke" in took[0][1]


def test_deadline_settings(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert collective_timeout() is None  # unset: no deadline
    assert collective_timeout(None) is None
    assert collective_timeout(30) == 30.0
    for raw, want in (("2.5", 2.5), ("none", None), ("", None)):
        monkeypatch.setenv(ENV, raw)
        assert collective_timeout() == want
        assert ThreadWorld(2, timeout="env").timeout == want
    monkeypatch.setenv(ENV, "soon")
    with pytest.raises(ValueError, match=f"{ENV} must be a number of seconds.*'soon'"):
        collective_timeout()
    monkeypatch.setenv(ENV, "-1")
    with pytest.raises(ValueError, match=f"{ENV} must be a finite number in \\(0.0, inf\\]"):
        collective_timeout()
    with pytest.raises(ValueError, match="timeout must be a finite number"):
        ThreadWorld(2, timeout=0)
    with pytest.raises(TypeError, match="timeout must be a number"):
        collective_timeout("10")


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["average", "alltoall", "allgather_object"])
def test_mpi_rank_frozen_past_the_deadline_ends_the_job(kind):
    """``mpirun -np 2``: rank 1 sleeps 60 s before a collective; with
    HVD_SLOWMO_COLLECTIVE_TIMEOUT=2 rank 0 raises within 2 s + slack, naming itself and the
    collective, and MPI_Abort ends the job long before rank 1 wakes (an outer timeout keeps a
    regression from hanging the suite)."""
    if shutil.which("mpirun") is None:
        pytest.skip("mpirun not found (scripts/setup_env.sh installs OpenMPI)")
    pytest.importorskip("mpi4py")
    with tempfile.TemporaryDirectory() as out:
        env = dict(
            os.environ,
            PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            **{ENV: "2"},
        )
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2"]
        began = time.monotonic()
        proc = subprocess.run(
            [*cmd, sys.executable, WORKER, "deadline", out, kind],
            env=env,
            capture_output=True,
            text=True,
            timeout=240,
        )
        wall = time.monotonic() - began
        report = os.path.join(out, "rank0.txt")
        assert os.path.exists(report), proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(report) as f:
            took, message = f.read().split("\n", 1)
    assert proc.returncode == 3, (proc.returncode, wall)  # MPI_Abort(3), not rank 1 waking
    assert 2.0 <= float(took) < 2.0 + SLACK, took
    what = "allgather_object" if kind == "allgather_object" else f"{kind} 'frozen'"
    assert f"rank 0 waited 2 s for {what}" in message, message


@pytest.mark.timeout(200)
def test_torch_distributed_peer_frozen_past_the_deadline_is_an_error_naming_it():
    """Two Gloo processes; rank 1 sleeps 60 s before an average; with
    HVD_SLOWMO_COLLECTIVE_TIMEOUT=2 rank 0's ``Work.wait(timeout)`` raises within 2 s + slack,
    re-raised with its rank and the average's name."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    worker = os.path.join(ROOT, "tests", "workers", "torchdist_deadline_worker.py")
    with tempfile.TemporaryDirectory() as out:
        env = dict(
            os.environ,
            PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
            **{ENV: "2"},
        )
        procs = [
            subprocess.Popen([sys.executable, worker, str(r), port, out], env=env) for r in (0, 1)
        ]
        try:
            assert procs[0].wait(timeout=150) == 3
        finally:
            for p in procs:
                p.kill()
                p.wait()
        with open(os.path.join(out, "rank0.txt")) as f:
            took, message = f.read().split("\n", 1)
    assert 2.0 <= float(took) < 2.0 + SLACK, took
    assert "rank 0: average 'frozen' failed" in message, message


@pytest.mark.timeout(300)
@pytest.mark.parametrize("controller", ["gloo", "mpi"])
def test_horovod_peer_frozen_past_the_deadline_is_a_timeout_naming_it(controller):
    """``horovodrun -np 2``: rank 1 sleeps 60 s before an average; with
    HVD_SLOWMO_COLLECTIVE_TIMEOUT=2 rank 0 (polling ``hvd.poll``) raises within 2 s + slack,
    naming itself and the average, then ends the job."""
    from horovod_launch import horovodrun_command, launch_env

    pytest.importorskip("horovod.torch")
    worker = os.path.join(ROOT, "tests", "workers", "horovod_deadline_worker.py")
    with tempfile.TemporaryDirectory() as out:
        cmd = horovodrun_command(2, controller, [worker, out])
        proc = subprocess.run(
            cmd, cwd=ROOT, env=launch_env({ENV: "2"}), capture_output=True, text=True, timeout=240
        )
        report = os.path.join(out, "rank0.txt")
        assert os.path.exists(report), proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(report) as f:
            took, message = f.read().split("\n", 1)
    assert proc.returncode != 0
    assert 2.0 <= float(took) < 2.0 + SLACK, took
    assert "rank 0 waited 2 s for average 'frozen'" in message, message


class _FakeTime:
    """``time.monotonic`` and ``time.sleep`` of a fake clock: a sleep moves it, nothing else."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize("deadline", [0.5, 2.0, 600.0])
def test_the_mpi_and_horovod_wait_gives_up_at_its_deadline_not_later(monkeypatch, deadline):
    """The wait of the MPI and Horovod transports (``wait_until``) on a fake clock: it raises
    once the deadline has passed, within one poll interval (5 ms), so a deadline doubled (or
    slack of any size) fails here, which the timing checks above (deadline + 2.5 s) cannot
    see."""
    from hvd_slowmo.comm import deadline as module

    fake = _FakeTime()
    monkeypatch.setattr(module, "time", fake)
    began = fake.now
    with pytest.raises(CollectiveTimeout, match="never"):
        module.wait_until(lambda: False, deadline, lambda: "never")
    assert deadline < fake.now - began <= deadline + 5e-3 + 1e-9, fake.now - began
    fake.now = began
    polls = []
    module.wait_until(lambda: polls.append(fake.now) or len(polls) > 3, deadline, lambda: "x")
    assert fake.now - began < deadline  # done in time: no error


def test_thread_deadline_long_against_the_slack_is_kept():
    """The thread transport's deadline, long against the slack (6 s against 2.5 s): a doubled
    deadline (12 s) would fail this."""
    long = 6.0
    gave_up = threading.Event()
    took = []

    def worker(comm):
        _collective(comm, "average")
        if comm.rank == 1:
            gave_up.wait(60)
            return
        began = time.monotonic()
        try:
            _collective(comm, "average")
        finally:
            took.append(time.monotonic() - began)
            gave_up.set()

    with pytest.raises(CollectiveTimeout):
        run_threads(2, worker, timeout=long)
    assert long <= took[0] < long + SLACK < 2 * long, took
