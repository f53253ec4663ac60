#!/usr/bin/env bash
# Fails unless `horovodrun --check-build` lists everything an hvd_slowmo image needs: the PyTorch
# framework, MPI and Gloo (each as a controller and as tensor operations) and, for the GPU flavour,
# NCCL tensor operations. The image builds run it so that a Horovod missing a piece fails the build
# instead of failing on the cluster.
#
# Usage: docker/check_horovod.sh cpu|nccl        (uses the horovodrun found on PATH)
set -euo pipefail

case "${1:-}" in
  cpu|nccl) FLAVOUR=$1 ;;
  *) echo "usage: $0 cpu|nccl (got '${1:-}')" >&2; exit 2 ;;
esac
command -v horovodrun >/dev/null || { echo "check_horovod: horovodrun is not on PATH" >&2; exit 1; }

OUT=$(horovodrun --check-build)
echo "$OUT"
# count NAME: how many times "[X] NAME" is listed (once per section that has it; Horovod pads some
# lines with trailing blanks).
count() { grep -cE "^[[:space:]]*\[X\] $1[[:space:]]*\$" <<<"$OUT" || true; }
MISSING=()
[ "$(count PyTorch)" -ge 1 ] || MISSING+=("PyTorch framework")
[ "$(count MPI)" -ge 2 ] || MISSING+=("MPI controller and tensor operations")
[ "$(count Gloo)" -ge 2 ] || MISSING+=("Gloo controller and tensor operations")
if [ "$FLAVOUR" = nccl ]; then
  [ "$(count NCCL)" -ge 1 ] || MISSING+=("NCCL tensor operations")
fi
if [ ${#MISSING[@]} -gt 0 ]; then
  printf 'check_horovod: horovodrun --check-build does not list: %s\n' "${MISSING[@]}" >&2
  exit 1
fi
echo "check_horovod: Horovod has everything the $FLAVOUR image needs"
