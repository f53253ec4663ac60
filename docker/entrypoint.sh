#!/usr/bin/env bash
# Entrypoint of the hvd_slowmo images: sets up ssh for multi-node launches, then runs the command
# (everything was installed at build time; nothing is installed here).
#
#   (no arguments)  the image's CMD: the main job, python examples/compare.py
#   sshd            sshd alone, in the foreground: a worker node that horovodrun/mpirun reach by ssh
#   COMMAND...      runs COMMAND (e.g. horovodrun on the launching node)
#
# When the cluster's key is mounted, ~/.ssh is set up first (key, authorized_keys, client config with
# the port), so that horovodrun and mpirun in this container reach the other nodes without flags.
#
# Environment:
#   HVD_SLOWMO_SSH_PORT  port sshd listens on and ssh connects to (default 2222). Every node uses the
#                        same one, so horovodrun and mpirun need no port flag.
#   HVD_SLOWMO_SSH_KEYS  directory holding the cluster's key, mounted read-only (default
#                        /etc/hvd_slowmo/ssh): id_ed25519, id_ecdsa or id_rsa, and optionally
#                        authorized_keys (default: the public halves of those keys, so every node that
#                        holds the key may log in to every other).
#   HVD_SLOWMO_SSHD      1: also start sshd in the background before COMMAND, for a container that
#                        both launches and must be reachable (e.g. a job started from a third machine).
#   HVD_SLOWMO_USER      the image's account (set by the image). A container started as root
#                        (docker run --user root) hands the mounted keys to this account and runs
#                        everything (sshd included) as it: keys owned by root, or by any host
#                        account, then work. HVD_SLOWMO_USER=root keeps everything running as root.
set -euo pipefail

PORT=${HVD_SLOWMO_SSH_PORT:-2222}
KEYS=${HVD_SLOWMO_SSH_KEYS:-/etc/hvd_slowmo/ssh}
SSH_DIR=$HOME/.ssh
die() { echo "entrypoint: error: $*" >&2; exit 1; }

# Started as root in an image with its own account: stage a copy of the mounted keys that the
# account can read (a bind mount keeps the host's owner, often root with mode 600), then run this
# script again as the account.
ACCOUNT=${HVD_SLOWMO_USER:-root}
if [ "$(id -u)" = 0 ] && [ "$ACCOUNT" != root ]; then
  getent passwd "$ACCOUNT" >/dev/null \
    || die "HVD_SLOWMO_USER=$ACCOUNT is not an account of this image"
  STAGED=$(mktemp -d /tmp/hvd_slowmo_keys.XXXXXX)
  for name in id_ed25519 id_ecdsa id_rsa authorized_keys; do
    [ ! -f "$KEYS/$name" ] || install -m 600 "$KEYS/$name" "$STAGED/$name"
  done
  chown -R "$ACCOUNT:" "$STAGED"
  HOME=$(getent passwd "$ACCOUNT" | cut -d: -f6)
  export HOME USER=$ACCOUNT LOGNAME=$ACCOUNT HVD_SLOWMO_SSH_KEYS=$STAGED
  exec setpriv --reuid="$ACCOUNT" --regid="$(id -g "$ACCOUNT")" --init-groups "$0" "$@"
fi

setup_ssh() {
  if ! [[ $PORT =~ ^[0-9]{1,5}$ ]] || [ "$PORT" -lt 1 ] || [ "$PORT" -gt 65535 ]; then
    die "HVD_SLOWMO_SSH_PORT must be a port number (1-65535), not '$PORT'"
  fi
  [ "$(id -u)" = 0 ] || [ "$PORT" -ge 1024 ] \
    || die "HVD_SLOWMO_SSH_PORT=$PORT needs root; as $(id -un) use a port >= 1024 (default 2222)"
  mkdir -p "$SSH_DIR/hostkeys"
  chmod 700 "$SSH_DIR"
  # Copy the mounted keys rather than using them in place: a bind mount keeps the host's owner and
  # modes, which ssh and sshd reject for private keys and authorized_keys.
  local key name found=0
  local auth=$SSH_DIR/authorized_keys.new
  : > "$auth"
  for key in "$KEYS"/id_ed25519 "$KEYS"/id_ecdsa "$KEYS"/id_rsa; do
    [ -f "$key" ] || continue
    [ -r "$key" ] || die "$key is not readable by $(id -un) (uid $(id -u)): build the image with" \
      "--build-arg HVD_UID=\$(id -u) --build-arg HVD_GID=\$(id -g) of the key's owner, or run with --user root"
    name=$(basename "$key")
    install -m 600 "$key" "$SSH_DIR/$name"
    ssh-keygen -y -f "$SSH_DIR/$name" >> "$auth" || die "$key is not a private key without passphrase"
    found=1
  done
  [ "$found" = 1 ] || die "no private key (id_ed25519, id_ecdsa or id_rsa) in $KEYS: mount the cluster's key there," \
    "e.g. -v \$HOME/.hvd_slowmo_ssh:$KEYS:ro (docker/README.md shows how to make one)"
  [ ! -f "$KEYS/authorized_keys" ] || cat "$KEYS/authorized_keys" > "$auth"
  chmod 600 "$auth"
  mv "$auth" "$SSH_DIR/authorized_keys"

  # Host keys are made per container, never baked into the image (every node would share them).
  local hostkey=$SSH_DIR/hostkeys/ssh_host_ed25519_key
  [ -f "$hostkey" ] || ssh-keygen -q -t ed25519 -N '' -C "$(hostname)" -f "$hostkey"

  cat > "$SSH_DIR/sshd_config" <<CONF
Port $PORT
HostKey $hostkey
AuthorizedKeysFile $SSH_DIR/authorized_keys
PidFile $SSH_DIR/sshd.pid
PubkeyAuthentication yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
UsePAM no
# ssh sessions do not inherit the container's environment: give them the image's PATH so that
# python, horovodrun and OpenMPI's orted are the same programs on every node.
SetEnv PATH=$PATH
CONF
  # Host keys change with every container, and the nodes talk over the cluster's own network:
  # do not pin them. Where that is not acceptable, mount fixed host keys over $SSH_DIR/hostkeys.
  cat > "$SSH_DIR/config" <<CONF
Host *
  Port $PORT
  StrictHostKeyChecking no
  UserKnownHostsFile /dev/null
  LogLevel ERROR
CONF
  chmod 600 "$SSH_DIR/config" "$SSH_DIR/sshd_config"
  # As root, sshd needs its privilege-separation directory (normally made by the init system).
  [ "$(id -u)" != 0 ] || mkdir -p /run/sshd
  /usr/sbin/sshd -t -f "$SSH_DIR/sshd_config" || die "sshd rejected $SSH_DIR/sshd_config"
}

has_key() {
  local name
  for name in id_ed25519 id_ecdsa id_rsa; do
    [ ! -f "$KEYS/$name" ] || return 0
  done
  return 1
}

if [ $# -eq 1 ] && [ "$1" = sshd ]; then
  setup_ssh
  echo "entrypoint: sshd listening on port $PORT as $(id -un)" >&2
  exec /usr/sbin/sshd -D -e -f "$SSH_DIR/sshd_config"
fi
if [ "${HVD_SLOWMO_SSHD:-0}" = 1 ]; then
  setup_ssh
  /usr/sbin/sshd -f "$SSH_DIR/sshd_config"
elif has_key; then
  setup_ssh  # the client side: this container launches ranks on the other nodes
fi
[ $# -gt 0 ] || die "no command given (the image's default is: python examples/compare.py)"
exec "$@"
