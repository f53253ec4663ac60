"""A sandbox for scripts/install_horovod.sh: fake tools, a fake torch and Horovod, and a
source tarball, so the script runs in seconds without a compiler (tests/test_install_horovod.py,
tests/test_gpu_check.py)."""

import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "install_horovod.sh")
PY_TAG = f"cp{sys.version_info[0]}{sys.version_info[1]}"
TOOLS = [
    "bash",
    "env",
    "sed",
    "grep",
    "tar",
    "gzip",
    "readlink",
    "mktemp",
    "nproc",
    "cut",
    "head",
    "ls",
    "cp",
    "rm",
    "mkdir",
    "cat",
    "ln",
    "uname",
    "dirname",
    "sort",
    "tr",
    "timeout",
    "date",
    "tail",
]

# The fake interpreter: a shell script (cheap to start) that hands `-m pip`, `-m pytest` and the
# GPU benchmark to FAKE_TOOLS and runs everything else with the real Python.
FAKE_PYTHON = """\
#!/bin/sh
case "$1 $2" in "-m pip"|"-m pytest") exec {python} {tools} "$@" ;; esac
case "$1" in *gpu_resnet50.py) exec {python} {tools} "$@" ;; esac
exec {python} "$@"
"""

FAKE_TOOLS = """\
import json, os, shutil, sys, time
args = sys.argv[1:]
log = os.environ["FAKE_LOG"]
kind = None
if args[:2] == ["-m", "pytest"]:
    kind = "pytest"
elif args and args[0].endswith("gpu_resnet50.py"):
    kind = "bench"
if kind:
    keep = ("PYTHONUNBUFFERED", "PYTHONPATH", "HVD_SLOWMO_STAGED_HOROVOD",
            "HOROVOD_BUILD_CUDA_CC_LIST")
    with open(os.path.join(log, "runs.jsonl"), "a") as f:
        f.write(json.dumps({{"kind": kind, "args": args, "cwd": os.getcwd(),
                            "env": {{k: os.environ.get(k) for k in keep}}}}) + "\\n")
    print(f"fake {{kind}} ran")
    time.sleep(float(os.environ.get(f"FAKE_SLEEP_{{kind}}", "0")))
    sys.exit(int(os.environ.get(f"FAKE_RC_{{kind}}", "0")))
with open(os.path.join(log, "pip.jsonl"), "a") as f:
    f.write(json.dumps(args[2:]) + "\\n")
cmd, rest = args[2], args[3:]
if cmd == "wheel":
    out, src = rest[rest.index("-w") + 1], rest[-1]
    shutil.copytree(src, os.path.join(log, "built_src"), dirs_exist_ok=True)
    with open(os.path.join(log, "wheel_env.json"), "w") as f:
        json.dump(dict(os.environ), f)
    if os.environ.get("FAKE_WHEEL_RC", "0") != "0":
        sys.exit("fake pip wheel: build failed")
    open(os.path.join(out, "horovod-0.28.1-{tag}-{tag}-linux_x86_64.whl"), "w").close()
elif cmd == "install" and any(a.endswith(".whl") for a in rest):
    dest = rest[rest.index("--target") + 1] if "--target" in rest else os.environ["FAKE_SITE"]
    pkg = os.path.join(dest, "horovod")
    shutil.rmtree(pkg, ignore_errors=True)
    os.makedirs(os.path.join(pkg, "torch"))
    with open(os.path.join(pkg, "__init__.py"), "w") as f:
        f.write("__version__ = '0.28.1'\\n")
    with open(os.path.join(pkg, "torch", "__init__.py"), "w") as f:
        f.write({hvd_torch!r})
"""

FAKE_HVD_TORCH = """\
import os
# What this fake build has: FAKE_HVD_BUILT, or FAKE_HVD_BUILT_STAGED for gpu_check's staged copy.
_var = "FAKE_HVD_BUILT_STAGED" if "staged-horovod" in __file__ else "FAKE_HVD_BUILT"
_built = set(os.environ.get(_var, "").split(","))
def gloo_built(): return "gloo" in _built
def mpi_built(): return "mpi" in _built
def nccl_built(): return 23007 if "nccl" in _built else 0
def cuda_built(): return "cuda" in _built
"""

FAKE_TORCH = """\
import os
from types import SimpleNamespace
__version__ = os.environ.get("FAKE_TORCH_VERSION", "2.11.0+cu130")
class version:
    cuda = os.environ.get("FAKE_TORCH_CUDA", "13.0") or None
class cuda:  # FAKE_CUDA_CC="9.0": one GPU of that compute capability; unset: none
    cc = os.environ.get("FAKE_CUDA_CC", "")
    is_available = staticmethod(lambda: bool(cuda.cc))
    device_count = staticmethod(lambda: 1 if cuda.cc else 0)
    get_device_capability = staticmethod(lambda i: tuple(int(v) for v in cuda.cc.split(".")))
    get_device_properties = staticmethod(lambda i: SimpleNamespace(
        name="Fake GPU", total_memory=2**37, major=cuda.get_device_capability(i)[0],
        minor=cuda.get_device_capability(i)[1]))
"""

SPAN_HEADER = "third_party/flatbuffers/include/flatbuffers/stl_emulation.h"
# The lines of Horovod 0.28.1's sources that the script patches (copied from the real tarball).
HOROVOD_FILES = {
    "setup.py": "from setuptools import setup\n",
    "horovod/__init__.py": "__version__ = '0.28.1'\n",
    "CMakeLists.txt": "cmake_minimum_required(VERSION 3.13)\nset(CMAKE_CXX_STANDARD 14)\n",
    "horovod/torch/CMakeLists.txt": "set(CMAKE_CXX_STANDARD 14)\n",
    "horovod/common/ops/cuda/CMakeLists.txt": "set(CMAKE_CUDA_STANDARD 11)\n",
    "cmake/Modules/FindPytorch.cmake": (
        'execute_process(COMMAND ${PY_EXE} -c "import torch; '
        "from torch.utils.cpp_extension import CUDA_HOME; "
        "print(True if ((torch.version.cuda is not None) and (CUDA_HOME is not None)) "
        'else False)"\n'
    ),
    # flatbuffers' span (lines 546-550 and 627-628 of Horovod 0.28.1's bundled copy): GCC 14
    # rejects the assignment to the const count_.
    SPAN_HEADER: (
        "  FLATBUFFERS_CONSTEXPR_CPP14 span &operator=(const span &other)\n"
        "      FLATBUFFERS_NOEXCEPT {\n"
        "    data_ = other.data_;\n"
        "    count_ = other.count_;\n"
        "  }\n"
        "\n"
        "  pointer const data_;\n"
        "  const size_type count_;\n"
    ),
}


def write_exe(path, text):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)


def make_source_tarball(path, files=None, top="horovod-0.28.1"):
    """A .tar.gz of a stand-in Horovod source tree holding the lines the script patches."""
    staging = path + ".d"
    for rel, text in (files or HOROVOD_FILES).items():
        os.makedirs(os.path.dirname(os.path.join(staging, top, rel)), exist_ok=True)
        with open(os.path.join(staging, top, rel), "w") as f:
            f.write(text)
    with tarfile.open(path, "w:gz") as tar:
        tar.add(os.path.join(staging, top), arcname=top)
    return path


class Sandbox:
    """A temporary world for one run of the script: shims, fake packages, log, wheelhouse."""

    def __init__(self, tmp_path):
        self.tmp = tmp_path
        self.bin = tmp_path / "bin"
        self.tools = tmp_path / "tools"
        self.log = tmp_path / "log"
        self.site = tmp_path / "site"  # fake torch, nvidia.nccl, and the "installed" horovod
        self.wheelhouse = tmp_path / "wheelhouse"
        self.cuda = tmp_path / "cuda"
        for d in (
            self.bin,
            self.tools,
            self.log,
            self.site / "torch",
            self.cuda / "bin",
            self.cuda / "include",
            self.site / "nvidia" / "nccl" / "include",
            self.site / "nvidia" / "nccl" / "lib",
        ):
            d.mkdir(parents=True, exist_ok=True)
        for tool in TOOLS:
            found = shutil.which(tool)
            assert found, f"{tool} is needed to run install_horovod.sh"
            os.symlink(found, self.tools / tool)
        write_exe(
            self.bin / "python",
            FAKE_PYTHON.format(python=sys.executable, tools=self.bin / "fake_tools.py"),
        )
        (self.bin / "fake_tools.py").write_text(
            FAKE_TOOLS.format(tag=PY_TAG, hvd_torch=FAKE_HVD_TORCH)
        )
        (self.site / "torch" / "__init__.py").write_text(FAKE_TORCH)
        (self.site / "nvidia" / "__init__.py").write_text("")
        (self.site / "nvidia" / "nccl" / "__init__.py").write_text("")
        (self.site / "nvidia" / "nccl" / "include" / "nccl.h").write_text("")
        (self.site / "nvidia" / "nccl" / "lib" / "libnccl.so.2").write_text("")
        (self.cuda / "include" / "cuda_runtime.h").write_text("")
        self.set_tool("nvcc", "13.0")
        self.set_tool("cmake", "4.1.2")
        self.set_tool("c++", "13.3.0")

    def set_tool(self, name, version):
        """Install a shim ``name`` that reports ``version`` (None removes it)."""
        path = self.cuda / "bin" / "nvcc" if name == "nvcc" else self.bin / name
        if version is None:
            path.unlink(missing_ok=True)
            return
        out = {
            "cmake": f"cmake version {version}",
            "nvcc": f"Cuda compilation tools, release {version}, V{version}.88",
            "c++": f"c++ (Ubuntu {version}) {version}",
            "mpicc": "gcc (Ubuntu 13.3.0) 13.3.0",
        }[name]
        dump = (
            f'[ "$1" = -dumpfullversion ] && {{ echo {version}; exit 0; }}\n'
            if name == "c++"
            else ""
        )
        write_exe(path, f"#!/bin/sh\n{dump}echo '{out}'\n")

    def block_module(self, name):
        """Make ``import name`` fail, as if the package were not installed."""
        (self.site / name).mkdir()
        (self.site / name / "__init__.py").write_text(
            f"raise ImportError('{name} is blocked by the test')\n"
        )

    def run(self, *args, env=None, timeout=120):
        full_env = {
            "PATH": f"{self.bin}:{self.tools}",
            "HOME": str(self.tmp),
            "TMPDIR": str(self.tmp),
            "PYTHONPATH": str(self.site),
            "FAKE_LOG": str(self.log),
            "FAKE_SITE": str(self.site),
            "FAKE_HVD_BUILT": "gloo,nccl,cuda",
            "CUDA_HOME": str(self.cuda),
            "HVD_SLOWMO_WHEELHOUSE": str(self.wheelhouse),
            **(env or {}),
        }
        return subprocess.run(
            ["bash", SCRIPT, "--python", str(self.bin / "python"), *args],
            env=full_env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def key(self, *args, env=None):
        proc = self.run("--print-key", *args, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.strip()

    def pip_calls(self):
        path = self.log / "pip.jsonl"
        return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []
