"""Launch a worker script under horovodrun (Gloo or MPI) from a test, with a hard timeout."""

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def horovodrun_command(np: int, controller: str, args: list[str], hosts: str = "") -> list[str]:
    """``horovodrun -np NP -H HOSTS --gloo|--mpi python ARGS``, through tests/horovodrun_lean.py
    (horovodrun less its ~3 CPU-s build check, which the workers' ``hvd.init()`` repeats).

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
    lean = os.path.join(ROOT, "tests", "horovodrun_lean.py")
    cmd = [sys.executable, lean, "-np", str(np), "-H", hosts or f"localhost:{np}"]
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
            f"--- stderr\n{excerpt(proc.stderr)}"
        )
    return proc


def excerpt(stderr: str, chars: int = 4000) -> str:
    """A failed launch's stderr for a test's message: the first traceback (the rank that failed
    first; the others' "Horovod has been shut down" come after it) and the end.

    Args:
        stderr: the launcher's merged stderr.
        chars: about how much of each part to keep.
    """
    start = stderr.find("Traceback")
    if start < 0 or len(stderr) <= 2 * chars:
        return stderr[-2 * chars :]
    return f"{stderr[start : start + chars]}\n[...]\n{stderr[-chars:]}"


def run_bounded(cmd: list[str], timeout: float, env=None) -> tuple[int, str, float]:
    """Run a launch whose failure is an expected outcome (a fault test): in its own process
    group, output and errors together; returns (exit code, output, seconds).

    A launch past ``timeout`` is a hang: its group is ended and the test fails. The group is
    ended when the launch returns too, so no worker (a frozen one included) outlives its test.

    Args:
        cmd: the launcher's command line (e.g. from :func:`horovodrun_command`).
        timeout: seconds before the launch counts as hung.
        env: extra environment variables (over :func:`launch_env`).
    """
    t0 = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=launch_env(env), text=True, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc.pid)
        out, _ = proc.communicate()
        pytest.fail(f"hang: the launch did not end within {timeout:g}s\n{out[-4000:]}")
    finally:
        kill_group(proc.pid)
    return proc.returncode, out, time.monotonic() - t0


def kill_group(pgid: int) -> None:
    """End a process group, stopped members included.

    Args:
        pgid: the group's id (the pid of a process started with ``start_new_session=True``).
    """
    # A SIGSTOPped process ignores SIGTERM until continued: SIGCONT, then SIGKILL.
    for sig in (signal.SIGCONT, signal.SIGKILL):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return


def needs_horovod() -> None:
    """Skip the test, saying why and how to fix it, when ``horovod.torch`` does not import."""
    try:
        import horovod.torch  # noqa: F401
    except ImportError as e:
        pytest.skip(f"Horovod is not importable ({e}); build it with scripts/install_horovod.sh")
