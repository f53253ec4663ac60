#!/usr/bin/env bash
# Build stages, after install_python_env.sh: cut from the virtual environment (which the final stage
# copies whole) what the image never uses, and print its size before and after.
#   - Horovod's debug symbols: scripts/install_horovod.sh builds with -g, which makes its PyTorch
#     library several times larger than the code in it.
#   - cpu flavour: triton, the GPU-kernel compiler that PyPI's CUDA build of torch depends on
#     (PyTorch's CPU wheels do not); torch imports and runs on CPUs without it.
#
# Usage: docker/slim_venv.sh VENV cpu|nccl
set -euo pipefail

VENV=${1:?usage: slim_venv.sh VENV cpu|nccl}
FLAVOUR=${2:?flavour cpu or nccl}
case "$FLAVOUR" in
  cpu|nccl) ;;
  *) echo "slim_venv: flavour must be cpu or nccl, not '$FLAVOUR'" >&2; exit 2 ;;
esac
[ -x "$VENV/bin/python" ] || { echo "slim_venv: $VENV is not a virtual environment" >&2; exit 1; }

before=$(du -sm "$VENV" | cut -f1)
find "$VENV" -path '*/site-packages/horovod/*' -name '*.so' -exec strip --strip-debug {} +
if [ "$FLAVOUR" = cpu ] && "$VENV/bin/python" -m pip show -q triton 2>/dev/null; then
  "$VENV/bin/python" -m pip uninstall -q -y triton
fi
echo "slim_venv: $VENV ${before} MB -> $(du -sm "$VENV" | cut -f1) MB"
