#!/usr/bin/env bash
# The main job: sets up the environment (idempotent), then trains a small CNN on scikit-learn's
# 8x8 digits under `horovodrun -np 4` with each algorithm and prints the comparison tables.
# Extra arguments go to the training script (see `examples/digits.py --help`).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")" && pwd)
"$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" examples/compare.py "$@"
