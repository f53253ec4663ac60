#!/usr/bin/env bash
# The portability tier: the golden trajectories and the in-process tests that compare the optimizer
# with hand-written references (thread workers, no launcher), run on another kernel path of this
# CPU, as another machine would run them (docs/portability.md).
#
# ATEN_CPU_CAPABILITY=default makes torch use its plain C++ kernels instead of the AVX2/AVX-512
# ones: matrix products and reductions round differently, so the golden records (float32 values
# from one machine) must hold within their stated tolerance, and every bitwise promise (ranks equal
# after an exact average, thread workers equal to their in-process reference) must still hold,
# because both sides of each such comparison run on the same kernels.
#
# Usage: scripts/portability_tier.sh [PYTEST_ARGS...]
#   ATEN_CPU_CAPABILITY=avx2 scripts/portability_tier.sh    the same tier on another path
#   (default: "default"; the CPU's own best path: ATEN_CPU_CAPABILITY= scripts/portability_tier.sh)
# About 2-3 minutes on 2 cores. .ci/run runs it before ./test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}

# The tier, in one place: the golden records, then the reference tests (their horovodrun, torchrun
# and CUDA cases are left to ./test.sh and scripts/gpu_check.sh by the marker filter below).
TIER=(
  tests/test_golden.py
  tests/test_slowmo_math.py
  tests/test_optimizer.py
  tests/test_overlap.py
  tests/test_streaming.py
  tests/test_sharded.py
  tests/test_gossip.py
  tests/test_compression.py
  tests/test_compression_optimizer.py
  tests/test_amp.py
  tests/test_grad_buckets.py
  tests/test_hierarchy.py
  tests/test_consensus.py
  tests/test_finite.py
  tests/test_topology.py
  tests/test_native_codecs.py
)

export ATEN_CPU_CAPABILITY=${ATEN_CPU_CAPABILITY-default}
# Say which kernels run, and stop if torch did not take the requested path (a misspelt value is
# ignored by torch with a warning, and the tier would prove nothing).
"$PY" - <<'PY'
import os, sys
import torch
want = os.environ["ATEN_CPU_CAPABILITY"]
got = torch.backends.cpu.get_cpu_capability()
print(f"portability_tier: ATEN_CPU_CAPABILITY={want!r}: torch {torch.__version__} runs {got} kernels")
if want and got.lower() != want.lower():
    sys.exit(f"portability_tier: asked for {want!r}, torch runs {got}: check the value")
PY
exec "$PY" -m pytest -q -m "not horovod and not torchdist and not cuda" "${TIER[@]}" "$@"
