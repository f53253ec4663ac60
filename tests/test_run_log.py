"""The run check of scripts/docker_check.sh (examples/run_log.py, the module the examples print
their event lines with) on what the check's example prints today; the Docker check itself is
opt-in (test_docker.py)."""

import os
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
sys.path.insert(0, EXAMPLES)


DOCKER_CHECK = os.path.join(ROOT, "scripts", "docker_check.sh")


def docker_check_example() -> tuple[list[str], int]:
    """The example command scripts/docker_check.sh launches in every container, and its epochs,
    read from the script itself by bash."""
    script = (
        f'eval "$(sed -n "/^EPOCHS=/,/^EXAMPLE=/p" {shlex.quote(DOCKER_CHECK)})"; '
        'printf "%s\\n" "$EPOCHS" "${EXAMPLE[@]}"'
    )
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, check=True)
    epochs, *command = out.stdout.splitlines()
    assert command[:2] == ["python", "examples/digits.py"], command
    return command, int(epochs)


def test_docker_check_reads_what_the_example_prints_now(tmp_path):
    """scripts/docker_check.sh's run check (examples/run_log.py, the module the examples print
    their event lines with) on what its example prints today, launched with the script's own
    flags on one worker without horovodrun; the docker check itself is opt-in (test_docker.py).
    """
    import run_log

    command, epochs = docker_check_example()
    # One outer step (tau=12) per epoch keeps it to seconds; the lines printed are the same.
    proc = subprocess.run(
        [sys.executable, *command[1:], "--max-steps", "12"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = run_log.check_run(proc.stdout, workers=1, epochs=epochs)
    assert len(lines) == epochs and all("val_accuracy" in line for line in lines), lines
    # The command line docker_check.sh runs on the log, as it runs it.
    log = tmp_path / "run.log"
    log.write_text("[0]<stdout>:".join(["", *proc.stdout.splitlines(keepends=True)]))
    check = [
        sys.executable,
        os.path.join(EXAMPLES, "run_log.py"),
        str(log),
        "--epochs",
        str(epochs),
    ]
    assert subprocess.run([*check, "--workers", "1"], capture_output=True).returncode == 0
    wrong = subprocess.run([*check, "--workers", "2"], capture_output=True, text=True)
    assert wrong.returncode == 1 and "expected 2" in wrong.stderr
    with open(DOCKER_CHECK, encoding="utf-8") as f:
        assert 'python3 examples/run_log.py "$file" --workers' in f.read()
