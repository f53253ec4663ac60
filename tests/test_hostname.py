"""The host-name check before Gloo launches.

Where this machine's host name does not resolve (a Debian 13 debootstrap root whose /etc/hosts did
not name the host), a 2-rank ``horovodrun --gloo`` job segfaulted in Gloo's device.cc.
``scripts/check_hostname.sh`` (run by ``scripts/setup_env.sh``, which then warns) and the
examples' launcher (``slowmo_lab.sweep.horovodrun_command``, used by examples/compare.py)
say what to do instead. A name under ``.invalid`` never resolves (RFC 6761).
"""

import os
import subprocess

import pytest

from slowmo_lab import sweep

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "check_hostname.sh")
NO_SUCH_HOST = "hvd-slowmo-no-such-host.invalid"


def run_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", SCRIPT, *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_script_says_how_to_fix_a_name_that_does_not_resolve():
    proc = run_check(NO_SUCH_HOST)
    assert proc.returncode == 1, proc.stderr
    assert f"the host name '{NO_SUCH_HOST}' does not resolve" in proc.stderr
    assert f"echo '127.0.1.1 {NO_SUCH_HOST}' >> /etc/hosts" in proc.stderr


def test_script_passes_quietly_where_the_name_resolves():
    # The default is this machine's own name: the test machine's resolves, as Gloo needs.
    for args in (("localhost",), ()):
        proc = run_check(*args)
        assert proc.returncode == 0 and proc.stderr == "", (args, proc.stderr)


def test_setup_env_runs_the_check():
    with open(os.path.join(ROOT, "scripts", "setup_env.sh"), encoding="utf-8") as f:
        assert '"$ROOT/scripts/check_hostname.sh" ||' in f.read()


def test_gloo_launch_is_refused_before_it_starts(monkeypatch):
    with pytest.raises(RuntimeError, match=f"'{NO_SUCH_HOST}' does not resolve") as err:
        sweep.require_resolvable_hostname(NO_SUCH_HOST)
    assert f"echo '127.0.1.1 {NO_SUCH_HOST}' >> /etc/hosts" in str(err.value)
    monkeypatch.setattr(sweep.socket, "gethostname", lambda: NO_SUCH_HOST)
    with pytest.raises(RuntimeError, match="does not resolve"):
        sweep.horovodrun_command(2, "gloo")
    # Printing a command (a dry run) and MPI launches do not need the name.
    assert sweep.horovodrun_command(2, "gloo", required=False)[-1] == "--gloo"
    assert "--gloo" not in sweep.horovodrun_command(2, "mpi", required=False)
