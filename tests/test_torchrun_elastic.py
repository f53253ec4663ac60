"""torchrun's elastic rendezvous (c10d, ``--nnodes=1:2``): two agents on this machine (two
emulated nodes, one worker each); node 1 is lost before step 6 (its worker SIGKILLs its agent and
itself); the surviving agent's worker fails, the rendezvous closes again with one node, and the
new worker (world size 1) resumes from the last step both ranks have a checkpoint of, by
hvd_slowmo's restart rule for a changed world: every fragment's parameters back to its anchor,
bit for bit, ``num_steps`` back to the latest boundary whose outer step landed; then it trains
to the end.
Worker: tests/workers/torchrun_elastic_worker.py (fragments=2, int8 with error feedback,
overlap=1: the checkpoint at step 6 holds fragment 0's average in flight).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hvd_slowmo.checkpoint import load_checkpoint

from horovod_launch import ROOT, launch_env
from torchrun_launch import free_port

WORKER = os.path.join(ROOT, "tests", "workers", "torchrun_elastic_worker.py")
KILL_AT = 6
BOUND = 300  # seconds: the survivor not done by then is a hang
pytestmark = [pytest.mark.torchdist, pytest.mark.timeout(BOUND + 60)]


def agents(out, port: int) -> list[subprocess.Popen]:
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [exe, "--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=2",
           "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", f"--rdzv-id=t{port}",
           "--rdzv-conf=last_call_timeout=5", "--monitor-interval=1",
           WORKER, str(out), str(KILL_AT)]  # fmt: skip
    procs = []
    for node in (0, 1):
        log = open(out / f"agent.{node}.log", "w")
        procs.append(
            subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=log,
                             stderr=subprocess.STDOUT, start_new_session=True)
        )  # fmt: skip
        log.close()
        time.sleep(2)  # node 0 first: it hosts the rendezvous store
    return procs


def end_all(procs: list[subprocess.Popen], out) -> None:
    """Kill the agents and their workers (torchrun starts each worker in a session of its own):
    every process whose command line names this test's directory."""
    for p in procs:
        if p.poll() is None:
            p.kill()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if str(out).encode() in f.read():
                    os.kill(int(pid), signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass


def test_lost_node_shrinks_and_training_goes_on(tmp_path):
    procs = agents(tmp_path, free_port())
    try:
        t0 = time.monotonic()
        while procs[0].poll() is None and time.monotonic() - t0 < BOUND:
            time.sleep(0.5)
        logs = "".join((tmp_path / f"agent.{n}.log").read_text()[-3000:] for n in (0, 1))
        assert procs[0].returncode == 0, f"node 0's agent: {procs[0].returncode}\n{logs}"
    finally:
        end_all(procs, tmp_path)
    assert procs[1].returncode == -signal.SIGKILL, logs  # node 1's agent was killed
    resumed = json.loads((tmp_path / "resume.1.json").read_text())
    assert (resumed["size"], resumed["saved_size"], resumed["step"]) == (1, 2, KILL_AT), resumed
    # The restart rule (docs/reliability.md): back to the latest boundary whose outer step landed.
    # tau 4, fragments at inner steps 2 and 4, overlap 1: at step 6 fragment 0's average (boundary
    # 6) is in flight, fragment 1's (boundary 4) landed at 5: back to 4.
    assert resumed["num_steps"] == 4, resumed
    saved = load_checkpoint(tmp_path / f"ckpt.0.{KILL_AT}.pt")["opt"]["slowmo"]
    # The case with an average in flight (in its fragment's entry)
    assert any(f["in_flight"] is not None for f in saved["fragments"])
    anchor = {
        j: f["slow_state"]["anchor"][pos]
        for f in saved["fragments"]
        for pos, j in enumerate(f["members"])
    }
    assert resumed["params"] == [anchor[i].flatten().tolist() for i in range(len(anchor))]
    final = json.loads((tmp_path / "final.json").read_text())
    assert final == {"num_steps": 14, "size": 1, "attempt": "1", "finite": True}, final
    assert not list(tmp_path.glob("*.tmp"))
