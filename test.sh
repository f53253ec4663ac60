#!/usr/bin/env bash
# The test suite: sets up the environment (idempotent), then runs every test.
# Extra arguments go to pytest, e.g. ./test.sh -k slowmo
set -euo pipefail
ROOT=$(cd "$(dirname "$0")" && pwd)
"$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest tests "$@"
