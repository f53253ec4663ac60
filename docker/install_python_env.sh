#!/usr/bin/env bash
# The image's Python environment: a virtual environment with torch, torchvision, mpi4py, TensorBoard,
# the examples' dependencies and Horovod, built by the repo's scripts/install_horovod.sh (the script
# CI and the quickstart use). Fails unless `horovodrun --check-build` lists everything the flavour needs.
#
# Usage: docker/install_python_env.sh REPO          (REPO: a copy of the repo's scripts/ and docker/)
# Environment (the Dockerfiles pass their build ARGs):
#   GPU                  yes (Horovod with NCCL; needs CUDA_HOME) or no (Gloo + MPI only); required
#   VENV                 where to create the environment (default /opt/venv)
#   TORCH_VERSION, TORCHVISION_VERSION, MPI4PY_VERSION, HOROVOD_VERSION   pinned versions
#   TORCH_INDEX_URL      pip index for torch/torchvision; empty means PyPI (CUDA 13.0 builds on x86_64)
#   CUDA_HOME            the CUDA toolkit Horovod compiles against (GPU=yes)
#   HOROVOD_BUILD_CUDA_CC_LIST   GPU architectures Horovod's CUDA kernels are built for
set -euo pipefail

REPO=${1:?usage: install_python_env.sh REPO}
VENV=${VENV:-/opt/venv}
: "${GPU:?set GPU=yes or GPU=no}" "${TORCH_VERSION:?}" "${TORCHVISION_VERSION:?}" "${MPI4PY_VERSION:?}" "${HOROVOD_VERSION:?}"
case "$GPU" in
  yes) FLAVOUR=nccl ;;
  no) FLAVOUR=cpu ;;
  *) echo "install_python_env: GPU must be yes or no, not '$GPU'" >&2; exit 2 ;;
esac
# Nothing of pip's cache belongs in an image layer.
export PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
PY=$VENV/bin/python

python3 -m venv "$VENV"
# Horovod's setup.py runs `pip` and `cmake` from PATH: the environment's own pip, Debian's cmake.
export PATH="$VENV/bin:$PATH"
TORCH_INDEX=()
[ -z "${TORCH_INDEX_URL:-}" ] || TORCH_INDEX=(--index-url "$TORCH_INDEX_URL")
"$PY" -m pip install -q "${TORCH_INDEX[@]}" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
"$PY" -m pip install -q "mpi4py==$MPI4PY_VERSION" tensorboard scikit-learn mnist1d matplotlib tqdm
"$PY" -c 'import torch, torchvision, mpi4py, tensorboard; print("torch", torch.__version__, "CUDA", torch.version.cuda)'

WHEELHOUSE=$(mktemp -d)
HOROVOD_VERSION=$HOROVOD_VERSION "$REPO/scripts/install_horovod.sh" \
  --gpu "$GPU" --python "$PY" --wheelhouse "$WHEELHOUSE"
rm -rf "$WHEELHOUSE"
PATH="$VENV/bin:$PATH" "$REPO/docker/check_horovod.sh" "$FLAVOUR"
