"""scripts/gpu_check.sh on a CPU: its flags, its plan (``--dry-run``), its steps (each logged and
bounded by a timeout cut to the budget, the two Horovod builds and the test groups in parallel),
the build environment it hands on untouched (an exported ``CC`` stays the C compiler), its test
groups' selections (each collects at least one test of tests/test_cuda.py, checked by pytest's
own collection; a group that selects none fails, saying so), and the summary of figures
(scripts/gpu_summary.py, also on a recorded log). The fake interpreter and tools of
tests/test_install_horovod.py stand in for torch and the Horovod builds; pytest and the two
benchmarks are recorded instead of run. What it does on a real GPU: docs/gpu.md.
"""

import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from install_sandbox import ROOT, Sandbox, make_source_tarball, write_exe

SCRIPT = os.path.join(ROOT, "scripts", "gpu_check.sh")
RECORDED = os.path.join(ROOT, "tests", "data", "gpu_check")
TEST_STEPS = ("tests-threads", "tests-torchdist", "tests-nccl", "tests-staged")

# In front of the sandbox's fake interpreter: pytest and the two benchmarks go to GPU_TOOLS;
# `pip wheel` leaves a copy of its environment per flavour (the two builds run at once).
FAKE_PYTHON = """\
#!/bin/sh
case "$1 $2 $3" in
  "-m pip wheel") env > "$FAKE_LOG/wheel_env.${{HOROVOD_GPU_OPERATIONS:-staged}}.txt" ;;
esac
case "$1 $2" in "-m pytest") exec {python} {gpu_tools} "$@" ;; esac
case "$1" in *gpu_resnet50.py|*codec_cost.py) exec {python} {gpu_tools} "$@" ;; esac
exec {inner} "$@"
"""

GPU_TOOLS = """\
import json, os, sys, time
args = sys.argv[1:]
kind = "pytest" if args[:2] == ["-m", "pytest"] else (
    "bench" if args[0].endswith("gpu_resnet50.py") else "codec")
if kind == "pytest":
    kind = "pytest:" + args[args.index("--junitxml") + 1].rsplit("/", 1)[-1][:-4]
keep = ("PYTHONUNBUFFERED", "PYTHONPATH", "HVD_SLOWMO_STAGED_HOROVOD", "CC")
record = {"kind": kind, "args": args, "cwd": os.getcwd(), "start": time.time(),
          "env": {k: os.environ.get(k) for k in keep}}
print(f"fake {kind} ran")
name = kind.split(":")[-1]
time.sleep(float(os.environ.get(f"FAKE_SLEEP_{name}".replace("-", "_"), "0")))
record["end"] = time.time()
with open(os.path.join(os.environ["FAKE_LOG"], "runs.jsonl"), "a") as f:
    f.write(json.dumps(record) + "\\n")
recorded = os.environ.get("FAKE_RECORDED")
empty = os.environ.get(f"FAKE_EMPTY_{name}".replace("-", "_"))
if kind.startswith("pytest") and empty is not None:  # the selection collects nothing
    print("collected 62 items / 62 deselected / 0 selected")
    print("========== 62 deselected in 0.50s ==========")
    sys.exit(int(empty))
if kind.startswith("pytest"):
    print("========== 3 passed, 1 skipped in 2.50s ==========")
elif kind == "bench" and recorded:
    print(open(os.path.join(recorded, "bench.log")).read())
elif kind == "codec" and recorded:
    with open(args[args.index("--json") + 1], "w") as f:
        f.write(open(os.path.join(recorded, "codec.json")).read())
sys.exit(int(os.environ.get(f"FAKE_RC_{name}".replace("-", "_"), "0")))
"""


@pytest.fixture
def box(tmp_path):
    box = Sandbox(tmp_path)
    box.bundle = tmp_path / "bundle"
    box.bundle.mkdir()
    make_source_tarball(str(box.bundle / "horovod-0.28.1.tar.gz"))
    box.out = tmp_path / "out"
    (box.bin / "python").rename(box.bin / "python-inner")
    (box.bin / "gpu_tools.py").write_text(GPU_TOOLS)
    write_exe(
        box.bin / "python",
        FAKE_PYTHON.format(
            python=sys.executable,
            gpu_tools=box.bin / "gpu_tools.py",
            inner=box.bin / "python-inner",
        ),
    )
    for tool in ("nproc", "sleep", "env", "wait"):
        found = shutil.which(tool)
        if found and not (box.tools / tool).exists():
            os.symlink(found, box.tools / tool)
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
        "FAKE_RECORDED": RECORDED,
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


def steps(box):
    lines = (box.out / "steps.tsv").read_text().splitlines()
    return {line.split("\t")[0]: line.split("\t")[1:] for line in lines[1:]}


def wheel_env(box, flavour):
    text = (box.log / f"wheel_env.{flavour}.txt").read_text()
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line)


def test_every_step_runs_offline_from_a_bundle(box):
    # An image that exports CC (the H100 one did): the builds must get it untouched.
    proc = gpu_check(box, "--bundle", str(box.bundle), env={"CC": "/opt/cc-of-the-image"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    done = steps(box)
    for name in ("facts", "nccl", "staged", *TEST_STEPS, "bench", "codec"):
        assert done[name][0] == "passed", (name, done)
        assert (box.out / f"{name}.log").exists(), name
    assert "GPU 0: Fake GPU, 128 GiB, compute capability 9.0" in (box.out / "facts.log").read_text()
    staged = box.out / "staged-horovod"
    assert (
        (staged / "horovod" / ".hvd_slowmo_key")
        .read_text()
        .strip()
        .endswith("_staged-nompi_gcc13_nvcc-13.0_sm90")
    )
    assert (
        (box.site / "horovod" / ".hvd_slowmo_key")
        .read_text()
        .strip()
        .endswith("_nccl-nompi_gcc13_nvcc-13.0_sm90")
    )
    # Both builds went offline through the bundle, for the GPU's architecture, with half the
    # cores each and the environment's C compiler.
    pip = box.pip_calls()
    assert all("--no-index" in c and str(box.bundle) in c for c in pip), pip
    half = max(1, (os.cpu_count() or 2) // 2)
    for flavour in ("NCCL", "staged"):
        build = wheel_env(box, flavour)
        assert build["HOROVOD_BUILD_CUDA_CC_LIST"] == "90", flavour
        assert build["CC"] == "/opt/cc-of-the-image", flavour
        assert build["MAKEFLAGS"] == f"-j{half}", flavour
    # Each test group: its selection of tests/test_cuda.py in the full tier, unbuffered, the
    # repo first on the path; only the staged group gets the staged Horovod.
    by_kind = {r["kind"]: r for r in runs(box)}
    selections = {
        "tests-threads": "cuda and not horovod and not torchdist",
        "tests-torchdist": "cuda and torchdist",
        "tests-nccl": "cuda and horovod",
        "tests-staged": "cuda and horovod",
    }
    for name, mark in selections.items():
        run = by_kind[f"pytest:{name}"]
        args = run["args"]
        assert args[2].endswith("tests/test_cuda.py") and run["cwd"] == ROOT, args
        assert args[args.index("-m", 3) + 1] == mark, args
        assert args[args.index("--tier") + 1] == "full", args
        assert run["env"]["PYTHONUNBUFFERED"] == "1" and run["env"]["PYTHONPATH"].startswith(ROOT)
        assert run["env"]["CC"] == "/opt/cc-of-the-image"
        want_staged = str(staged) if name == "tests-staged" else None
        assert run["env"]["HVD_SLOWMO_STAGED_HOROVOD"] == want_staged, name
    assert by_kind["pytest:tests-staged"]["args"][-1] != "staged"  # -k staged, then the options
    assert "staged" in by_kind["pytest:tests-staged"]["args"]
    assert "not staged" in by_kind["pytest:tests-nccl"]["args"]
    assert set(by_kind) >= {"bench", "codec"}
    # The summary: printed and written, with the recorded benchmark's rows and the device.
    summary = (box.out / "summary.md").read_text()
    assert summary in proc.stdout
    assert "| plain torch | 34.89 | 1.000x |" in summary
    assert "| tests-staged | passed |" in summary and "3 passed, 1 skipped" in summary
    assert "Fake GPU, 128 GiB, compute capability 9.0" in summary
    assert "| int8 | cuda |" in summary
    # A later call that only runs the tests finds the staged build of this one.
    before = len(runs(box))
    again = gpu_check(box, "--steps", "tests")
    assert again.returncode == 0, again.stdout + again.stderr
    later = {r["kind"]: r for r in runs(box)[before:]}
    assert later["pytest:tests-staged"]["env"]["HVD_SLOWMO_STAGED_HOROVOD"] == str(staged)


def test_builds_and_test_groups_run_in_parallel(box):
    marker = box.out / "staged-horovod" / "horovod" / ".hvd_slowmo_key"  # from an earlier call
    marker.parent.mkdir(parents=True)
    marker.write_text("key\n")
    proc = gpu_check(
        box,
        "--steps",
        "tests",
        env={f"FAKE_SLEEP_{n.replace('-', '_')}": "8" for n in TEST_STEPS},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    spans = {r["kind"].split(":")[1]: (r["start"], r["end"]) for r in runs(box)}
    assert set(spans) == set(TEST_STEPS)
    # All four groups at once here (no builds to wait for): each began before any ended.
    assert max(s for s, _ in spans.values()) < min(e for _, e in spans.values()), spans


def test_the_nccl_build_and_the_thread_tests_overlap(box):
    # The fake build takes no time, so let the thread tests take long: the NCCL tests must
    # start while they still run (as soon as the build is done, not after every phase-1 step).
    proc = gpu_check(
        box,
        "--steps",
        "nccl,tests",
        "--bundle",
        str(box.bundle),
        env={"FAKE_SLEEP_tests_threads": "20"},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    spans = {r["kind"].split(":")[-1]: (r["start"], r["end"]) for r in runs(box)}
    assert spans["tests-nccl"][0] < spans["tests-threads"][1], spans
    # No staged build in this call (nor from an earlier one): its tests are skipped, saying why.
    assert steps(box)["tests-staged"][0].startswith("skipped: no staged Horovod")


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
    assert "pytest:tests-staged" not in {r["kind"] for r in runs(box)}
    assert steps(box)["tests-staged"][0].startswith("skipped")
    # Alone too, the staged build is compiled for the GPU's architecture, with every core.
    build = wheel_env(box, "staged")
    assert build["HOROVOD_BUILD_CUDA_CC_LIST"] == "90"
    assert build["MAKEFLAGS"] == f"-j{os.cpu_count()}"


def test_a_hanging_step_times_out_and_the_rest_still_runs(box):
    proc = gpu_check(
        box,
        "--steps",
        "tests,bench",
        "--timeout",
        "2",
        env={"FAKE_SLEEP_tests_threads": "60"},
    )
    assert proc.returncode == 1
    done = steps(box)
    assert done["tests-threads"][0] == "TIMED OUT after 2s"
    assert done["tests-torchdist"][0] == "passed" and done["bench"][0] == "passed"
    # Unbuffered output survived the kill
    assert "fake pytest:tests-threads ran" in (box.out / "tests-threads.log").read_text()
    assert "| tests-threads | TIMED OUT after 2s |" in (box.out / "summary.md").read_text()
    assert "no pytest summary (timed out)" in (box.out / "summary.md").read_text()


@pytest.mark.parametrize("rc", ["5", "0"], ids=["exit-5", "0-selected"])
def test_a_group_that_selects_no_test_fails_saying_so(box, rc):
    """The H200 run of issue 35: three groups collected nothing (pytest's exit 5, "0 selected")
    and the summary guessed "killed?". A group that checks nothing fails, and says so. (pytest
    itself exits 5 then; the check also reads "0 selected" in the log, whatever the exit.)"""
    proc = gpu_check(box, "--steps", "tests", env={"FAKE_EMPTY_tests_nccl": rc})
    assert proc.returncode == 1, proc.stdout + proc.stderr
    done = steps(box)
    assert done["tests-nccl"][0] == "FAILED: no test selected"
    assert done["tests-threads"][0] == "passed" and done["tests-torchdist"][0] == "passed"
    assert "gpu_check: -- tests-nccl FAILED: no test selected" in proc.stdout
    assert (
        "gpu_check: tests-nccl: no test selected by pytest -m cuda and horovod -k not staged "
        "--tier full in tests/test_cuda.py"
    ) in proc.stdout
    summary = (box.out / "summary.md").read_text()
    assert "| tests-nccl | FAILED: no test selected |" in summary
    assert "| no test selected (62 deselected) |" in summary
    assert "killed?" not in proc.stdout


def test_the_budget_bounds_the_whole_run(box):
    # Every test group hangs. With a 90 s budget the tests get what is left once the benchmark
    # and the codec cost have their share (45 s + 20 s + 5 s for the summary): about 20 s.
    proc = gpu_check(
        box,
        "--steps",
        "tests,bench,codec",
        "--budget",
        "90",
        env={f"FAKE_SLEEP_{n.replace('-', '_')}": "300" for n in TEST_STEPS},
        timeout=200,
    )
    assert proc.returncode == 1
    done = steps(box)
    for name in ("tests-threads", "tests-torchdist", "tests-nccl"):
        status, seconds, limit = done[name]
        assert status.startswith("TIMED OUT") and 10 <= int(limit) <= 21, (name, done)
    assert done["bench"][0] == "passed" and done["codec"][0] == "passed"
    elapsed = max(int(done[n][1]) for n in TEST_STEPS) + int(done["bench"][1])
    assert elapsed + int(done["codec"][1]) <= 90, done
    # Too small a budget for anything: every step says so, and the check fails.
    again = gpu_check(box, "--steps", "tests,bench", "--budget", "30")
    assert again.returncode == 1
    assert steps(box)["tests-threads"][0] == "skipped: out of the 30s budget"


def test_quick_mode_builds_once_and_runs_less(box):
    proc = gpu_check(box, "--quick", "--bundle", str(box.bundle))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    done = steps(box)
    assert "staged" not in done and done["nccl"][0] == "passed"
    assert wheel_env(box, "NCCL")["MAKEFLAGS"] == f"-j{os.cpu_count()}"
    by_kind = {r["kind"]: r["args"] for r in runs(box)}
    assert by_kind["pytest:tests-nccl"][by_kind["pytest:tests-nccl"].index("-k") + 1] == "np1"
    assert "base_on_device" in by_kind["pytest:tests-threads"]
    assert by_kind["bench"][-4:] == ["--windows", "2", "--repeats", "5"]
    assert "--mb" in by_kind["codec"]


def test_dry_run_prints_the_plan_and_runs_nothing(box):
    proc = gpu_check(box, "--dry-run", "--bundle", str(box.bundle), env={"CC": "90"})
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "nothing runs" in out and "budget 360s" in out
    half = max(1, (os.cpu_count() or 2) // 2)
    assert re.search(rf"nccl: MAKEFLAGS=-j{half} \S+install_horovod.sh .*--gpu yes", out), out
    assert "--gpu staged --target" in out
    for name in (*TEST_STEPS, "bench", "codec"):
        assert f"  {name}: " in out, name
    # The plan never names a compiler: the environment's CC=90 is not touched or echoed.
    assert not re.search(r"(^|\s)CC=", out), out
    assert not box.out.exists() and runs(box) == [] and box.pip_calls() == []


def test_no_gpu_stops_after_the_facts(box):
    proc = gpu_check(box, env={"FAKE_CUDA_CC": ""})
    assert proc.returncode == 2 and "gpu_check: error: no usable GPU: stopping" in proc.stderr
    assert "torch sees no CUDA GPU" in (box.out / "facts.log").read_text()
    assert box.pip_calls() == [] and runs(box) == []
    assert "| facts | FAILED (exit 1) |" in proc.stdout  # the summary still says what happened


def test_a_failing_nccl_build_skips_its_tests_only(box):
    proc = gpu_check(
        box, "--steps", "nccl,tests", "--bundle", str(box.bundle), env={"FAKE_WHEEL_RC": "1"}
    )
    assert proc.returncode == 1
    assert "building Horovod failed" in (box.out / "nccl.log").read_text()
    done = steps(box)
    assert done["tests-nccl"][0] == "skipped: the NCCL Horovod did not build"
    assert done["tests-threads"][0] == "passed" and done["tests-torchdist"][0] == "passed"


@pytest.mark.parametrize(
    "args, message",
    [
        (["--steps", "facts,train"], "--steps: unknown step 'train'"),
        (["--timeout", "0"], "--timeout must be a positive number of seconds, not '0'"),
        (["--budget", "6m"], "--budget must be a positive number of seconds, not '6m'"),
        (["--mpi", "maybe"], "--mpi must be auto, yes or no, not 'maybe'"),
        (["--bundle", "/nonexistent/bundle"], "--bundle: '/nonexistent/bundle' is not a directory"),
        (["--python"], "--python needs a value"),
        (["--gpu"], "unknown argument '--gpu'"),
    ],
    ids=["step", "timeout", "budget", "mpi", "bundle", "python-value", "unknown"],
)
def test_bad_flags_are_clear_errors(box, args, message):
    proc = gpu_check(box, *args)
    assert proc.returncode == 2 and f"gpu_check: error: {message}" in proc.stderr, proc.stderr
    assert not (box.out / "facts.log").exists()


# --- each group's selection, collected by pytest on the real test file ---------------------------
def plan_groups(*args: str) -> dict[str, list[str]]:
    """Each test group's pytest arguments (those after ``-m pytest``) in the plan that
    ``gpu_check.sh --dry-run ARGS`` prints: what the check runs, quoted as it runs it."""
    proc = subprocess.run(
        ["bash", SCRIPT, "--dry-run", "--python", sys.executable, *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    groups = {}
    for line in proc.stdout.splitlines():
        m = re.fullmatch(r"  (tests-[\w-]+): (.*)", line)
        if m:
            cmd = shlex.split(m.group(2))
            assert cmd[1:3] == ["-m", "pytest"], cmd
            groups[m.group(1)] = cmd[3:]
    return groups


class _Collected:
    """A pytest plugin that keeps the ids of the tests a session selected."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.ids = [item.nodeid for item in session.items]


def collected(args: list[str]) -> list[str]:
    """The tests that pytest ARGS selects, by pytest's own collection, in this process (no test
    runs: ``--collect-only``); empty when it selects none (pytest's exit 5)."""
    plugin = _Collected()
    rc = pytest.main([*args, "--collect-only", "-q"], plugins=[plugin])
    assert rc in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED), (
        f"pytest {shlex.join(args)} --collect-only: exit {rc}"
    )
    return plugin.ids


@pytest.mark.parametrize("mode", ["full", "quick"])
def test_every_group_selects_tests(mode, tmp_path):
    """Each group's exact arguments, tier included, collect at least one test (the H200 run's
    groups collected none: their launches were deselected by the default tier); in a full run the
    groups share no test and together hold every ``cuda`` test of their files, so a new one
    cannot be left out of the check."""
    groups = plan_groups("--steps", "tests", *(["--quick"] if mode == "quick" else []))
    assert set(groups) == set(TEST_STEPS)
    selected = {}
    for name, args in groups.items():
        assert args[args.index("--tier") + 1] == "full", (name, args)
        args[args.index("--junitxml") + 1] = str(tmp_path / f"{name}.xml")
        selected[name] = collected(args)
        assert selected[name], f"{name} selects no test: pytest {shlex.join(args)}"
    if mode == "full":
        files = sorted({args[0] for args in groups.values()})
        assert os.path.join(ROOT, "tests", "test_cuda.py") in files, files
        every = collected(
            [*files, "-m", "cuda", "--tier", "full", "-p", "no:cacheprovider", "--rootdir", ROOT]
        )
        ids = [t for name in TEST_STEPS for t in selected[name]]
        assert len(ids) == len(set(ids)), "a test is in two groups"
        assert sorted(ids) == sorted(every)


# --- no build variable is ever assigned ---------------------------------------------------------
#: Names a build environment exports (GNU make's implicit variables, CMake's and Horovod's
#: inputs): assigning one in the script would change every build under it (issue 26: CC=90).
BUILD_NAMES = (
    "CC CXX CPP FC F77 LD AR AS NM RANLIB STRIP OBJCOPY CFLAGS CXXFLAGS CPPFLAGS LDFLAGS LDLIBS "
    "FFLAGS ARFLAGS CUDACXX CUDAFLAGS CUDA_HOME NVCC CMAKE_ARGS MAKEFLAGS PYTHONPATH"
).split()


def assigned_names(script: str) -> set[str]:
    """Every shell variable name the script assigns, exports, declares, reads or loops over."""
    code = "\n".join(
        line.split(" #")[0] for line in script.splitlines() if not line.lstrip().startswith("#")
    )
    names = set(re.findall(r"(?:^|[\s;(&|])([A-Za-z_][A-Za-z0-9_]*)(?:\[[^\]]*\])?\+?=", code))
    for verb in (
        "export",
        "local",
        "declare -A",
        "declare",
        "readonly",
        "read -r",
        "read",
        "unset",
    ):
        for m in re.finditer(rf"\b{verb}\s+((?:-\w+\s+)*)([A-Za-z_][A-Za-z0-9_ ]*)", code):
            names.update(m.group(2).split())
    names.update(re.findall(r"\bfor\s+([A-Za-z_][A-Za-z0-9_]*)\s+in\b", code))
    return names


def test_the_script_assigns_no_build_variable():
    script = open(SCRIPT).read()
    names = assigned_names(script)
    assert {"GPU_CAPS", "BUDGET", "STEPS"} <= names, "the parser of this test finds nothing"
    # PYTHONPATH is the one the check extends on purpose (the repo first), never replaces.
    clash = (names & set(BUILD_NAMES)) - {"PYTHONPATH"}
    assert not clash, f"gpu_check.sh assigns {sorted(clash)}: rename (e.g. GPU_CAPS)"
    assert 'export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"' in script
    # The parser of this test catches the bug of issue 26.
    assert "CC" in assigned_names('  CC=$("$PY" -c "print(90)")\n')


@pytest.mark.skipif(
    shutil.which("shellcheck") is None
    and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "shellcheck")),
    reason="shellcheck is not installed (scripts/setup_env.sh installs it into the venv)",
)
def test_shellcheck_is_clean():
    exe = shutil.which("shellcheck") or os.path.join(os.path.dirname(sys.executable), "shellcheck")
    proc = subprocess.run([exe, SCRIPT], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert subprocess.run(["bash", "-n", SCRIPT]).returncode == 0


# --- the summary's parser on a recorded check ---------------------------------------------------
def load_summary_module():
    spec = importlib.util.spec_from_file_location(
        "gpu_summary", os.path.join(ROOT, "scripts", "gpu_summary.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_summary_of_a_recorded_check(tmp_path):
    """tests/data/gpu_check: the previous H100 run's benchmark figures (issue 26) in the
    benchmark's output format, a pytest log killed before its summary and one that finished."""
    summary = load_summary_module()
    out = tmp_path / "out"
    shutil.copytree(RECORDED, out)
    got = summary.collect(str(out))
    bench = {r["optimizer"]: r for r in got["bench"]["optimizers"]}
    assert bench["plain torch"]["ms"] == "34.89"
    assert bench["Local SGD + SlowMo"]["ms"] == "35.08"
    assert bench["AR-SGD + SlowMo"]["ms"] == "35.16"
    assert bench["Horovod DistributedOptimizer"]["ms"].startswith("not run")
    assert {r["measure"] for r in got["bench"]["targets"]} >= {"SlowMo state / parameter bytes"}
    rows = {r["step"]: r for r in got["steps"]}
    assert rows["tests-threads"]["tests"] == {
        "passed": 12,
        "failed": 1,
        "skipped": 2,
        "deselected": 44,
    }
    assert rows["tests-staged"]["tests"] == {}  # killed: no pytest summary line
    text = summary.render(got)
    assert "NVIDIA H100 80GB" in text and "driver 580" in text and "torch 2.11.0+cu130" in text
    staged = "| tests-staged | TIMED OUT after 150s | 150 (150) | no pytest summary (timed out) |"
    assert staged in text
    assert "| AR-SGD + SlowMo | 35.16 | 1.008x |" in text
    assert "| sparse | cpu | n/a:" in text
    # The command writes both files and prints the table.
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "gpu_summary.py"), str(out)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0 and text in proc.stdout
    assert json.loads((out / "summary.json").read_text())["facts"]["driver"].startswith("580")
    assert (
        subprocess.run(
            [sys.executable, os.path.join(ROOT, "scripts", "gpu_summary.py"), "/nonexistent"],
            capture_output=True,
        ).returncode
        == 2
    )


@pytest.mark.parametrize(
    "line, counts",
    [
        ("===== 5 passed in 1.20s =====", {"passed": 5}),
        (
            "== 1 failed, 2 passed, 3 skipped, 1 error in 9.00s ==",
            {"failed": 1, "passed": 2, "skipped": 3, "error": 1},
        ),
        ("=== 2 errors in 0.1s ===", {"error": 2}),
        ("=== 62 deselected in 0.50s ===", {"deselected": 62}),
        ("=== 3 passed, 59 deselected in 9.00s ===", {"passed": 3, "deselected": 59}),
        ("tests/test_cuda.py::test_x PASSED", {}),
    ],
    ids=["passed", "mixed", "errors", "deselected", "passed-deselected", "no-summary"],
)
def test_pytest_counts(line, counts):
    assert load_summary_module().pytest_counts(f"collected 9 items\n{line}\n") == counts
