#!/usr/bin/env bash
# Build and install Horovod 0.28.1 for the PyTorch in a Python environment.
#
# Horovod's last release compiles with C++14, but PyTorch >= 2.1 headers need C++17 and torch
# 2.14 headers C++20, so `pip install horovod` fails. This script builds the source distribution
# with the language standards raised (GCC 13+'s missing transitive includes forced in, and the
# bundled flatbuffers fixed for GCC 14), caches the wheel keyed by everything that makes it
# binary-incompatible, and refuses to finish unless the installed Horovod imports its PyTorch
# plugin with what the flavour promises. Works offline from a local source tarball and wheel
# directory. Used by the quickstart, CI, the Docker images and the GPU check.
#
# Usage: scripts/install_horovod.sh [options]
#   --gpu auto|yes|no|staged  auto (default): NCCL when torch is a CUDA build and a CUDA toolkit
#                      (bin/nvcc) is found, else CPU only; yes: NCCL or fail; no: CPU only;
#                      staged: CUDA without GPU collectives (CUDA tensors go through host memory and
#                      Gloo/MPI, so several ranks can share one GPU; slow)
#   --mpi auto|yes|no  auto (default): MPI when mpicc is on PATH; yes: MPI or fail; no: Gloo only
#   --python PY        the Python environment to build for (default $PYTHON or python)
#   --source PATH      Horovod source: a horovod-VERSION.tar.gz or an unpacked tree (env
#                      HOROVOD_SOURCE; default: horovod-VERSION.tar.gz in --find-links, else PyPI)
#   --find-links DIR   local wheels (and the source tarball) for pip (env HVD_SLOWMO_FIND_LINKS)
#   --offline          never contact a package index (env HVD_SLOWMO_OFFLINE=1)
#   --wheelhouse DIR   wheel cache, one folder per key (env HVD_SLOWMO_WHEELHOUSE, default
#                      ~/.cache/hvd_slowmo/wheels); a carried cache installs without building
#   --target DIR       install into DIR (pip --target; put DIR on PYTHONPATH), not the environment
#   --force            rebuild even when a cached wheel exists
#   --print-key        print the wheel cache key and exit (builds nothing)
#   --download DIR     fetch what an offline machine needs into DIR and exit: the source tarball
#                      and the wheels of Horovod's Python dependencies (--python-version X.Y: for
#                      another Python)
# Environment: HOROVOD_VERSION (default 0.28.1), CUDA_HOME (toolkit), HOROVOD_BUILD_CUDA_CC_LIST
#   (default 80,90: A100, H100/H200; CUDA 13 has no sm_70), MAKEFLAGS (default -j$(nproc)), CXX,
#   CMAKE_POLICY_VERSION_MINIMUM (default 3.5 under CMake 4).
set -euo pipefail

GPU=auto
MPI=auto
PY=${PYTHON:-python}
WHEELHOUSE=${HVD_SLOWMO_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_slowmo/wheels}
SOURCE=${HOROVOD_SOURCE:-}
FIND_LINKS=${HVD_SLOWMO_FIND_LINKS:-}
OFFLINE=${HVD_SLOWMO_OFFLINE:-0}
TARGET=""
FORCE=0
ACTION=install
DOWNLOAD_DIR=""
DOWNLOAD_PY=""
HVD_VERSION=${HOROVOD_VERSION:-0.28.1}
CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-80,90}
# Horovod's own Python dependencies; setup.py needs them at build time too (setup_requires would
# otherwise fetch them with easy_install, which fails offline). Module name=distribution name.
DEPS="cloudpickle=cloudpickle psutil=psutil yaml=pyyaml packaging=packaging cffi=cffi"
DEPS="$DEPS pycparser=pycparser"

die() { echo "install_horovod: error: $*" >&2; exit 1; }
log() { echo "install_horovod: $*" >&2; }
value() {
  [ $# -ge 2 ] && [ -n "$2" ] && [ "${2#--}" = "$2" ] || die "$1 needs a value (see --help)"
}

while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) value "$@"; GPU=$2; shift 2 ;;
    --mpi) value "$@"; MPI=$2; shift 2 ;;
    --python) value "$@"; PY=$2; shift 2 ;;
    --source) value "$@"; SOURCE=$2; shift 2 ;;
    --find-links) value "$@"; FIND_LINKS=$2; shift 2 ;;
    --offline) OFFLINE=1; shift ;;
    --wheelhouse) value "$@"; WHEELHOUSE=$2; shift 2 ;;
    --target) value "$@"; TARGET=$2; shift 2 ;;
    --force) FORCE=1; shift ;;
    --print-key) ACTION=key; shift ;;
    --download) value "$@"; ACTION=download; DOWNLOAD_DIR=$2; shift 2 ;;
    --python-version) value "$@"; DOWNLOAD_PY=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
case "$GPU" in
  auto|yes|no|staged) ;;
  *) die "--gpu must be auto, yes, no or staged, not '$GPU'" ;;
esac
case "$MPI" in auto|yes|no) ;; *) die "--mpi must be auto, yes or no, not '$MPI'" ;; esac
case "$OFFLINE" in 0|1) ;; *) die "HVD_SLOWMO_OFFLINE must be 0 or 1, not '$OFFLINE'" ;; esac
[[ "$CC_LIST" =~ ^[0-9]+(,[0-9]+)*$ ]] \
  || die "HOROVOD_BUILD_CUDA_CC_LIST must be compute capabilities like 80,90, not '$CC_LIST'"
[ -z "$FIND_LINKS" ] || [ -d "$FIND_LINKS" ] || die "--find-links: '$FIND_LINKS' is not a directory"
if [ -n "$DOWNLOAD_PY" ]; then
  [ "$ACTION" = download ] || die "--python-version only goes with --download"
  [[ "$DOWNLOAD_PY" =~ ^3\.[0-9]+$ ]] \
    || die "--python-version must look like 3.12, not '$DOWNLOAD_PY'"
fi
# Every pip call: no index offline, local wheels first when given.
PIP_SOURCES=()
[ "$OFFLINE" = 0 ] || PIP_SOURCES+=(--no-index)
[ -z "$FIND_LINKS" ] || PIP_SOURCES+=(--find-links "$FIND_LINKS")

dep_names() { local d; for d in $DEPS; do echo "${d#*=}"; done; }

if [ "$ACTION" = download ]; then
  [ "$OFFLINE" = 0 ] || die "--download fetches from PyPI: it cannot run with --offline"
  mkdir -p "$DOWNLOAD_DIR"
  "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==${HVD_VERSION}" \
    -d "$DOWNLOAD_DIR" || die "could not download the horovod==${HVD_VERSION} source distribution"
  PLATFORM=()
  if [ -n "$DOWNLOAD_PY" ]; then
    # Wheels for another interpreter: pip then needs the platform spelled out.
    PLATFORM=(--python-version "$DOWNLOAD_PY" --implementation cp
              --platform "manylinux2014_$(uname -m)" --platform "manylinux_2_28_$(uname -m)")
  fi
  # shellcheck disable=SC2046  # one distribution name per word
  "$PY" -m pip download -q --only-binary :all: "${PLATFORM[@]}" -d "$DOWNLOAD_DIR" $(dep_names) \
    || die "could not download the wheels of Horovod's dependencies"
  log "offline bundle in $DOWNLOAD_DIR: use --find-links $DOWNLOAD_DIR --offline"
  ls -1 "$DOWNLOAD_DIR"
  exit 0
fi

PROBE=$("$PY" -c 'import sys, torch; v = sys.version_info
print(torch.__version__, torch.version.cuda or "none", f"cp{v[0]}{v[1]}")' 2>/dev/null) \
  || die "torch is not importable with $PY; install torch first"
read -r TORCH_VERSION TORCH_CUDA PY_TAG <<<"$PROBE"

case "$MPI" in
  auto) if command -v mpicc >/dev/null; then MPI=yes; else MPI=no; fi ;;
  yes) command -v mpicc >/dev/null || die "--mpi yes, but mpicc is not on PATH: install OpenMPI" \
         "(Debian/Ubuntu: apt-get install libopenmpi-dev openmpi-bin), or use --mpi no" \
         "(Gloo only)" ;;
esac

# The compiler CMake will pick; its major version is part of the key (a GCC 13 wheel needs GCC
# 13's libstdc++).
CXX_BIN=${CXX:-c++}
command -v "$CXX_BIN" >/dev/null || die "no C++ compiler '$CXX_BIN' found: install g++ (or set CXX)"
CXX_MAJOR=$("$CXX_BIN" -dumpfullversion -dumpversion 2>/dev/null | head -n 1 | cut -d. -f1)
[[ "$CXX_MAJOR" =~ ^[0-9]+$ ]] || die "could not read the version of the C++ compiler '$CXX_BIN'"
CXX_ID=gcc
if "$CXX_BIN" --version 2>/dev/null | head -n 1 | grep -qi clang; then CXX_ID=clang; fi

# Find a real CUDA toolkit: torch guesses CUDA_HOME from `which nvcc`, which can be a wrapper
# outside the toolkit (then CMake fails with "Could NOT find CUDAToolkit"), so insist on the
# toolkit's own layout.
find_cuda_home() {
  local cand
  for cand in "${CUDA_HOME:-}" "${HOROVOD_CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-*; do
    [ -n "$cand" ] || continue
    cand=$(readlink -f "$cand" 2>/dev/null) || continue
    if [ -x "$cand/bin/nvcc" ] && [ -f "$cand/include/cuda_runtime.h" ]; then
      echo "$cand"
      return 0
    fi
  done
  return 1
}

GPU_FLAVOUR=cpu
CUDA_TK=""
if [ "$GPU" != no ]; then
  if [ "$TORCH_CUDA" != none ] && CUDA_TK=$(find_cuda_home); then
    if [ "$GPU" = staged ]; then GPU_FLAVOUR=staged; else GPU_FLAVOUR=nccl; fi
  elif [ "$GPU" != auto ]; then
    die "--gpu $GPU, but torch ${TORCH_VERSION} is not a CUDA build or no CUDA toolkit" \
        "(bin/nvcc + include/cuda_runtime.h) was found; set CUDA_HOME"
  fi
fi
FLAVOUR="${GPU_FLAVOUR}-$([ "$MPI" = yes ] && echo mpi || echo nompi)"

# What makes a wheel binary-incompatible: Horovod, torch (and its CUDA), Python, flavour with MPI,
# compiler, and for GPU flavours the toolkit and the architectures compiled for.
KEY="horovod-${HVD_VERSION}_torch-${TORCH_VERSION}_cuda-${TORCH_CUDA}_${PY_TAG}_${FLAVOUR}"
KEY="${KEY}_${CXX_ID}${CXX_MAJOR}"
if [ -n "$CUDA_TK" ]; then
  TK_VERSION=$("$CUDA_TK/bin/nvcc" --version | sed -n 's/.*release \([0-9][0-9.]*\).*/\1/p' \
               | head -n 1)
  [ -n "$TK_VERSION" ] || die "could not read the CUDA version from $CUDA_TK/bin/nvcc --version"
  KEY="${KEY}_nvcc-${TK_VERSION}_sm${CC_LIST//,/-}"
fi
if [ "$ACTION" = key ]; then echo "$KEY"; exit 0; fi
CACHE_DIR="$WHEELHOUSE/$KEY"
log "torch ${TORCH_VERSION}, flavour ${FLAVOUR}${CUDA_TK:+ (CUDA toolkit $CUDA_TK)}"

# With --target, the installed Horovod and its dependencies live in TARGET.
run_py() {
  if [ -n "$TARGET" ]; then PYTHONPATH="$TARGET${PYTHONPATH:+:$PYTHONPATH}" "$PY" "$@"
  else "$PY" "$@"; fi
}
PIP_INSTALL=(-m pip install -q "${PIP_SOURCES[@]}")
[ -z "$TARGET" ] || PIP_INSTALL+=(--target "$TARGET" --upgrade)

check_build() {
  # Fails unless Horovod's PyTorch plugin imports and the build has what the flavour promises.
  run_py - "$GPU_FLAVOUR" "$MPI" <<'PYEOF'
import sys
gpu, mpi = sys.argv[1], sys.argv[2]
import horovod
import horovod.torch as hvd  # raises if the plugin was skipped or built against another torch
built = {"gloo": hvd.gloo_built(), "mpi": hvd.mpi_built(), "nccl": hvd.nccl_built() > 0,
         "cuda": hvd.cuda_built()}
want = {"gloo": True, "mpi": mpi == "yes", "nccl": gpu == "nccl", "cuda": gpu != "cpu"}
wrong = [f"{k} {'missing' if want[k] else 'present'}" for k in want if bool(built[k]) != want[k]]
if wrong:
    sys.exit(f"horovod {horovod.__version__} does not match the flavour ({gpu}, mpi {mpi}): "
             + ", ".join(wrong))
print(f"horovod {horovod.__version__}: torch plugin OK, " + ", ".join(k for k in built if built[k]))
PYEOF
}

installed_key() {
  # With --target only TARGET counts (the environment may hold another Horovod).
  local dir
  if [ -n "$TARGET" ]; then
    dir=$TARGET/horovod
  else
    dir=$("$PY" -c 'import horovod, os; print(os.path.dirname(horovod.__file__))' 2>/dev/null) \
      || return 0
  fi
  cat "$dir/.hvd_slowmo_key" 2>/dev/null || true
}

if [ "$FORCE" = 0 ] && [ "$(installed_key)" = "$KEY" ] && check_build >/dev/null 2>&1; then
  log "already installed ($KEY)"; exit 0
fi

install_missing_deps() {
  # Only what is not importable yet: nothing to fetch when the environment has it all (offline).
  local out missing
  # shellcheck disable=SC2086  # one module=distribution pair per word
  out=$(run_py - $DEPS <<'PYEOF'
import importlib, sys
missing = []
for pair in sys.argv[1:]:
    module, dist = pair.split("=")
    try:
        importlib.import_module(module)
    except ImportError:
        missing.append(dist)
print(" ".join(missing))
PYEOF
) || die "could not check Horovod's dependencies with $PY"
  read -r -a missing <<<"$out"
  [ ${#missing[@]} -eq 0 ] && return 0
  log "installing Horovod's dependencies: ${missing[*]}"
  "$PY" "${PIP_INSTALL[@]}" "${missing[@]}" \
    || die "could not install ${missing[*]}${FIND_LINKS:+ from $FIND_LINKS};" \
           "offline, put their wheels in --find-links (see --download)"
}

find_source() {
  # The source to build: --source, else the tarball in --find-links, else PyPI (not offline).
  if [ -n "$SOURCE" ]; then
    [ -e "$SOURCE" ] || die "--source: '$SOURCE' does not exist"
    echo "$SOURCE"
  elif [ -n "$FIND_LINKS" ] && [ -f "$FIND_LINKS/horovod-${HVD_VERSION}.tar.gz" ]; then
    echo "$FIND_LINKS/horovod-${HVD_VERSION}.tar.gz"
  elif [ "$OFFLINE" = 1 ]; then
    die "offline, with no cached wheel for $KEY in $WHEELHOUSE and no Horovod source: pass" \
        "--source horovod-${HVD_VERSION}.tar.gz (or put it in --find-links DIR; see --download)"
  else
    "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==${HVD_VERSION}" -d "$WORK" >&2 \
      || die "could not download the horovod==${HVD_VERSION} source distribution" \
             "(no internet? pass --source)"
    echo "$WORK/horovod-${HVD_VERSION}.tar.gz"
  fi
}

# cmake_check: CMake >= 3.13 (Horovod's minimum). CMake 4 dropped compatibility with
# cmake_minimum_required(VERSION < 3.5), which Horovod's bundled Gloo declares: the policy minimum
# makes it configure anyway.
CMAKE_MAJOR=0
cmake_check() {
  local line ver
  command -v cmake >/dev/null \
    || die "cmake not found: install CMake >= 3.13 (apt-get install cmake, or pip install cmake)"
  line=$(cmake --version | head -n 1)
  ver=$(sed -n 's/.*version \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p' <<<"$line")
  [ -n "$ver" ] || die "could not read the CMake version from '$line'"
  CMAKE_MAJOR=${ver%%.*}
  local minor=${ver#*.}
  if [ "$CMAKE_MAJOR" -lt 3 ] || { [ "$CMAKE_MAJOR" -eq 3 ] && [ "$minor" -lt 13 ]; }; then
    die "$line is too old: Horovod needs CMake >= 3.13"
  fi
  if [ "$CMAKE_MAJOR" -ge 4 ]; then
    export CMAKE_POLICY_VERSION_MINIMUM=${CMAKE_POLICY_VERSION_MINIMUM:-3.5}
    log "$line: building with CMAKE_POLICY_VERSION_MINIMUM=$CMAKE_POLICY_VERSION_MINIMUM" \
        "(Horovod's Gloo predates CMake 4)"
  fi
}

# The cached wheel of this key, if any.
cached_wheel() {
  local w
  for w in "$CACHE_DIR"/horovod-*.whl; do [ -f "$w" ] && echo "$w"; return 0; done
}

install_missing_deps
WHEEL=$(cached_wheel)
if [ "$FORCE" = 1 ] || [ -z "$WHEEL" ]; then
  cmake_check
  run_py -c 'import setuptools' 2>/dev/null \
    || die "setuptools is not importable with $PY: Horovod is built without build isolation" \
           "(pip install setuptools)"
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  SRC_PATH=$(find_source)
  log "building $KEY from $SRC_PATH (several minutes)"
  SRC="$WORK/src"
  mkdir -p "$SRC"
  if [ -d "$SRC_PATH" ]; then
    cp -a "$SRC_PATH/." "$SRC/"
  else
    tar -xzf "$SRC_PATH" -C "$SRC" --strip-components=1 \
      || die "--source: '$SRC_PATH' is not a readable .tar.gz"
  fi
  [ -f "$SRC/setup.py" ] && [ -f "$SRC/CMakeLists.txt" ] \
    || die "'$SRC_PATH' is not a Horovod source tree (no setup.py + CMakeLists.txt)"
  SRC_VERSION=$(sed -n "s/^__version__ = ['\"]\(.*\)['\"]/\1/p" "$SRC/horovod/__init__.py" \
                2>/dev/null || true)
  [ "$SRC_VERSION" = "$HVD_VERSION" ] \
    || die "'$SRC_PATH' is Horovod ${SRC_VERSION:-of unknown version}, not $HVD_VERSION" \
           "(set HOROVOD_VERSION to build it)"

  # patch FILE OLD NEW: a sed that must change something, so a new Horovod fails here loudly.
  patch() {
    grep -qF "$2" "$SRC/$1" \
      || die "patch target '$2' not found in $1 (Horovod ${HVD_VERSION} unsupported?)"
    sed -i "s/$(printf '%s' "$2" | sed 's/[][\.*^$/]/\\&/g')/$3/" "$SRC/$1"
  }
  patch CMakeLists.txt 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)'
  # torch >= 2.14 headers use <compare> (std::strong_ordering): C++20 for the torch plugin.
  patch horovod/torch/CMakeLists.txt 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 20)'
  patch horovod/common/ops/cuda/CMakeLists.txt \
    'set(CMAKE_CUDA_STANDARD 11)' 'set(CMAKE_CUDA_STANDARD 17)'
  # GCC 13's libstdc++ no longer includes <string> and <cstdint> transitively, and Horovod's headers
  # relied on it (group_table.h: "'string' in namespace 'std' does not name a type"): force both
  # into every C++ file. Harmless with older compilers.
  export CXXFLAGS="-include cstdint -include string${CXXFLAGS:+ $CXXFLAGS}"
  # GCC 14 rejects the flatbuffers 2.0.0 that Horovod bundles ("assignment of read-only member
  # 'flatbuffers::span<T, Extent>::count_'"): span's never-called operator= assigns to
  # `const size_type count_`, and GCC 14 now checks such non-dependent expressions in templates
  # that are never instantiated (-fpermissive does not cover it). Upstream flatbuffers dropped the
  # const (google/flatbuffers#7227, 2022); do the same. The class layout is unchanged, so older
  # compilers build the same code; a tree that already has the fix is left as it is.
  SPAN_HEADER=third_party/flatbuffers/include/flatbuffers/stl_emulation.h
  grep -q '^  size_type count_;$' "$SRC/$SPAN_HEADER" 2>/dev/null \
    || patch "$SPAN_HEADER" '  const size_type count_;' '  size_type count_;'

  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
  export HOROVOD_WITH_GLOO=1
  if [ "$MPI" = yes ]; then
    export HOROVOD_WITH_MPI=1; unset HOROVOD_WITHOUT_MPI
  else
    export HOROVOD_WITHOUT_MPI=1; unset HOROVOD_WITH_MPI
  fi
  export MAKEFLAGS=${MAKEFLAGS:--j$(nproc)}
  unset HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_BROADCAST HOROVOD_GPU_ALLGATHER \
        HOROVOD_GPU_ALLTOALL HOROVOD_GPU_REDUCESCATTER
  if [ "$GPU_FLAVOUR" = cpu ]; then
    # A CUDA build of torch makes Horovod's CMake add CUDA whenever torch can guess a CUDA_HOME:
    # the CPU flavour tells it plainly that torch has no CUDA.
    patch cmake/Modules/FindPytorch.cmake \
      'print(True if ((torch.version.cuda is not None) and (CUDA_HOME is not None)) else False)' \
      'print(False)'
    export HOROVOD_WITHOUT_GPU=1
  else
    # Both GPU flavours compile Horovod's CUDA parts (the torch plugin adds them for a CUDA torch).
    unset HOROVOD_WITHOUT_GPU
    export HOROVOD_CUDA_HOME=$CUDA_TK CUDA_HOME=$CUDA_TK HOROVOD_BUILD_CUDA_CC_LIST=$CC_LIST
  fi
  if [ "$GPU_FLAVOUR" = nccl ]; then
    SITE=$("$PY" -c 'import nvidia.nccl, os
print(os.path.dirname(list(nvidia.nccl.__path__)[0]))' 2>/dev/null || true)
    NCCL_HOME=$WORK/nccl
    if [ -n "$SITE" ] && [ -f "$SITE/nccl/include/nccl.h" ]; then
      # torch's pip NCCL ships only libnccl.so.2; CMake's find_library wants libnccl.so.
      mkdir -p "$NCCL_HOME/lib"
      ln -s "$SITE/nccl/include" "$NCCL_HOME/include"
      for lib in "$SITE"/nccl/lib/libnccl.so*; do
        ln -s "$lib" "$NCCL_HOME/lib/libnccl.so"
        break
      done
    elif [ -f /usr/include/nccl.h ]; then
      NCCL_HOME=/usr
    else
      die "no NCCL found (neither torch's nvidia-nccl package nor /usr/include/nccl.h)"
    fi
    export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED HOROVOD_NCCL_HOME=$NCCL_HOME
  fi
  mkdir -p "$WORK/out"
  if ! "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir "${PIP_SOURCES[@]}" \
       -w "$WORK/out" "$SRC"; then
    hint=""
    if [ "$CMAKE_MAJOR" -ge 4 ]; then
      hint="; it ran CMake 4 with CMAKE_POLICY_VERSION_MINIMUM=$CMAKE_POLICY_VERSION_MINIMUM: if"
      hint="$hint CMake's configure step failed, use CMake 3 (pip install 'cmake<4', or apt-get"
      hint="$hint install cmake)"
    fi
    die "building Horovod failed (see the compiler output above)$hint"
  fi
  mkdir -p "$CACHE_DIR"
  rm -f "$CACHE_DIR"/horovod-*.whl
  cp "$WORK"/out/horovod-*.whl "$CACHE_DIR/"
  echo "$KEY" > "$CACHE_DIR/.key"
  WHEEL=$(cached_wheel)
fi

log "installing $WHEEL${TARGET:+ into $TARGET}"
"$PY" "${PIP_INSTALL[@]}" --force-reinstall --no-deps "$WHEEL" || die "pip could not install $WHEEL"
check_build || die "the installed Horovod is incomplete; rerun with --force"
HVD_DIR=$(run_py -c 'import horovod, os; print(os.path.dirname(horovod.__file__))')
echo "$KEY" > "$HVD_DIR/.hvd_slowmo_key"
