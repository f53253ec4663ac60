#!/usr/bin/env bash
# The GPU check, in one command, on a machine with an NVIDIA GPU, within a time budget (default
# 6 minutes; --quick: a little over 3). It builds Horovod twice, in parallel, each with half the cores: with
# NCCL into the environment (one rank per GPU), and staged (CUDA tensors through host memory, so
# two ranks can share the GPU) into OUT/staged-horovod. Meanwhile the `cuda` tests that need no
# Horovod run (thread workers; two processes over torch.distributed's Gloo). Each Horovod's tests
# start as soon as it is built (every test group in pytest's full tier; a group that selects no
# test fails); then the ResNet-50 benchmark (benchmarks/gpu_resnet50.py) and the codec cost
# (benchmarks/codec_cost.py) run alone on the GPU. Every step has its own log in
# OUT and a timeout cut to what the budget has left; a summary of figures (each step's status
# and time, the benchmark's rows, device, driver, torch and CUDA versions) ends the run and is
# written to OUT/summary.md and OUT/summary.json. Exit status: 0 when every step passed.
#
# Usage: scripts/gpu_check.sh [options]
#   --python PY        the Python environment with a CUDA torch (default $PYTHON or python3)
#   --bundle DIR       build offline from DIR: horovod-0.28.1.tar.gz and the wheels of Horovod's
#                      dependencies, made on a machine with internet by
#                      `scripts/install_horovod.sh --download DIR --python-version X.Y`
#   --wheelhouse DIR   Horovod wheel cache (install_horovod.sh --wheelhouse): a carried, filled
#                      one skips the builds
#   --out DIR          logs and results (default runs/gpu-check)
#   --steps LIST       comma-separated subset of: facts,nccl,staged,tests,bench,codec (default
#                      all; --quick: all but staged)
#   --budget S         seconds for the whole run (default 360; --quick: 190): each step's
#                      timeout is cut so that the steps after it keep their share
#   --timeout S        at most S seconds for any one step (default: each step's own limit)
#   --mpi auto|yes|no  passed to install_horovod.sh (default auto: MPI when mpicc is there)
#   --quick            fewer tests and iterations: the NCCL build only, with every core
#   --dry-run          print the plan (steps, commands, limits, what runs in parallel); run nothing
# The build environment (CC, CXX, CFLAGS, ...) reaches the builds untouched; MAKEFLAGS is set
# only when the caller has not. The tests find the staged Horovod through
# HVD_SLOWMO_STAGED_HOROVOD (set here when it built, or found in OUT from an earlier call).
set -uo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
BUNDLE=""
WHEELHOUSE=""
OUT=$ROOT/runs/gpu-check
STEPS=""
BUDGET=""
MAX_STEP=""
MPI=auto
QUICK=0
DRY=0

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
    --budget) value "$@"; BUDGET=$2; shift 2 ;;
    --timeout) value "$@"; MAX_STEP=$2; shift 2 ;;
    --mpi) value "$@"; MPI=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --dry-run) DRY=1; shift ;;
    -h|--help) sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done
if [ "$QUICK" = 1 ]; then
  STEPS=${STEPS:-facts,nccl,tests,bench,codec}
  BUDGET=${BUDGET:-190}
else
  STEPS=${STEPS:-facts,nccl,staged,tests,bench,codec}
  BUDGET=${BUDGET:-360}
fi
[[ "$BUDGET" =~ ^[1-9][0-9]*$ ]] \
  || die "--budget must be a positive number of seconds, not '$BUDGET'"
[ -z "$MAX_STEP" ] || [[ "$MAX_STEP" =~ ^[1-9][0-9]*$ ]] \
  || die "--timeout must be a positive number of seconds, not '$MAX_STEP'"
for s in ${STEPS//,/ }; do
  case "$s" in
    facts|nccl|staged|tests|bench|codec) ;;
    *) die "--steps: unknown step '$s' (facts,nccl,staged,tests,bench,codec)" ;;
  esac
done
case "$MPI" in auto|yes|no) ;; *) die "--mpi must be auto, yes or no, not '$MPI'" ;; esac
[ -z "$BUNDLE" ] || [ -d "$BUNDLE" ] || die "--bundle: '$BUNDLE' is not a directory"
command -v "$PY" >/dev/null || die "--python: '$PY' not found"
command -v timeout >/dev/null || die "timeout (coreutils) is needed to bound each step"

wanted() { [[ ",$STEPS," == *",$1,"* ]]; }
CORES=$(nproc 2>/dev/null || echo 2)
# Two builds at once share the cores; the caller's MAKEFLAGS wins.
if wanted nccl && wanted staged; then JOBS=$(( CORES > 1 ? CORES / 2 : 1 )); else JOBS=$CORES; fi
BUILD_ENV=()
[ -n "${MAKEFLAGS:-}" ] || BUILD_ENV=("MAKEFLAGS=-j$JOBS")
INSTALL=("$ROOT/scripts/install_horovod.sh" --python "$PY" --mpi "$MPI")
[ -z "$BUNDLE" ] || INSTALL+=(--find-links "$BUNDLE" --offline)
[ -z "$WHEELHOUSE" ] || INSTALL+=(--wheelhouse "$WHEELHOUSE")

# Each step's own limit (seconds) and what the steps after it keep back.
declare -A WANT=([facts]=30 [nccl]=300 [staged]=300 [bench]=90 [codec]=45)
# What a step keeps back for the steps after it (seconds): a build, some time for the Horovod
# tests after it and the benchmarks; a test group (they all run beside the builds or after
# them), the benchmarks; the ResNet-50 benchmark, the codec cost. Another 5 s are for the
# summary.
RESERVE_SUMMARY=5
RESERVE_AFTER_BENCH=0
wanted codec && RESERVE_AFTER_BENCH=$(( QUICK ? 15 : 20 ))
RESERVE_AFTER_TESTS=$RESERVE_AFTER_BENCH
wanted bench && RESERVE_AFTER_TESTS=$(( RESERVE_AFTER_BENCH + (QUICK ? 30 : 45) ))
RESERVE_AFTER_BUILDS=$RESERVE_AFTER_TESTS
wanted tests && RESERVE_AFTER_BUILDS=$(( RESERVE_AFTER_TESTS + (QUICK ? 20 : 45) ))

# The test groups, in order: each is one pytest process over one test file (markers in
# pytest.ini), in the full tier of tests/conftest.py (its default tier deselects the launches),
# with its own limit (s), log and timeout. `test_group NAME LIMIT AFTER SELECTION [FILE]`: AFTER
# is when it starts (start: at once; nccl, staged: as soon as that Horovod is built, and the
# staged one is handed to it); SELECTION is pytest's arguments, separated by |; FILE is relative
# to the repository (default tests/test_cuda.py). A group that selects no test fails.
TEST_TIER=full
TEST_GROUPS=()
declare -A TEST_SELECT=() TEST_AFTER=() TEST_FILE=()
test_group() {
  TEST_GROUPS+=("$1"); WANT[$1]=$2; TEST_AFTER[$1]=$3; TEST_SELECT[$1]=$4
  TEST_FILE[$1]=${5:-tests/test_cuda.py}
}
test_group tests-threads 240 start "-m|cuda and not horovod and not torchdist"
test_group tests-torchdist 240 start "-m|cuda and torchdist"
test_group tests-nccl 150 nccl "-m|cuda and horovod|-k|not staged"
test_group tests-staged 150 staged "-m|cuda and horovod|-k|staged"
if [ "$QUICK" = 1 ]; then
  TEST_SELECT[tests-threads]="-m|cuda and not horovod and not torchdist|-k|base_on_device"
  TEST_SELECT[tests-nccl]="-m|cuda and horovod|-k|np1"
fi
# The benchmarks' commands (again once OUT is an absolute path).
bench_cmds() {
  BENCH=("$PY" "$ROOT/benchmarks/gpu_resnet50.py")
  CODEC=("$PY" "$ROOT/benchmarks/codec_cost.py" --json "$OUT/codec.json")
  if [ "$QUICK" = 1 ]; then
    BENCH+=(--windows 2 --repeats 5)
    CODEC+=(--mb 16 --repeats 3)
  fi
}
bench_cmds

# pytest's command for a test group (pytest-timeout bounds each test where it is installed).
PYTEST_TIMEOUT=""
pytest_cmd() {
  local name=$1 sel
  IFS='|' read -r -a sel <<<"${TEST_SELECT[$name]}"
  CMD=("$PY" -m pytest "$ROOT/${TEST_FILE[$name]}" "${sel[@]}" --tier "$TEST_TIER" -v -rA
       -p no:cacheprovider --rootdir "$ROOT" --junitxml "$OUT/$name.xml")
  if [ -z "$PYTEST_TIMEOUT" ]; then  # asked once
    PYTEST_TIMEOUT=no
    if [ "$DRY" = 1 ] || "$PY" -c 'import pytest_timeout' 2>/dev/null; then PYTEST_TIMEOUT=yes; fi
  fi
  [ "$PYTEST_TIMEOUT" = no ] || CMD+=(--timeout 90)
}

if [ "$DRY" = 1 ]; then
  show() { local a out=""; for a in "$@"; do out+=" $(printf '%q' "$a")"; done; echo "${out# }"; }
  tests_of() {  # WHEN: the groups that start then
    local t
    wanted tests || return 0
    for t in "${TEST_GROUPS[@]}"; do
      [ "${TEST_AFTER[$t]}" = "$1" ] || continue
      pytest_cmd "$t"
      echo "  $t: $(show "${CMD[@]}")"
    done
  }
  echo "gpu_check: plan (--dry-run: nothing runs), budget ${BUDGET}s, ${CORES} cores, out $OUT"
  echo "steps: $STEPS${MAX_STEP:+ (no step over ${MAX_STEP}s)}"
  wanted facts && echo "1. facts (${WANT[facts]}s): nvidia-smi, torch, CUDA, compiler, CMake, MPI"
  echo "2. in parallel, each under its own timeout (at most what the budget leaves):"
  wanted nccl && echo "  nccl: $(show "${BUILD_ENV[@]}" "${INSTALL[@]}" --gpu yes)"
  wanted staged && echo "  staged: $(show "${BUILD_ENV[@]}" "${INSTALL[@]}" --gpu staged \
    --target "$OUT/staged-horovod")"
  tests_of start
  echo "  for compute capabilities ${HOROVOD_BUILD_CUDA_CC_LIST:-of the GPUs present (from torch)}"
  echo "3. as each build ends, its tests (in parallel):"
  wanted nccl || echo "  (no nccl step: the environment's Horovod, if any)"
  tests_of nccl
  wanted staged || echo "  (no staged step: a staged Horovod from an earlier call in OUT, if any)"
  tests_of staged
  echo "4. alone on the GPU:"
  wanted bench && echo "  bench: $(show "${BENCH[@]}")"
  wanted codec && echo "  codec: $(show "${CODEC[@]}")"
  echo "5. summary: $PY $ROOT/scripts/gpu_summary.py $OUT (OUT/summary.md, OUT/summary.json)"
  exit 0
fi

mkdir -p "$OUT" || die "--out: cannot create '$OUT'"
OUT=$(cd "$OUT" && pwd)
bench_cmds
cd "$ROOT" || die "cannot enter $ROOT"
rm -f "$OUT"/*.log "$OUT"/*.xml "$OUT"/.*.rc "$OUT/steps.tsv" "$OUT/codec.json" "$OUT/facts.json" \
      "$OUT/summary.md" "$OUT/summary.json"
# Unbuffered Python, so a step killed by its timeout still leaves its output in the log.
export PYTHONUNBUFFERED=1
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
STAGED=$OUT/staged-horovod
T0=$(date +%s)
DEADLINE=$(( T0 + BUDGET ))
FAILED=0
printf 'step\tstatus\tseconds\tlimit\n' > "$OUT/steps.tsv"

record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$OUT/steps.tsv"; }
skip() { echo "gpu_check: -- $1 skipped: $2"; record "$1" "skipped: $2" 0 0; }

# limit_of NAME RESERVE: the step's timeout (its own limit, --timeout, and what the budget leaves
# once RESERVE seconds are kept for the steps after it); fails when under 10 s are left.
limit_of() {
  local left=$(( DEADLINE - $(date +%s) - $2 - RESERVE_SUMMARY )) limit=${WANT[$1]}
  [ "$left" -ge 10 ] || return 1
  [ -z "$MAX_STEP" ] || [ "$MAX_STEP" -ge "$limit" ] || limit=$MAX_STEP
  [ "$left" -ge "$limit" ] || limit=$left
  echo "$limit"
}

# start NAME RESERVE CMD...: run CMD in the background, its output in OUT/NAME.log, bounded by
# its limit; the exit status and end time land in OUT/.NAME.rc. PID[NAME] is set.
declare -A PID=() BEGAN=() LIMIT=()
start() {
  local name=$1 limit
  if ! limit=$(limit_of "$name" "$2"); then
    FAILED=1  # the check did not do all it was asked
    skip "$name" "out of the ${BUDGET}s budget"
    return 1
  fi
  shift 2
  echo "gpu_check: == $name (log $OUT/$name.log, timeout ${limit}s)"
  BEGAN[$name]=$(date +%s)
  LIMIT[$name]=$limit
  (
    timeout --kill-after=5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "$? $(date +%s)" > "$OUT/.$name.rc"
  ) &
  PID[$name]=$!
}
# finish NAME: wait for a started step and record it; returns its exit status.
finish() {
  local name=$1 rc end status empty=0
  [ -n "${PID[$name]:-}" ] || return 1
  wait "${PID[$name]}"
  read -r rc end < "$OUT/.$name.rc" || { rc=1; end=$(date +%s); }
  unset "PID[$name]"
  # A test group whose selection collects nothing (pytest's exit 5, "0 selected") checked
  # nothing: a failure, said as such.
  if [ -n "${TEST_SELECT[$name]:-}" ] && { [ "$rc" = 5 ] \
       || { [ "$rc" = 0 ] && grep -q '/ 0 selected' "$OUT/$name.log"; }; }; then
    rc=5 empty=1
    status="FAILED: no test selected"
  else
    case "$rc" in
      0) status=passed ;;
      124|137) status="TIMED OUT after ${LIMIT[$name]}s" ;;
      *) status="FAILED (exit $rc)" ;;
    esac
  fi
  echo "gpu_check: -- $name $status ($(( end - BEGAN[$name] ))s)"
  [ "$empty" = 0 ] || echo "gpu_check: $name: no test selected by pytest" \
    "${TEST_SELECT[$name]//|/ } --tier $TEST_TIER in ${TEST_FILE[$name]}"
  if [ "$rc" != 0 ]; then FAILED=1; tail -n 30 "$OUT/$name.log"; fi
  record "$name" "$status" "$(( end - BEGAN[$name] ))" "${LIMIT[$name]}"
  return "$rc"
}
run_step() { start "$@" && finish "$1"; }
summary() {
  echo
  "$PY" "$ROOT/scripts/gpu_summary.py" "$OUT" || { echo "(summary failed)"; cat "$OUT/steps.tsv"; }
}
# start_tests WHEN [ENV...]: start the test groups that start then, with ENV.
start_tests() {
  wanted tests || return 0
  local when=$1 name
  shift
  for name in "${TEST_GROUPS[@]}"; do
    [ "${TEST_AFTER[$name]}" = "$when" ] || continue
    pytest_cmd "$name"
    start "$name" "$RESERVE_AFTER_TESTS" env "$@" "${CMD[@]}" || true
  done
}
# skip_tests WHEN REASON: the test groups that would start then do not run, for REASON.
skip_tests() {
  wanted tests || return 0
  local name
  for name in "${TEST_GROUPS[@]}"; do [ "${TEST_AFTER[$name]}" != "$1" ] || skip "$name" "$2"; done
}

# shellcheck disable=SC2329  # exported and run by `run_step facts ... bash -c facts`
facts() {
  nvidia-smi || echo "(nvidia-smi not available)"
  "$PY" - "$OUT/facts.json" <<'PYEOF' || return 1
import json, platform, shutil, subprocess, sys
import torch
facts = {"python": platform.python_version(), "torch": torch.__version__,
         "cuda": torch.version.cuda, "gpus": []}
print("python", facts["python"], "| torch", facts["torch"], "| CUDA", facts["cuda"])
if shutil.which("nvidia-smi"):
    q = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                       capture_output=True, text=True)
    facts["driver"] = q.stdout.strip().splitlines()[0] if q.returncode == 0 and q.stdout else None
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        facts["gpus"].append(f"{p.name}, {p.total_memory / 2**30:.0f} GiB, "
                             f"compute capability {p.major}.{p.minor}")
        print(f"GPU {i}: {facts['gpus'][-1]}")
with open(sys.argv[1], "w") as f:
    json.dump(facts, f)
if not facts["gpus"]:
    sys.exit("torch sees no CUDA GPU: this is not a GPU machine (or the driver is not visible)")
PYEOF
  "${CXX:-c++}" --version | head -n 1
  cmake --version | head -n 1 || true
  command -v mpicc || echo "no mpicc: Horovod is built without MPI (Gloo only)"
}

if wanted facts; then
  export -f facts
  export PY OUT
  if ! run_step facts 0 bash -c facts; then
    summary
    die "no usable GPU: stopping"
  fi
fi
# Both builds compile for the architectures of the GPUs present, unless the caller chose.
# (GPU_CAPS, never CC: the environment's CC names the C compiler of every build below.)
if { wanted nccl || wanted staged; } && [ -z "${HOROVOD_BUILD_CUDA_CC_LIST:-}" ]; then
  GPU_CAPS=$("$PY" -c 'import torch; c = torch.cuda
print(",".join(sorted({"%d%d" % c.get_device_capability(i) for i in range(c.device_count())})))' \
       2>/dev/null)
  [ -z "$GPU_CAPS" ] || BUILD_ENV+=("HOROVOD_BUILD_CUDA_CC_LIST=$GPU_CAPS")
fi

# Phase 1: the builds, and the tests that need no Horovod, all at once.
wanted nccl && start nccl "$RESERVE_AFTER_BUILDS" env "${BUILD_ENV[@]}" "${INSTALL[@]}" --gpu yes
wanted staged && start staged "$RESERVE_AFTER_BUILDS" env "${BUILD_ENV[@]}" "${INSTALL[@]}" --gpu staged \
  --target "$STAGED"
start_tests start
# Phase 2: each Horovod's tests as soon as it is built (whichever build ends first).
built() {  # NAME OK: start the tests of the Horovod that step NAME built (OK=1) or say why not
  case "$1" in
    nccl)
      if [ "$2" = 1 ]; then start_tests nccl
      else skip_tests nccl "the NCCL Horovod did not build"; fi ;;
    staged)
      if [ "$2" = 1 ]; then start_tests staged "HVD_SLOWMO_STAGED_HOROVOD=$STAGED"
      else
        skip_tests staged "no staged Horovod (the staged step failed, or was not run: --steps staged)"
      fi ;;
  esac
}
BUILDING=()
for name in nccl staged; do
  wanted "$name" || continue
  if [ -n "${PID[$name]:-}" ]; then BUILDING+=("$name"); else built "$name" 0; fi
done
wanted nccl || built nccl 1  # the environment's Horovod, if any
if ! wanted staged; then  # a staged Horovod built by an earlier call, if any
  if [ -f "$STAGED/horovod/.hvd_slowmo_key" ]; then built staged 1; else built staged 0; fi
fi
while [ ${#BUILDING[@]} -gt 0 ]; do
  LEFT=()
  for name in "${BUILDING[@]}"; do
    if [ ! -f "$OUT/.$name.rc" ]; then LEFT+=("$name")
    elif finish "$name"; then built "$name" 1
    else built "$name" 0; fi
  done
  BUILDING=("${LEFT[@]}")
  [ ${#BUILDING[@]} -eq 0 ] || sleep 1
done
for name in "${TEST_GROUPS[@]}"; do
  [ -z "${PID[$name]:-}" ] || finish "$name"
done
# Phase 3: the benchmarks, alone on the GPU.
wanted bench && run_step bench "$RESERVE_AFTER_BENCH" "${BENCH[@]}"
wanted codec && run_step codec 0 "${CODEC[@]}"

summary
exit "$FAILED"
