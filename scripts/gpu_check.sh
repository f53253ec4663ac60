#!/usr/bin/env bash
# The GPU check, in one command, on a machine with an NVIDIA GPU: build and install Horovod with
# NCCL (scripts/install_horovod.sh), build a second Horovod without GPU operations into a folder
# (two ranks can then share the GPU), run the `cuda` tests (tests/test_cuda.py), and print the
# ResNet-50 benchmark (benchmarks/gpu_resnet50.py). Each step has its own log and a timeout, so one
# hang does not eat the run; a summary table ends it. Exit status: 0 when every step passed.
#
# Usage: scripts/gpu_check.sh [options]
#   --python PY        the Python environment with a CUDA torch (default $PYTHON or python3)
#   --bundle DIR       build offline from DIR: horovod-0.28.1.tar.gz and the wheels of Horovod's
#                      dependencies, made on a machine with internet by
#                      `scripts/install_horovod.sh --download DIR --python-version X.Y`
#   --wheelhouse DIR   Horovod wheel cache (install_horovod.sh --wheelhouse): a carried, filled
#                      one skips the builds
#   --out DIR          logs and results (default runs/gpu-check)
#   --steps LIST       comma-separated subset of: facts,nccl,staged,tests,bench (default all)
#   --timeout S        seconds allowed per step (default 600; the tests step gets twice that)
#   --mpi auto|yes|no  passed to install_horovod.sh (default auto: MPI when mpicc is there)
# The tests find the staged Horovod through HVD_SLOWMO_STAGED_HOROVOD (set here when it built).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
BUNDLE=""
WHEELHOUSE=""
OUT=$ROOT/runs/gpu-check
STEPS=facts,nccl,staged,tests,bench
STEP_TIMEOUT=600
MPI=auto

die() { echo "gpu_check: error: $*" >&2; exit 2; }
value() {
  [ $# -ge 2 ] && [ -n "$2" ] && [ "${2#--}" = "$2" ] || die "$1 needs a value (see --help)"
}
while [ $# -gt 0 ]; do
  case "$1" in
    --python) value "$@"; PY=$2; shift 2 ;;
    --bundle) value "$@"; BUNDLE=$2; shift 2 ;;
    --wheelhouse) value "$@"; WHEELHOUSE=$2; shift 2 ;;
    --out) value "$@"; OUT=$2; shift 2 ;;
    --steps) value "$@"; STEPS=$2; shift 2 ;;
    --timeout) value "$@"; STEP_TIMEOUT=$2; shift 2 ;;
    --mpi) value "$@"; MPI=$2; shift 2 ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
[[ "$STEP_TIMEOUT" =~ ^[1-9][0-9]*$ ]] \
  || die "--timeout must be a positive number of seconds, not '$STEP_TIMEOUT'"
for s in ${STEPS//,/ }; do
  case "$s" in
    facts|nccl|staged|tests|bench) ;;
    *) die "--steps: unknown step '$s' (facts,nccl,staged,tests,bench)" ;;
  esac
done
case "$MPI" in auto|yes|no) ;; *) die "--mpi must be auto, yes or no, not '$MPI'" ;; esac
[ -z "$BUNDLE" ] || [ -d "$BUNDLE" ] || die "--bundle: '$BUNDLE' is not a directory"
command -v "$PY" >/dev/null || die "--python: '$PY' not found"
command -v timeout >/dev/null || die "timeout (coreutils) is needed to bound each step"

mkdir -p "$OUT" || die "--out: cannot create '$OUT'"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT" || die "cannot enter $ROOT"
# Unbuffered Python, so a step killed by its timeout still leaves its output in the log.
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
INSTALL=("$ROOT/scripts/install_horovod.sh" --python "$PY" --mpi "$MPI")
[ -z "$BUNDLE" ] || INSTALL+=(--find-links "$BUNDLE" --offline)
[ -z "$WHEELHOUSE" ] || INSTALL+=(--wheelhouse "$WHEELHOUSE")
STAGED=$OUT/staged-horovod

SUMMARY=()
FAILED=0
wanted() { [[ ",$STEPS," == *",$1,"* ]]; }
# step NAME SECONDS CMD...: run CMD with its output in OUT/NAME.log, bounded by SECONDS.
step() {
  local name=$1 limit=$2 t0 rc status
  shift 2
  echo "gpu_check: == $name (log $OUT/$name.log, timeout ${limit}s)"
  t0=$(date +%s)
  timeout --kill-after=15 "$limit" "$@" > "$OUT/$name.log" 2>&1
  rc=$?
  case "$rc" in
    0) status=passed ;;
    124|137) status="TIMED OUT after ${limit}s" ;;
    *) status="FAILED (exit $rc)" ;;
  esac
  [ "$rc" = 0 ] || { FAILED=1; tail -n 40 "$OUT/$name.log"; }
  SUMMARY+=("$(printf '%-8s %-28s %5ss' "$name" "$status" "$(( $(date +%s) - t0 ))")")
  return "$rc"
}
skip() { SUMMARY+=("$(printf '%-8s %-28s' "$1" "skipped: $2")"); }

# shellcheck disable=SC2329  # exported and run by `step facts ... bash -c facts`
facts() {
  nvidia-smi || echo "(nvidia-smi not available)"
  "$PY" - <<'PYEOF' || return 1
import sys, torch
print("python", sys.version.split()[0], "| torch", torch.__version__, "| CUDA", torch.version.cuda)
if not torch.cuda.is_available():
    sys.exit("torch sees no CUDA GPU: this is not a GPU machine (or the driver is not visible)")
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"GPU {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, "
          f"compute capability {p.major}.{p.minor}")
PYEOF
  "${CXX:-c++}" --version | head -n 1
  cmake --version | head -n 1 || true
  command -v mpicc || echo "no mpicc: Horovod is built without MPI (Gloo only)"
}

if wanted facts; then
  export -f facts
  export PY
  step facts 120 bash -c facts || { printf '%s\n' "${SUMMARY[@]}"; die "no usable GPU: stopping"; }
fi
# Both builds compile for the architectures of the GPUs present, unless the caller chose.
if { wanted nccl || wanted staged; } && [ -z "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ]; then
  CC=$("$PY" -c 'import torch; c = torch.cuda
print(",".join(sorted({"%d%d" % c.get_device_capability(i) for i in range(c.device_count())})))' \
       2>/dev/null)
  [ -z "$CC" ] || export HOROVOD_BUILD_CUDA_CC_LIST=$CC
fi
NCCL_OK=1
if wanted nccl; then
  step nccl "$STEP_TIMEOUT" "${INSTALL[@]}" --gpu yes || NCCL_OK=0
fi
if wanted staged; then
  if step staged "$STEP_TIMEOUT" "${INSTALL[@]}" --gpu staged --target "$STAGED"; then
    export HVD_SLOWMO_STAGED_HOROVOD=$STAGED
  fi
elif [ -f "$STAGED/horovod/.hvd_slowmo_key" ]; then
  export HVD_SLOWMO_STAGED_HOROVOD=$STAGED  # built by an earlier call with --steps staged
fi
if wanted tests; then
  if [ "$NCCL_OK" = 1 ]; then
    step tests $((2 * STEP_TIMEOUT)) "$PY" -m pytest "$ROOT/tests/test_cuda.py" -m cuda -v -rA \
      -p no:cacheprovider --rootdir "$ROOT" --junitxml "$OUT/cuda-tests.xml"
  else
    skip tests "the NCCL Horovod did not build"
  fi
fi
if wanted bench; then
  step bench "$STEP_TIMEOUT" "$PY" "$ROOT/benchmarks/gpu_resnet50.py" && cat "$OUT/bench.log"
fi

echo
echo "gpu_check: summary (logs in $OUT)"
if [ -f "$OUT/tests.log" ]; then
  grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|=+ .*(passed|failed|error)" "$OUT/tests.log" | tail -n 60
fi
printf '%s\n' "${SUMMARY[@]}"
exit "$FAILED"
