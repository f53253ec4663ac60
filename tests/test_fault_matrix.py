"""The fault matrix (issue 29): {Horovod Gloo, Horovod MPI, torch.distributed Gloo} x {plain,
overlap=2, fragments=4 + eager="local", int8 + error feedback} x {worker killed, worker frozen,
collective error, late join}. Each cell is one 2-rank launch of tests/workers/matrix_worker.py
(rank 1 faulted at step 5, in the configuration's phase) and ends in one of two documented ways
within a bounded time (docs/reliability.md, "The fault matrix"):

- ``goes on``: exit 0, every rank finished all steps with the same anchor (late join);
- ``stops``: a non-zero exit, a surviving rank's error names a rank and a step (the injected
  collective error also names the phase; under Horovod MPI a killed process makes mpirun end
  the job before anyone reports: mpirun's message names the rank), and the checkpoint
  directory holds only complete checkpoints (no temporary file; every ``.pt`` loads).

Each launch runs in its own process group with an outer timeout (SIGCONT then SIGKILL), so a
hang fails the cell instead of hanging CI. The default suite runs a reduced matrix (Horovod Gloo
x every configuration x kill, and Horovod Gloo x plain x every fault: 7 cells);
``HVD_SLOWMO_FAULT_MATRIX=1`` runs every cell.

A frozen worker ends the job only through a deadline: Horovod Gloo's
``HOROVOD_GLOO_TIMEOUT_SECONDS`` and torch.distributed's process-group timeout bound it here;
Horovod MPI needs the collective deadline (``HVD_SLOWMO_COLLECTIVE_TIMEOUT``, set below; it
exists once the "async" branch is merged).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from hvd_slowmo.checkpoint import load_checkpoint

from horovod_launch import ROOT, horovodrun_command, launch_env
from torchrun_launch import free_port

WORKER = os.path.join(ROOT, "tests", "workers", "matrix_worker.py")
ENGINES = ("horovod-gloo", "horovod-mpi", "torchdist-gloo")
CONFIGS = ("plain", "overlap2", "frag4", "int8")
FAULTS = ("kill", "freeze", "raise", "late_join")
DEADLINE = 10  # seconds: every engine's timeout for a frozen peer
BOUND = 150  # seconds: a cell that has not ended by then is a hang

FULL = os.environ.get("HVD_SLOWMO_FAULT_MATRIX") == "1"


def _reduced(engine: str, config: str, fault: str) -> bool:
    return engine == "horovod-gloo" and (fault == "kill" or config == "plain")


CELLS = [pytest.param(e, c, f, id=f"{e}-{c}-{f}") for e in ENGINES for c in CONFIGS for f in FAULTS]


def command(engine: str, out: str, config: str, fault: str) -> list[str]:
    args = [WORKER, out, engine.split("-")[0], config, fault]
    if engine.startswith("horovod"):
        return horovodrun_command(2, engine.split("-")[1], args)
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    return [exe, "--nnodes=1", "--nproc-per-node=2", "--master-addr=127.0.0.1",
            f"--master-port={free_port()}", *args]  # fmt: skip


def run_cell(tmp_path, engine: str, config: str, fault: str) -> tuple[int, str, float]:
    """One launch; returns (exit code, output, seconds). A launch past BOUND fails the test."""
    env = launch_env(
        {
            "HOROVOD_GLOO_TIMEOUT_SECONDS": str(DEADLINE),
            "HVD_SLOWMO_COLLECTIVE_TIMEOUT": str(DEADLINE),
            "FAULT_MATRIX_ENGINE_TIMEOUT": str(DEADLINE),
        }
    )
    t0 = time.monotonic()
    proc = subprocess.Popen(
        command(engine, str(tmp_path), config, fault), cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=BOUND)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        pytest.fail(f"hang: the launch did not end within {BOUND}s\n{out[-3000:]}")
    finally:
        kill_group(proc)
    return proc.returncode, out, time.monotonic() - t0


def kill_group(proc: subprocess.Popen) -> None:
    # A SIGSTOPped worker ignores SIGTERM until continued: SIGCONT, then SIGKILL.
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return


def outcome(tmp_path, rc: int, out: str, engine: str, fault: str) -> str:
    """Check that the cell ended in one of the two documented ways; return which."""
    results = {}
    for r in (0, 1):
        path = tmp_path / f"result.{r}.json"
        if path.exists():
            results[r] = json.loads(path.read_text())
    # Nothing partial: no temporary file of the atomic save, every checkpoint loads.
    assert not list(tmp_path.glob("*.tmp")), sorted(os.listdir(tmp_path))
    for ckpt in tmp_path.glob("*.pt"):
        load_checkpoint(ckpt)
    if rc == 0:
        assert set(results) == {0, 1}, out[-3000:]
        assert all(r["error"] is None for r in results.values()), results
        assert results[0]["anchor"] == results[1]["anchor"]
        return "goes on"
    assert (tmp_path / "fault.json").exists(), f"exited {rc} before the fault\n{out[-3000:]}"
    errors = [r for r in results.values() if r["error"] is not None]
    if not errors and engine != "horovod-gloo":
        # mpirun, and torchrun (SIGTERM to the others), can end the job as soon as a process
        # dies, before a survivor reports: their own message names the rank (the step is in
        # the fault record only).
        launcher = r"process rank \d+ .* exited on signal|exitcode: -9\) local_rank: \d+"
        assert re.search(launcher, out), out[-3000:]
        return "stops"
    assert errors, f"exited {rc}, no rank recorded an error\n{out[-3000:]}"
    named = [r for r in errors if "rank" in r["message"] and "step" in r["message"]]
    assert named, errors
    if fault == "raise":
        assert any("phase" in r["message"] for r in errors), errors
    return "stops"


@pytest.mark.horovod
@pytest.mark.timeout(BOUND + 60)
@pytest.mark.parametrize("engine,config,fault", CELLS)
def test_fault_cell(tmp_path, engine, config, fault):
    if not (FULL or _reduced(engine, config, fault)):
        pytest.skip("full matrix: HVD_SLOWMO_FAULT_MATRIX=1")
    rc, out, seconds = run_cell(tmp_path, engine, config, fault)
    got = outcome(tmp_path, rc, out, engine, fault)
    expected = "goes on" if fault == "late_join" else "stops"
    assert got == expected, out[-3000:]
    print(f"CELL {engine} {config} {fault}: {got} in {seconds:.1f}s")
