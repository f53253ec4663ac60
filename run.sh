#!/usr/bin/env bash
# The main job: sets up the environment (idempotent), then trains a small 1-D CNN on MNIST-1D
# under one `horovodrun -np 4` launch with AR-SGD, Local SGD, SGP, with and without SlowMo,
# 3 seeds each at their tuned settings, and prints the comparison tables (mean ± std over seeds).
# `./run.sh --quick` (one seed, fewer epochs), `./run.sh --full` (5 seeds, OSGP too); other
# arguments: `python examples/compare.py --help`. As root, `./run.sh --network 100mbit` runs it on
# 4 emulated hosts (network namespaces, shaped links) and prints the time to accuracy.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")" && pwd)
"$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" examples/compare.py "$@"
