"""Launch a worker script under horovodrun (Gloo or MPI) from a test, with a hard timeout."""

import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def horovodrun_command(np: int, controller: str, args: list[str], hosts: str = "") -> list[str]:
    """``horovodrun -np NP -H HOSTS --gloo|--mpi python ARGS``.

    Fails the test if a launcher is missing.

    Args:
        np: number of processes.
        controller: "gloo" or "mpi".
        args: the script and its arguments.
        hosts: horovodrun's ``-H`` (default ``localhost:NP``).
    """
    exe = os.path.join(os.path.dirname(sys.executable), "horovodrun")
    if not os.path.exists(exe):
        pytest.fail(f"horovodrun not found next to {sys.executable}: run scripts/setup_env.sh")
    cmd = [exe, "-np", str(np), "-H", hosts or f"localhost:{np}"]
    if controller == "mpi":
        if shutil.which("mpirun") is None:
            pytest.fail("mpirun not found: install OpenMPI (scripts/setup_env.sh does)")
        # No --bind-to: horovodrun passes -bind-to none itself, and Open MPI 5 refuses it twice.
        cmd += ["--mpi", "--mpi-args=--oversubscribe --allow-run-as-root"]
    else:
        cmd += ["--gloo"]
    return cmd + [sys.executable] + args


def launch_env(extra=None) -> dict:
    """The workers' environment: the repo on PYTHONPATH, one thread per process, plus ``extra``."""
    return {
        **os.environ,
        "PYTHONPATH": ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
        "OMP_NUM_THREADS": "1",
        **(extra or {}),
    }


def horovodrun(
    np: int, controller: str, args: list[str], timeout: float = 240, env=None, hosts: str = ""
) -> subprocess.CompletedProcess:
    """Run ``horovodrun -np NP --gloo|--mpi python ARGS``.

    Fails the test on a non-zero exit or a timeout.

    Args:
        np: number of processes.
        controller: "gloo" or "mpi".
        args: the script and its arguments.
        timeout: seconds before the launch is killed (a deadlock then fails instead of hanging CI).
        env: extra environment variables.
        hosts: horovodrun's ``-H`` (default ``localhost:NP``).
    """
    cmd = horovodrun_command(np, controller, args, hosts)
    full_env = launch_env(env)
    proc = subprocess.run(
        cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{proc.stderr[-4000:]}"
        )
    return proc


def needs_horovod() -> None:
    """Skip the test, saying why and how to fix it, when ``horovod.torch`` does not import."""
    try:
        import horovod.torch  # noqa: F401
    except ImportError as e:
        pytest.skip(f"Horovod is not importable ({e}); build it with scripts/install_horovod.sh")
