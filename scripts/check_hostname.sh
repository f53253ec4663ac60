#!/usr/bin/env bash
# Check that this machine's host name resolves to an address. horovodrun --gloo needs it: in a
# Debian 13 debootstrap root whose /etc/hosts did not name the host, a 2-rank Gloo job segfaulted
# in Gloo's device.cc instead of saying so. scripts/setup_env.sh runs this check and warns.
#
# Usage: scripts/check_hostname.sh [NAME]   (default: this machine's, `uname -n`, as `hostname`)
# Exit status 0 when NAME resolves; 1, with what to do, when it does not.
set -euo pipefail

name=${1:-$(uname -n)}
if ! getent hosts "$name" >/dev/null; then
  echo "check_hostname: the host name '$name' does not resolve (getent hosts '$name' finds" \
       "nothing), so horovodrun --gloo jobs crash (a segfault in Gloo). Name it in /etc/hosts," \
       "as root: echo '127.0.1.1 $name' >> /etc/hosts" >&2
  exit 1
fi
