#!/usr/bin/env bash
# Assemble a CUDA 13.0 toolkit (nvcc, headers, cudart, NVTX) under PREFIX from NVIDIA's PyPI wheels.
#
# Horovod's NCCL build needs nvcc and the CUDA headers only at compile time: torch's cu130 wheels
# bring their own CUDA runtime libraries and the driver comes from the host (nvidia-container-toolkit),
# so the GPU image uses this toolkit in its build stage and ships without it. The wheel set and the
# links added below reproduce, file for file, the toolkit at /usr/local/cuda-13.0 with which Horovod
# 0.28.1 was built and checked on the project's build machine (see docker/README.md).
#
# Usage: docker/install_cuda_toolkit.sh PREFIX   (PYTHON: the interpreter whose venv module fetches the
#        wheels, default python3; a throw-away venv keeps pip off the system Python)
# Environment: CUDA_WHEELS overrides the pinned wheel list (space-separated pip requirements).
set -euo pipefail

PREFIX=${1:?usage: install_cuda_toolkit.sh PREFIX}
PY=${PYTHON:-python3}
CUDA_WHEELS=${CUDA_WHEELS:-"nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88
  nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 nvidia-cuda-culibos==13.0.85 nvidia-nvtx==13.0.85
  nvidia-cuda-profiler-api==13.0.85 nvidia-cuda-cupti==13.0.85 nvidia-cuda-cuxxfilt==13.0.85"}
die() { echo "install_cuda_toolkit: error: $*" >&2; exit 1; }

[ ! -e "$PREFIX/bin/nvcc" ] || die "$PREFIX already holds a toolkit; remove it first"
STAGE=$(mktemp -d)
trap 'rm -rf "$STAGE"' EXIT
"$PY" -m venv "$STAGE/venv" || die "$PY cannot create a virtual environment (Debian: apt-get install python3-venv)"
# shellcheck disable=SC2086  # the wheel list is meant to split into words
"$STAGE/venv/bin/python" -m pip install -q --no-deps --no-cache-dir --target "$STAGE/tk" $CUDA_WHEELS \
  || die "could not install the CUDA wheels ($CUDA_WHEELS)"
[ -x "$STAGE/tk/nvidia/cu13/bin/nvcc" ] || die "the wheels did not provide nvidia/cu13/bin/nvcc"

mkdir -p "$PREFIX"
cp -a "$STAGE/tk/nvidia/cu13/." "$PREFIX/"
rm -rf "$PREFIX/.metadata"  # NVIDIA's packaging scan logs, not part of the toolkit
# CMake's FindCUDAToolkit and nvcc look for the classic layout: lib64 and targets/<arch>-linux.
ln -s lib "$PREFIX/lib64"
mkdir -p "$PREFIX/targets/$(uname -m)-linux"
ln -s ../../include "$PREFIX/targets/$(uname -m)-linux/include"
ln -s ../../lib "$PREFIX/targets/$(uname -m)-linux/lib"
# The wheels ship only versioned libraries (libcudart.so.13); linkers look for libcudart.so.
for lib in "$PREFIX"/lib/lib*.so.*; do
  link=${lib%.so.*}.so
  [ -e "$link" ] || ln -s "$(basename "$lib")" "$link"
done
"$PREFIX/bin/nvcc" --version | tail -n 2
