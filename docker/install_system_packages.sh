#!/usr/bin/env bash
# Debian packages for the hvd_slowmo images, installed and cleaned up in one step.
#
# Usage: docker/install_system_packages.sh runtime|build
#   runtime  what a training container needs: Python 3, OpenMPI, sshd/ssh (multi-node launches),
#            InfiniBand verbs (NCCL's and OpenMPI's IB transports load them at run time, and fall
#            back to TCP sockets without them), iproute2 (to pick a network interface), tini (PID 1)
#   build    the runtime set plus compilers, CMake, headers for Horovod and mpi4py, and venv
set -euo pipefail

RUNTIME="python3 ca-certificates openmpi-bin libopenmpi3 openssh-server openssh-client
  libibverbs1 ibverbs-providers librdmacm1 iproute2 procps tini"
# Debian's CMake 3.25 (the one Horovod 0.28.1 was built with here): PyPI's CMake 4 refuses the
# cmake_minimum_required(2.8.12) of Horovod's bundled Gloo.
# python3-venv creates the environment that the final stage copies (it runs the system's python3).
BUILD="build-essential cmake python3-dev python3-venv libopenmpi-dev"

case "${1:-}" in
  runtime) PACKAGES=$RUNTIME ;;
  build) PACKAGES="$RUNTIME $BUILD" ;;
  *) echo "usage: $0 runtime|build (got '${1:-}')" >&2; exit 2 ;;
esac

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086  # the package lists are meant to split into words
apt-get install -y -qq --no-install-recommends $PACKAGES
apt-get clean
rm -rf /var/lib/apt/lists/*
# The Debian sshd package ships host keys generated at install time; every container must make its
# own (docker/entrypoint.sh does), so none are baked into a layer that every node would share.
rm -f /etc/ssh/ssh_host_*
