"""``torchrun --max-restarts``: a worker killed once in the middle of training, torchrun restarts
the group, every rank resumes from its last complete checkpoint (hvd_slowmo.checkpoint's atomic
save) with the exact SlowMo state, and the final parameters equal an uninterrupted run's bit for
bit (both runs here, on this machine). Worker: tests/workers/torchrun_restart_worker.py.

The case: fragments=2 (boundaries at inner steps 2 and 4 of tau 4), int8 with error feedback,
overlap=1; rank 1 dies before step 6, whose checkpoint holds fragment 0's outer step in flight
(its boundary is step 6, it lands at step 7) and both fragments' residuals.
"""

import os
import signal
import subprocess
import sys

import pytest
import torch

from hvd_slowmo.checkpoint import load_checkpoint

from horovod_launch import ROOT, launch_env
from torchrun_launch import free_port

WORKER = os.path.join(ROOT, "tests", "workers", "torchrun_restart_worker.py")
pytestmark = [pytest.mark.torchdist, pytest.mark.timeout(400)]


def torchrun(out, kill_at: int, config: str) -> subprocess.CompletedProcess:
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [exe, "--nnodes=1", "--nproc-per-node=2", "--max-restarts=1",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}",
           WORKER, str(out), str(kill_at), config]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, env=launch_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)  # fmt: skip
    try:
        out, err = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        out, err = "", ""
    finally:  # the workers too: torchrun killed alone would leave them running
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode is not None, "torchrun did not end within 180 s (a hang)"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.mark.parametrize("config", ["frag2-int8-d1"])
def test_restart_from_the_last_checkpoint_is_bit_for_bit(tmp_path, config):
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    killed.mkdir()
    clean.mkdir()
    run = torchrun(killed, 6, config)
    assert run.returncode == 0, run.stderr[-4000:]
    assert (killed / "killed").exists(), "rank 1 never killed itself"
    assert "exitcode: -9" in run.stderr, "torchrun saw no killed worker"
    for r in (0, 1):
        assert f"rank {r}: resumed at step 6" in run.stdout, run.stdout[-2000:]
    saved = load_checkpoint(killed / "ckpt.0.6.pt")["opt"]["slowmo"]
    flights = [f["in_flight"] is not None for f in saved["fragments"]]
    assert flights == [True, False]  # fragment 0's entry holds its outer step in flight
    assert not list(killed.glob("*.tmp"))
    run = torchrun(clean, -1, config)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "resumed" not in run.stdout
    a, b = load_checkpoint(killed / "final.pt"), load_checkpoint(clean / "final.pt")
    assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))
