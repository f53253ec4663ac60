"""Chaos run: random kills at random steps of a short training, under each engine, each followed
by a restart from the last checkpoint; reports how many recovered (final parameters bit for bit
equal to an uninterrupted run of the same engine), how many stopped cleanly (a non-zero exit, no
partial checkpoint), how many hung (a launch past its timeout) and how many lost state (recovered
with other final parameters).

The training is tests/workers/torchrun_restart_worker.py (two ranks, 14 steps, fragments=2, int8
with error feedback, overlap=1, a checkpoint per step with the atomic save). A kill: rank R
SIGKILLs itself before step K (R, K drawn at random). torch.distributed: ``torchrun
--max-restarts=1`` restarts the group; Horovod (Gloo, MPI): this script relaunches ``horovodrun``
once, as a scheduler would.

Usage: python scripts/chaos.py [--kills N] [--engines torchdist-gloo,horovod-gloo,horovod-mpi]
       [--seed S] [--timeout SECONDS] [--config frag2-int8-d1]
"""

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from hvd_slowmo.checkpoint import load_checkpoint  # noqa: E402

WORKER = os.path.join(ROOT, "tests", "workers", "torchrun_restart_worker.py")
STEPS = 14  # the worker's
BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(engine: str, out: str, kill_at: int, kill_rank: int, config: str) -> list[str]:
    args = [WORKER, out, str(kill_at), config, engine.split("-")[0], str(kill_rank)]
    if engine == "torchdist-gloo":
        return [os.path.join(BIN, "torchrun"), "--nnodes=1", "--nproc-per-node=2",
                "--max-restarts=1", "--master-addr=127.0.0.1", f"--master-port={free_port()}",
                *args]  # fmt: skip
    cmd = [os.path.join(BIN, "horovodrun"), "-np", "2", "-H", "localhost:2"]
    if engine == "horovod-mpi":
        cmd += ["--mpi", "--mpi-args=--oversubscribe --allow-run-as-root"]
    else:
        cmd += ["--gloo"]
    return cmd + [sys.executable] + args


def launch(cmd: list[str], timeout: float) -> tuple[int | None, str]:
    """Run one launch in its own process group; (exit code or None on a hang, output tail)."""
    env = {**os.environ, "PYTHONPATH": ROOT, "HOROVOD_GLOO_TIMEOUT_SECONDS": "20"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out[-2000:]
    except subprocess.TimeoutExpired:
        return None, ""
    finally:
        for sig in (signal.SIGCONT, signal.SIGKILL):
            try:
                os.killpg(proc.pid, sig)
            except ProcessLookupError:
                break


def final_params(out: str) -> list[torch.Tensor] | None:
    path = os.path.join(out, "final.pt")
    return load_checkpoint(path) if os.path.exists(path) else None


def one_kill(engine, reference, kill_at, kill_rank, config, timeout) -> tuple[str, str]:
    """One killed training and its restart; returns its outcome and the last launch's output
    tail."""
    out = tempfile.mkdtemp(prefix="chaos.")
    try:
        attempts = 1 if engine == "torchdist-gloo" else 2  # torchrun restarts by itself
        rc, tail = None, ""
        for _ in range(attempts):
            rc, tail = launch(command(engine, out, kill_at, kill_rank, config), timeout)
            if rc is None:
                return "hung", tail
            if rc == 0:
                break
        # A rank killed inside a save leaves the save's temporary file (ckpt.R.S.pt.X.tmp),
        # never a partial checkpoint: every .pt must load.
        for name in os.listdir(out):
            if name.endswith(".pt"):
                try:
                    load_checkpoint(os.path.join(out, name))
                except Exception:
                    return "partial checkpoint", tail
        if rc != 0:
            return "stopped cleanly", tail
        got = final_params(out)
        same = got is not None and all(torch.equal(a, b) for a, b in zip(got, reference))
        return ("recovered" if same else "lost state"), tail
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=20, help="kills per engine")
    parser.add_argument("--engines", default="torchdist-gloo,horovod-gloo,horovod-mpi")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=180, help="seconds per launch")
    parser.add_argument("--config", default="frag2-int8-d1")
    parser.add_argument("--deadline", type=float, default=0, help="stop by this unix time")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    report = {}
    for engine in args.engines.split(","):
        ref_dir = tempfile.mkdtemp(prefix="chaos.ref.")
        rc, tail = launch(command(engine, ref_dir, -1, 1, args.config), args.timeout)
        reference = final_params(ref_dir)
        shutil.rmtree(ref_dir, ignore_errors=True)
        if rc != 0 or reference is None:
            report[engine] = {"error": f"uninterrupted run failed ({rc}): {tail}"}
            continue
        counts: dict[str, int] = {}
        kills = []
        for _ in range(args.kills):
            if args.deadline and time.time() > args.deadline:
                break
            kill_at, kill_rank = rng.randrange(1, STEPS), rng.randrange(2)
            t0 = time.monotonic()
            got, tail = one_kill(engine, reference, kill_at, kill_rank, args.config, args.timeout)
            counts[got] = counts.get(got, 0) + 1
            kills.append({"step": kill_at, "rank": kill_rank, "outcome": got,
                          "seconds": round(time.monotonic() - t0, 1)})  # fmt: skip
            print(engine, kills[-1], flush=True)
            if got != "recovered":
                print(tail, flush=True)
        report[engine] = {"kills": len(kills), "outcomes": counts, "runs": kills}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
