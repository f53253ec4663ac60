"""Launch a worker script under horovodrun (Gloo or MPI) from a test, with a hard timeout."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings

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

    Fails the test on a non-zero exit or a timeout. A launch that failed inside Horovod alone
    (:func:`horovod_own_failure`) is launched once more, with a warning naming the cause in the
    test report; a second failure fails the test.

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
    for attempt in (1, 2):
        proc = subprocess.run(
            cmd, cwd=ROOT, env=full_env, capture_output=True, text=True, timeout=timeout
        )
        cause = horovod_own_failure(proc.stderr) if proc.returncode != 0 else None
        if cause is None or attempt == 2:
            break
        warnings.warn(f"relaunched once after a failure inside Horovod: {cause}", stacklevel=2)
    if proc.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}\n"
            f"--- stderr\n{excerpt(proc.stderr)}"
        )
    return proc


_ERROR_LINE = re.compile(
    r"^(?:\[\d+\]<std(?:err|out)>:)?\s*([A-Za-z_.]*(?:Error|Exception)): (.*)$"
)
_SHUT_DOWN = ("Horovod has been shut down", "Horovod detected that one or more processes exited")


def horovod_own_failure(stderr: str) -> str | None:
    """The cause when a launch failed inside Horovod alone, else None.

    Horovod's background loop can fail on its own (seen once in CI under --gloo with process
    sets: every rank raised "Horovod has been shut down" at the same collective, and no rank
    raised anything else). Then every exception raised is a shutdown one; a failure of the
    library or the test raises some other exception on the rank that failed first.

    Args:
        stderr: the launcher's merged stderr.
    """
    raised = [m.groups() for line in stderr.splitlines() if (m := _ERROR_LINE.match(line))]
    if not raised or not all(any(s in text for s in _SHUT_DOWN) for _, text in raised):
        return None
    logged = [line for line in stderr.splitlines() if "background loop" in line]
    return logged[0] if logged else "every rank raised 'Horovod has been shut down'"


def excerpt(stderr: str, chars: int = 4000) -> str:
    """A failed launch's stderr for a test's message: the lines that name a cause before the
    first traceback (Horovod logs its background loop's own failure, e.g. a Gloo error, as one
    ``[ERROR]`` line and then every rank raises "Horovod has been shut down"), the first
    traceback (the rank that failed first) and the end.

    Args:
        stderr: the launcher's merged stderr.
        chars: about how much of each part to keep.
    """
    start = stderr.find("Traceback")
    if start < 0 or len(stderr) <= 2 * chars:
        return stderr[-2 * chars :]
    causes = [
        line
        for line in stderr[:start].splitlines()
        if any(word in line for word in ("ERROR", "rror:", "xception", "imed out", "Gloo"))
    ]
    cause = "\n".join(causes)[-chars:]
    return f"{cause}\n[...]\n{stderr[start : start + chars]}\n[...]\n{stderr[-chars:]}"


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
