"""Install without a compiler: a fresh virtualenv with torch alone (no Horovod, no mpi4py)
installs hvd_slowmo with ``pip install .`` and runs a 2-process torchrun job.

Installing ``torch==2.13.0`` into a new venv takes ~4.5 minutes on the shared 2-core machine
(unpacking ~900 MB), far over a test's budget. So torch is installed once per machine with
``pip install --target`` (from the index; here pip's configured find-links take the CPU wheel
on local disk) into ``~/.cache/hvd_slowmo/torch-2.13.0-cpXY``, and each run makes a fresh venv
that sees that folder through a ``.pth`` file; hvd_slowmo itself is installed afresh every time,
as a user would (``pip install .``: build isolation fetches setuptools from the index, the
``torch>=2.1`` requirement is met by the cached torch). The first run on a machine pays the
torch install.

The repository is copied first, so nothing built in the checkout leaks in. The job is Local
SGD + SlowMo over the torch.distributed engine: the ranks must end bitwise identical after every
exact average and match the hand-written reference.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import venv
from pathlib import Path

import pytest
import torch

from horovod_launch import ROOT
from reference import reference_slowmo
from torchrun_launch import free_port

TORCH = "torch==2.13.0"
pytestmark = [pytest.mark.torchdist, pytest.mark.timeout(900)]


def run(cmd, timeout, **kwargs):
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    assert proc.returncode == 0, (
        f"{cmd} exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    )
    return proc.stdout


def torch_only_site(env: dict[str, str]) -> Path:
    """The folder holding torch and its dependencies alone (built on first use, atomically)."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "hvd_slowmo"
    site = cache / f"{TORCH.replace('==', '-')}-{tag}"
    if not (site / "torch").is_dir():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = tempfile.mkdtemp(dir=cache, prefix=".building-")
        run([sys.executable, "-m", "pip", "install", "-q", "--target", tmp, TORCH], 900, env=env)
        try:
            os.rename(tmp, site)
        except OSError:  # another run built it meanwhile
            shutil.rmtree(tmp, ignore_errors=True)
    return site


def test_fresh_venv_installs_with_torch_alone_and_runs_torchrun(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["OMP_NUM_THREADS"] = "1"
    prefix = tmp_path / "venv"
    venv.EnvBuilder(with_pip=True).create(prefix)
    python = str(prefix / "bin" / "python")
    purelib = run(
        [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], 60, env=env
    )
    (Path(purelib.strip()) / "torch_only.pth").write_text(f"{torch_only_site(env)}\n")
    repo = tmp_path / "repo"
    shutil.copytree(
        ROOT,
        repo,
        ignore=shutil.ignore_patterns(
            ".venv", ".git", "runs", "*.egg-info", "build", "__pycache__"
        ),
    )
    # As a user would: build isolation fetches setuptools >= 64 (the venv's bundled 65 would
    # need the wheel package too); the torch requirement is met by the cached torch.
    run(
        [python, "-m", "pip", "install", "-q", str(repo)],
        timeout=600,
        env=env,
    )
    probe = (
        "import importlib.metadata as md, importlib.util, hvd_slowmo, torch; "
        "print(torch.__version__, importlib.util.find_spec('horovod') is None, "
        "importlib.util.find_spec('mpi4py') is None, md.requires('hvd_slowmo'))"
    )
    version, no_hvd, no_mpi, requires = run(
        [python, "-c", probe], 120, env=env, cwd=tmp_path
    ).split(" ", 3)
    assert version.startswith("2.13.0") and no_hvd == "True" and no_mpi == "True"
    assert "horovod" not in requires.lower(), f"horovod became an install requirement: {requires}"
    # The job: the installed package, not the copy (the worker's folder holds only tests' helpers).
    out = tmp_path / "out"
    out.mkdir()
    run(
        [python, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1"]
        + [f"--master-port={free_port()}", str(repo / "tests" / "workers" / "torchdist_worker.py")]
        + [str(out), "core-sgd"],
        timeout=480,
        env=env,
        cwd=tmp_path,
    )
    res = [torch.load(out / f"core-sgd.{r}.pt", weights_only=False) for r in range(2)]
    assert all(r["package"].startswith(str(prefix)) for r in res), "the copy was imported"
    assert res[0]["comm"] == "TorchDistCommunicator"
    snaps = [r["sgd-reset"]["snaps"] for r in res]
    assert len(snaps[0]) == 3
    for step, (a, b) in enumerate(zip(*snaps)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), f"ranks differ after outer step {step}"
    sgd = lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9, nesterov=True)  # noqa: E731
    for rank, want in enumerate(reference_slowmo(2, 9, 3, 0.7, 0.6, sgd, buffers="reset")):
        for key, value in want.state_dict().items():
            torch.testing.assert_close(
                res[rank]["sgd-reset"]["final"][key], value, rtol=1e-4, atol=1e-5
            )
