"""Fault injection under horovodrun: each fault ends in the documented outcome, within a bounded time.

Every launch is small (-np 2, the tiny reference model) and runs in its own process group,
killed (SIGCONT then SIGKILL) when the test ends, so a frozen worker never outlives its test.
What each fault does and why: docs/reliability.md. The worker: tests/workers/fault_worker.py.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import pytest

from horovod_launch import ROOT

WORKER = os.path.join(os.path.dirname(__file__), "workers", "fault_worker.py")
pytestmark = pytest.mark.horovod
GOSSIP_TIMEOUT = 10  # seconds; HVD_SLOWMO_GOSSIP_TIMEOUT for the launches
GLOO_TIMEOUT = 20  # seconds; HOROVOD_GLOO_TIMEOUT_SECONDS: how long a Gloo collective waits for a peer


def launch(tmp_path, mode: str, controller: str = "gloo", timeout: float = 300) -> Tuple[int, str, float]:
    """Run fault_worker.py MODE under horovodrun -np 2; returns (exit code, output, seconds).

    Unlike horovod_launch.horovodrun, a non-zero exit is an expected outcome here.
    """
    exe = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(exe):
        pytest.fail(f"horovodrun not found next to {sys.executable}: run scripts/setup_env.sh")
    cmd = [exe, "-np", "2", "-H", "localhost:2"]
    if controller == "mpi":
        if shutil.which("mpirun") is None:
            pytest.fail("mpirun not found: install OpenMPI (scripts/setup_env.sh does)")
        cmd += ["--mpi", "--mpi-args=--oversubscribe --allow-run-as-root --bind-to none"]
    else:
        cmd += ["--gloo"]
    cmd += [sys.executable, WORKER, str(tmp_path), mode]
    env = {**os.environ, "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), "OMP_NUM_THREADS": "1",
           "HVD_SLOWMO_GOSSIP_TIMEOUT": str(GOSSIP_TIMEOUT), "HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT)}
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, _ = proc.communicate()
        pytest.fail(f"{mode}: the launch did not end within {timeout}s (a hang)\n{out[-4000:]}")
    finally:
        _kill_group(proc)
    return proc.returncode, out, time.monotonic() - t0


def _kill_group(proc: subprocess.Popen) -> None:
    # A SIGSTOPped worker ignores SIGTERM until continued; SIGCONT then SIGKILL ends the group.
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return


def results(tmp_path, mode: str, ranks: List[int]) -> Dict[int, dict]:
    out = {}
    for r in ranks:
        path = tmp_path / f"{mode}.{r}.json"
        assert path.exists(), f"rank {r} wrote no result for {mode}"
        out[r] = json.loads(path.read_text())
    return out


def test_errors_raise_on_every_rank(tmp_path):
    """Skewed configuration, NaN in one rank's parameters (raise / skip), one rank skipping a
    step, a truncated checkpoint: each is an exception with a clear message, never a hang."""
    rc, out, _ = launch(tmp_path, "errors", timeout=300)
    assert rc == 0, out[-4000:]
    res = results(tmp_path, "errors", [0, 1])
    for rank in (0, 1):
        skew = res[rank]["skew"]
        assert skew["error"] == "ValueError", skew
        assert "rank 1: slow_momentum=0.6 (rank 0: 0.5)" in skew["message"], skew

        nan = res[rank]["nan-raise"]
        assert nan["error"] == "FloatingPointError", nan
        assert "rank(s) [1]" in nan["message"] and "after step 6" in nan["message"], nan
        assert "outer step 1" in nan["message"], nan  # the note added by the optimizer

        skip = res[rank]["nan-skip"]
        assert skip["error"] is None and skip["finite"], skip
        assert skip["outer_steps"] == 2, skip

        uneven = res[rank]["uneven"]
        assert uneven["error"] == "RuntimeError", uneven
        assert "different numbers of times" in uneven["message"] and "drop_last" in uneven["message"], uneven
        assert "rank 1 at finish after 8 steps" in uneven["message"], uneven
        assert "rank 0 at outer step after 9 steps" in uneven["message"], uneven
    # nonfinite="skip": both workers restarted from the same anchor, NaN never reached rank 0.
    assert res[0]["nan-skip"]["params"] == res[1]["nan-skip"]["params"]
    assert res[0]["corrupt-checkpoint"]["error"] is None
    bad = res[1]["corrupt-checkpoint"]
    assert bad["error"] == "CheckpointError", bad
    assert str(tmp_path / "ckpt.1.pt") in bad["message"] and "truncated" in bad["message"], bad


@pytest.mark.parametrize("controller", ["gloo", "mpi"], ids=["horovod-alltoall", "mpi-neighbor"])
def test_frozen_gossip_peer_is_a_timeout_naming_it(tmp_path, controller):
    """SGP with one worker SIGSTOPped inside the inner loop: the other raises TimeoutError naming
    the frozen rank and the step after HVD_SLOWMO_GOSSIP_TIMEOUT, and the job ends."""
    rc, out, _ = launch(tmp_path, "gossip-stall", controller=controller, timeout=300)
    assert rc != 0, out[-4000:]
    res = results(tmp_path, "gossip-stall", [0, 1])
    got = res[0]["gossip-stall"]
    assert got["error"] == "TimeoutError", got
    assert "from rank(s) [1]" in got["message"] and "step-4 message" in got["message"], got
    waited = got["t"] - res[1]["t_fault"]
    assert GOSSIP_TIMEOUT <= waited < GOSSIP_TIMEOUT + 60, waited


@pytest.mark.parametrize("mode", ["average-stall", "kill"])
def test_lost_worker_at_the_exact_average_ends_the_job(tmp_path, mode):
    """Local SGD with one worker frozen (SIGSTOP) or killed (SIGKILL) inside the inner loop: the
    other fails at the next outer step's collective (Horovod over Gloo: a closed connection at
    once, a frozen peer after HOROVOD_GLOO_TIMEOUT_SECONDS) with a note naming the outer step."""
    rc, out, _ = launch(tmp_path, mode, timeout=300)
    assert rc != 0, out[-4000:]
    res = results(tmp_path, mode, [0, 1])
    got = res[0][mode]
    assert got["error"] == "HorovodInternalError", got
    assert "hvd_slowmo: raised on rank 0 of 2 at outer step 1 (after step 6)" in got["message"], got
    waited = got["t"] - res[1]["t_fault"]
    assert waited < GLOO_TIMEOUT + 60, waited
