"""Launch a worker script under torchrun (torch.distributed) from a test, with a hard timeout."""

import os
import socket
import subprocess
import sys

import pytest

from horovod_launch import ROOT, excerpt, launch_env


def free_port() -> int:
    """A TCP port nobody listens on now (the rendezvous of one launch)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    nproc: int, args: list[str], nnodes: int = 1, timeout: float = 480, env=None
) -> list[subprocess.CompletedProcess]:
    """Run ``torchrun --nproc-per-node NPROC python ARGS``; with ``nnodes > 1``, one torchrun per
    emulated node on this host (static rendezvous at 127.0.0.1, ``--node-rank`` 0..nnodes-1).

    Fails the test on a non-zero exit or a timeout.

    Args:
        nproc: processes per node.
        args: the script and its arguments.
        nnodes: emulated nodes (torchrun's ``GROUP_RANK`` tells them apart).
        timeout: seconds before the launch is killed (a deadlock fails instead of hanging CI).
        env: extra environment variables.
    """
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(exe):
        pytest.fail(f"torchrun not found next to {sys.executable}: is torch installed?")
    port = free_port()
    cmds = [
        [exe, f"--nnodes={nnodes}", f"--nproc-per-node={nproc}", f"--node-rank={node}"]
        + ["--master-addr=127.0.0.1", f"--master-port={port}", *args]
        for node in range(nnodes)
    ]
    full_env = launch_env(env)
    procs = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for cmd in cmds
    ]
    results = []
    try:
        for cmd, proc in zip(cmds, procs):
            out, err = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(cmd, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for r in results:
        if r.returncode != 0:
            pytest.fail(
                f"{' '.join(r.args)} exited {r.returncode}\n--- stdout\n{r.stdout[-4000:]}\n"
                f"--- stderr\n{excerpt(r.stderr)}"
            )
    return results
