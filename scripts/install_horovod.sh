#!/usr/bin/env bash
# Build and install Horovod 0.28.1 for the PyTorch in the current Python environment.
#
# Horovod's last release compiles with C++14, but PyTorch >= 2.1 headers need C++17 and
# torch 2.14 headers need C++20, so `pip install horovod` fails. This script builds the PyPI
# source distribution with the language standards raised, with PyTorch + Gloo + MPI
# (+ NCCL where a CUDA toolkit is found), caches the wheel keyed by everything that makes it
# binary-incompatible, and refuses to finish unless Horovod reports its PyTorch plugin.
# Used by the quickstart scripts, CI and the Docker images alike.
#
# Usage: scripts/install_horovod.sh [--gpu auto|yes|no] [--python PY] [--wheelhouse DIR] [--force]
#   --gpu auto    NCCL when torch is a CUDA build and a CUDA toolkit (nvcc) is found (default)
#   --gpu yes     NCCL, or fail if it cannot be built
#   --gpu no      CPU only (Gloo + MPI), even with a CUDA build of torch
# Environment: HOROVOD_VERSION (default 0.28.1), CUDA_HOME (toolkit location),
#   HOROVOD_BUILD_CUDA_CC_LIST (default 80,90: A100, H100/H200; CUDA 13 has no sm_70), MAKEFLAGS (default -j$(nproc)).
set -euo pipefail

GPU=auto
PY=${PYTHON:-python}
WHEELHOUSE=${HVD_SLOWMO_WHEELHOUSE:-${XDG_CACHE_HOME:-$HOME/.cache}/hvd_slowmo/wheels}
FORCE=0
HVD_VERSION=${HOROVOD_VERSION:-0.28.1}

die() { echo "install_horovod: error: $*" >&2; exit 1; }
log() { echo "install_horovod: $*" >&2; }

while [ $# -gt 0 ]; do
  case "$1" in
    --gpu) GPU=${2:?--gpu needs auto, yes or no}; shift 2 ;;
    --python) PY=${2:?--python needs a path}; shift 2 ;;
    --wheelhouse) WHEELHOUSE=${2:?--wheelhouse needs a directory}; shift 2 ;;
    --force) FORCE=1; shift ;;
    -h|--help) sed -n '2,18p' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
case "$GPU" in auto|yes|no) ;; *) die "--gpu must be auto, yes or no, not '$GPU'" ;; esac

"$PY" -c 'import torch' 2>/dev/null || die "torch is not importable with $PY; install torch first"
command -v mpicc >/dev/null || die "mpicc not found: install OpenMPI first (Debian: apt-get install libopenmpi-dev openmpi-bin)"
# Debian's CMake 3.x: CMake 4 (PyPI's current wheel) rejects the cmake_minimum_required of Horovod's bundled Gloo.
command -v cmake >/dev/null || die "cmake not found: install it first (Debian: apt-get install cmake)"
case "$(cmake --version | head -n 1)" in
  *" version 3."*) ;;
  *) die "$(cmake --version | head -n 1) is not CMake 3.x, which Horovod 0.28.1's bundled Gloo needs (Debian 12: apt-get install cmake; remove a PyPI cmake from PATH)" ;;
esac

TORCH_VERSION=$("$PY" -c 'import torch; print(torch.__version__)')
TORCH_CUDA=$("$PY" -c 'import torch; print(torch.version.cuda or "")')
PY_TAG=$("$PY" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')

# Find a real CUDA toolkit: torch guesses CUDA_HOME from `which nvcc`, which can be a wrapper
# outside the toolkit (then CMake fails with "Could NOT find CUDAToolkit"), so insist on the
# toolkit's own layout.
find_cuda_home() {
  local cand
  for cand in "${CUDA_HOME:-}" "${HOROVOD_CUDA_HOME:-}" /usr/local/cuda /usr/local/cuda-*; do
    [ -n "$cand" ] || continue
    cand=$(readlink -f "$cand" 2>/dev/null) || continue
    if [ -x "$cand/bin/nvcc" ] && [ -f "$cand/include/cuda_runtime.h" ]; then echo "$cand"; return 0; fi
  done
  return 1
}

FLAVOUR=cpu
CUDA_TK=""
if [ "$GPU" != no ]; then
  if [ -n "$TORCH_CUDA" ] && CUDA_TK=$(find_cuda_home); then
    FLAVOUR=nccl
  elif [ "$GPU" = yes ]; then
    die "--gpu yes, but torch ${TORCH_VERSION} is not a CUDA build or no CUDA toolkit (bin/nvcc + include/cuda_runtime.h) was found; set CUDA_HOME"
  fi
fi
log "torch ${TORCH_VERSION}, flavour ${FLAVOUR}${CUDA_TK:+ (CUDA toolkit $CUDA_TK)}"

# What makes a wheel binary-incompatible: Horovod and torch versions, Python, flavour.
KEY="horovod-${HVD_VERSION}_torch-${TORCH_VERSION}_${PY_TAG}_${FLAVOUR}"
CACHE_DIR="$WHEELHOUSE/$KEY"

check_build() {
  # Fails unless Horovod's PyTorch plugin imports and the build has what the flavour promises.
  "$PY" - "$FLAVOUR" <<'PYEOF'
import sys
flavour = sys.argv[1]
import horovod
import horovod.torch as hvd  # raises if the plugin was skipped or built against another torch
missing = [name for name, ok in [("gloo", hvd.gloo_built()), ("mpi", hvd.mpi_built())] if not ok]
if flavour == "nccl" and not hvd.nccl_built():
    missing.append("nccl")
if missing:
    sys.exit(f"horovod {horovod.__version__} lacks: {', '.join(missing)}")
print(f"horovod {horovod.__version__}: torch plugin OK, gloo, mpi" + (", nccl" if hvd.nccl_built() else ""))
PYEOF
}

if [ "$FORCE" = 0 ] && [ -f "$CACHE_DIR/.key" ] && [ "$(cat "$CACHE_DIR/.key")" = "$KEY" ] \
   && "$PY" -c 'import horovod; assert horovod.__version__ == "'"$HVD_VERSION"'"' 2>/dev/null \
   && [ "$(cat "$("$PY" -c 'import horovod, os; print(os.path.dirname(horovod.__file__))')/.hvd_slowmo_key" 2>/dev/null)" = "$KEY" ] \
   && check_build >/dev/null 2>&1; then
  log "already installed ($KEY)"; exit 0
fi

WHEEL=$(ls "$CACHE_DIR"/horovod-*.whl 2>/dev/null | head -n 1 || true)
if [ "$FORCE" = 1 ] || [ -z "$WHEEL" ]; then
  WORK=$(mktemp -d)
  trap 'rm -rf "$WORK"' EXIT
  log "building $KEY (several minutes)"
  "$PY" -m pip download -q --no-deps --no-binary :all: "horovod==${HVD_VERSION}" -d "$WORK" \
    || die "could not download the horovod==${HVD_VERSION} source distribution"
  tar -xzf "$WORK"/horovod-"${HVD_VERSION}".tar.gz -C "$WORK"
  SRC="$WORK/horovod-${HVD_VERSION}"

  # patch FILE OLD NEW: a sed that must change something, so a new Horovod fails here loudly.
  patch() {
    grep -qF "$2" "$SRC/$1" || die "patch target '$2' not found in $1 (Horovod ${HVD_VERSION} unsupported?)"
    sed -i "s/$(printf '%s' "$2" | sed 's/[][\.*^$/]/\\&/g')/$3/" "$SRC/$1"
  }
  patch CMakeLists.txt 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 17)'
  # torch >= 2.14 headers use <compare> (std::strong_ordering): C++20 for the torch plugin.
  patch horovod/torch/CMakeLists.txt 'set(CMAKE_CXX_STANDARD 14)' 'set(CMAKE_CXX_STANDARD 20)'
  patch horovod/common/ops/cuda/CMakeLists.txt 'set(CMAKE_CUDA_STANDARD 11)' 'set(CMAKE_CUDA_STANDARD 17)'

  export HOROVOD_WITH_PYTORCH=1 HOROVOD_WITHOUT_TENSORFLOW=1 HOROVOD_WITHOUT_MXNET=1
  export HOROVOD_WITH_GLOO=1 HOROVOD_WITH_MPI=1
  export MAKEFLAGS=${MAKEFLAGS:--j$(nproc)}
  if [ "$FLAVOUR" = nccl ]; then
    SITE=$("$PY" -c 'import nvidia.nccl, os; print(os.path.dirname(list(nvidia.nccl.__path__)[0]))' 2>/dev/null || true)
    NCCL_HOME=$WORK/nccl
    if [ -n "$SITE" ] && [ -f "$SITE/nccl/include/nccl.h" ]; then
      # torch's pip NCCL ships only libnccl.so.2; CMake's find_library wants libnccl.so.
      mkdir -p "$NCCL_HOME/lib"
      ln -s "$SITE/nccl/include" "$NCCL_HOME/include"
      ln -s "$(ls "$SITE"/nccl/lib/libnccl.so* | head -n 1)" "$NCCL_HOME/lib/libnccl.so"
    elif [ -f /usr/include/nccl.h ]; then
      NCCL_HOME=/usr
    else
      die "no NCCL found (neither torch's nvidia-nccl package nor /usr/include/nccl.h)"
    fi
    export HOROVOD_GPU_OPERATIONS=NCCL HOROVOD_NCCL_LINK=SHARED HOROVOD_NCCL_HOME=$NCCL_HOME
    export HOROVOD_CUDA_HOME=$CUDA_TK CUDA_HOME=$CUDA_TK
    export HOROVOD_BUILD_CUDA_CC_LIST=${HOROVOD_BUILD_CUDA_CC_LIST:-80,90}
  else
    # A CUDA build of torch makes Horovod's CMake add CUDA whenever torch can guess a CUDA_HOME:
    # the CPU flavour tells it plainly that torch has no CUDA.
    patch cmake/Modules/FindPytorch.cmake \
      'print(True if ((torch.version.cuda is not None) and (CUDA_HOME is not None)) else False)' 'print(False)'
    unset HOROVOD_GPU_OPERATIONS HOROVOD_GPU_ALLREDUCE HOROVOD_GPU_BROADCAST HOROVOD_GPU_ALLGATHER
    export HOROVOD_WITHOUT_GPU=1 HOROVOD_CPU_OPERATIONS=${HOROVOD_CPU_OPERATIONS:-}
    [ -n "$HOROVOD_CPU_OPERATIONS" ] || unset HOROVOD_CPU_OPERATIONS
  fi
  mkdir -p "$WORK/out"
  "$PY" -m pip wheel -q --no-deps --no-build-isolation --no-cache-dir -w "$WORK/out" "$SRC" \
    || die "building Horovod failed (see the compiler output above)"
  mkdir -p "$CACHE_DIR"
  rm -f "$CACHE_DIR"/horovod-*.whl
  cp "$WORK"/out/horovod-*.whl "$CACHE_DIR/"
  echo "$KEY" > "$CACHE_DIR/.key"
  WHEEL=$(ls "$CACHE_DIR"/horovod-*.whl | head -n 1)
fi

log "installing $WHEEL"
"$PY" -m pip install -q --force-reinstall --no-deps "$WHEEL"
# Horovod's runtime Python dependencies (the wheel was installed without them).
"$PY" -m pip install -q cloudpickle psutil pyyaml packaging cffi
check_build || die "the installed Horovod is incomplete; rerun with --force"
echo "$KEY" > "$("$PY" -c 'import horovod, os; print(os.path.dirname(horovod.__file__))')/.hvd_slowmo_key"
