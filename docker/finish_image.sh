#!/usr/bin/env bash
# Last build step of the hvd_slowmo images (run as root in the final stage): installs hvd_slowmo
# from REPO into the image's virtual environment, creates the account the container runs as and the
# directories it writes, and checks once more, without the build stage's compilers and CUDA
# toolkit, that the environment imports and that Horovod still lists everything the flavour needs.
#
# Usage: docker/finish_image.sh REPO cpu|nccl USER UID GID     (USER=root: no account is created)
set -euo pipefail

REPO=${1:?usage: finish_image.sh REPO cpu|nccl USER UID GID}
FLAVOUR=${2:?flavour cpu or nccl}
ACCOUNT=${3:?user name}
ACCOUNT_UID=${4:?user id}
ACCOUNT_GID=${5:?group id}
die() { echo "finish_image: error: $*" >&2; exit 1; }
[ -x "${VIRTUAL_ENV:-}/bin/python" ] || die "VIRTUAL_ENV must name the image's environment (got '${VIRTUAL_ENV:-}')"

# Editable, so that a checkout mounted over REPO runs its own code. Offline (--no-index, no build
# isolation): the build stage installed the dependencies and the build tools, so this stage needs
# no network and no extra CA certificates. --no-deps: the CPU image leaves out torch's triton on
# purpose (docker/slim_venv.sh); the imports below check what setup.py's extras need instead.
# --use-pep517: without it pip 23 runs `setup.py develop`, which in setuptools >= 80 calls pip
# again, with build isolation, which downloads setuptools.
PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 "$VIRTUAL_ENV/bin/python" -m pip install -q \
  --no-index --no-build-isolation --use-pep517 --no-deps -e "$REPO"

if [ "$ACCOUNT" != root ]; then
  getent group "$ACCOUNT_GID" >/dev/null || groupadd --gid "$ACCOUNT_GID" "$ACCOUNT"
  useradd --uid "$ACCOUNT_UID" --gid "$ACCOUNT_GID" --create-home --shell /bin/bash "$ACCOUNT"
  OWNER=$ACCOUNT_UID:$ACCOUNT_GID
else
  OWNER=0:0
fi
# The mount point of the cluster's ssh key: a named volume mounted here starts with this owner,
# so a container running as the account can write a fresh key into it (docker/compose.cpu.yml).
install -d -m 700 -o "${OWNER%:*}" -g "${OWNER#*:}" /etc/hvd_slowmo/ssh
# Where the examples write TensorBoard runs and figures (mount a host directory here).
install -d -o "${OWNER%:*}" -g "${OWNER#*:}" "$REPO/runs"
rm -rf /tmp/hvd_slowmo

cd "$REPO"
# hvd_slowmo and what its extras [examples,mpi] list.
"$VIRTUAL_ENV/bin/python" -c 'import hvd_slowmo, horovod.torch, mpi4py, torchvision, tensorboard
import sklearn, matplotlib, tqdm
print("imports OK")'
"$REPO/docker/check_horovod.sh" "$FLAVOUR"
