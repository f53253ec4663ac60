"""scripts/gpu_check.sh on a CPU: its flags, its steps (each logged and bounded by a timeout) and
what it hands each step, with the fake interpreter and tools of tests/test_install_horovod.py
(a fake torch that reports a GPU, Horovod builds faked by ``pip``, pytest and the benchmark
recorded instead of run). What it does on a real GPU is in the README's GPU check section.
"""

import json
import os
import subprocess

import pytest
from test_install_horovod import ROOT, Sandbox, make_source_tarball

SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")


@pytest.fixture
def box(tmp_path):
    box = Sandbox(tmp_path)
    box.bundle = tmp_path / "bundle"
    box.bundle.mkdir()
    make_source_tarball(str(box.bundle / "horovod-0.28.1.tar.gz"))
    box.out = tmp_path / "out"
    return box


def gpu_check(box, *args, env=None, timeout=300):
    full_env = {
        "PATH": f"{box.bin}:{box.tools}",
        "HOME": str(box.tmp),
        "TMPDIR": str(box.tmp),
        "PYTHONPATH": str(box.site),
        "FAKE_LOG": str(box.log),
        "FAKE_SITE": str(box.site),
        "FAKE_HVD_BUILT": "gloo,nccl,cuda",
        "FAKE_HVD_BUILT_STAGED": "gloo,cuda",
        "FAKE_CUDA_CC": "9.0",
        "CUDA_HOME": str(box.cuda),
        "HVD_SLOWMO_WHEELHOUSE": str(box.wheelhouse),
        **(env or {}),
    }
    return subprocess.run(
        ["bash", SCRIPT, "--python", str(box.bin / "python"), "--out", str(box.out), *args],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def runs(box):
    path = box.log / "runs.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_every_step_runs_offline_from_a_bundle(box):
    proc = gpu_check(box, "--bundle", str(box.bundle))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = proc.stdout[proc.stdout.index("gpu_check: summary") :].splitlines()
    for name in ("facts", "nccl", "staged", "tests", "bench"):
        assert any(line.split()[:2] == [name, "passed"] for line in summary), (name, summary)
        assert (box.out / f"{name}.log").exists(), name
    assert "GPU 0: Fake GPU, 128 GiB, compute capability 9.0" in (box.out / "facts.log").read_text()
    staged = box.out / "staged-horovod"
    assert (
        (staged / "horovod" / ".hvd_slowmo_key")
        .read_text()
        .strip()
        .endswith("_staged-nompi_gcc13_nvcc-13.0_sm90")
    )
    # Both builds went offline through the bundle; the NCCL one asked for the GPU's architecture.
    pip = box.pip_calls()
    assert all("--no-index" in c and str(box.bundle) in c for c in pip), pip
    wheel_env = json.loads((box.log / "wheel_env.json").read_text())
    assert wheel_env["HOROVOD_BUILD_CUDA_CC_LIST"] == "90"
    assert (
        (box.site / "horovod" / ".hvd_slowmo_key")
        .read_text()
        .strip()
        .endswith("_nccl-nompi_gcc13_nvcc-13.0_sm90")
    )
    pytest_run, bench_run = runs(box)
    assert (
        pytest_run["kind"] == "pytest"
        and "-m" in pytest_run["args"]
        and "cuda" in pytest_run["args"]
    )
    assert pytest_run["args"][2].endswith("tests/test_cuda.py") and pytest_run["cwd"] == ROOT
    assert pytest_run["env"]["PYTHONUNBUFFERED"] == "1" and pytest_run["env"][
        "PYTHONPATH"
    ].startswith(ROOT)
    assert pytest_run["env"]["HVD_SLOWMO_STAGED_HOROVOD"] == str(staged)
    assert bench_run["kind"] == "bench" and "fake bench ran" in proc.stdout
    # A later call that only runs the tests (a second device command) finds that staged build.
    again = gpu_check(box, "--steps", "tests")
    assert again.returncode == 0 and runs(box)[-1]["env"]["HVD_SLOWMO_STAGED_HOROVOD"] == str(
        staged
    )


def test_a_staged_build_with_nccl_is_refused_and_not_handed_on(box):
    proc = gpu_check(
        box,
        "--bundle",
        str(box.bundle),
        "--steps",
        "staged,tests",
        env={"FAKE_HVD_BUILT_STAGED": "gloo,nccl,cuda"},
    )
    assert proc.returncode == 1
    assert "nccl present" in (box.out / "staged.log").read_text()
    assert runs(box)[0]["env"]["HVD_SLOWMO_STAGED_HOROVOD"] is None
    # Alone too, the staged build is compiled for the GPU's architecture.
    assert (
        json.loads((box.log / "wheel_env.json").read_text())["HOROVOD_BUILD_CUDA_CC_LIST"] == "90"
    )


def test_a_hanging_step_times_out_and_the_rest_still_runs(box):
    proc = gpu_check(
        box, "--steps", "tests,bench", "--timeout", "2", env={"FAKE_SLEEP_pytest": "60"}
    )
    assert proc.returncode == 1
    assert "TIMED OUT after 4s" in proc.stdout  # the tests step gets twice the step timeout
    # Unbuffered output survived the kill
    assert "fake pytest ran" in (box.out / "tests.log").read_text()
    assert [r["kind"] for r in runs(box)] == ["pytest", "bench"]


def test_a_failing_nccl_build_skips_the_tests(box):
    proc = gpu_check(
        box, "--steps", "nccl,tests", "--bundle", str(box.bundle), env={"FAKE_WHEEL_RC": "1"}
    )
    assert proc.returncode == 1
    assert "building Horovod failed" in (box.out / "nccl.log").read_text()
    assert "skipped: the NCCL Horovod did not build" in proc.stdout
    assert runs(box) == []


def test_no_gpu_stops_after_the_facts(box):
    proc = gpu_check(box, env={"FAKE_CUDA_CC": ""})
    assert proc.returncode == 2 and "gpu_check: error: no usable GPU: stopping" in proc.stderr
    assert "torch sees no CUDA GPU" in (box.out / "facts.log").read_text()
    assert box.pip_calls() == [] and runs(box) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "facts,train"], "--steps: unknown step 'train'"),
        (["--timeout", "0"], "--timeout must be a positive number of seconds, not '0'"),
        (["--mpi", "maybe"], "--mpi must be auto, yes or no, not 'maybe'"),
        (["--bundle", "/nonexistent/bundle"], "--bundle: '/nonexistent/bundle' is not a directory"),
        (["--python"], "--python needs a value"),
        (["--gpu"], "unknown argument '--gpu'"),
    ],
    ids=["step", "timeout", "mpi", "bundle", "python-value", "unknown"],
)
def test_bad_flags_are_clear_errors(box, args, message):
    proc = gpu_check(box, *args)
    assert proc.returncode == 2 and f"gpu_check: error: {message}" in proc.stderr, proc.stderr
    assert not (box.out / "facts.log").exists()
