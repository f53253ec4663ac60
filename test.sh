#!/usr/bin/env bash
# The test suite: sets up the environment (idempotent), then runs the default tier (in-process
# tests and one launch per engine and feature). `--tier fast` runs the in-process tests that take
# seconds (for every edit), `--tier launches` the other launches, `--tier full` default and
# launches (tests/conftest.py); other arguments go to pytest, e.g. -k slowmo
set -euo pipefail
ROOT=$(cd "$(dirname "$0")" && pwd)
"$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$ROOT/.venv/bin/python" -m pytest tests "$@"
