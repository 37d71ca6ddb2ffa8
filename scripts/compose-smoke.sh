#!/usr/bin/env bash
# End-to-end check of compose.yaml on this machine, from nothing to nothing:
#   1. a Docker engine (apt-get install docker.io and start dockerd where none answers) and a
#      compose implementation (`docker compose`, else Debian's docker-compose);
#   2. a Debian base image built from Debian packages (debootstrap -> docker import), because no
#      image registry may be reachable; Tandem's image is built on it with --build-arg BASE_IMAGE,
#      from wheels prepared here (CPU torch), and Redis / Prometheus images from Debian packages;
#   3. the README's quickstart (scripts/up.sh) in a container of that plain Debian base;
#   4. `compose up`, wait until every healthcheck passes, run the contract tests against the
#      deployed stack (tests/contract, pointed at the published addresses), including a generate
#      whose repeat reports cached tokens;
#   5. `compose down -v`, and a check that no container of the project is left (a dockerd this
#      script started is stopped again).
# Needs root (apt-get, dockerd). Takes ~10 min the first time (the base image), less after.
# Everything it installs into the repository (.venv, .whl) is git-ignored.
#
#   TANDEM_SMOKE_BASE     base image tag (default tandem-debian-base:bookworm; reused when present)
#   TANDEM_SMOKE_FRESH=1  rebuild the base image and every image without cache
set -euo pipefail
cd "$(dirname "$0")/.."

PROJECT=tandem-smoke
BASE="${TANDEM_SMOKE_BASE:-tandem-debian-base:bookworm}"
SUITE=bookworm
STARTED_DOCKERD=""
COMPOSE=()
WORK="$(mktemp -d)"
log() { echo "[compose-smoke $(date +%T)] $*" >&2; }

apt_install() {
    [ -n "${APT_UPDATED:-}" ] || { apt-get update -qq; APT_UPDATED=1; }
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

debian_mirror() {  # the Debian mirror this machine's apt uses (deb822 or one-line sources)
    local uri
    uri="$(grep -hsE '^(URIs:|deb )' /etc/apt/sources.list.d/*.sources /etc/apt/sources.list.d/*.list /etc/apt/sources.list 2>/dev/null \
        | grep -v security | head -1 | sed -E 's/^URIs:[[:space:]]*//; s/^deb[[:space:]]+(\[[^]]*\][[:space:]]+)?//; s/[[:space:]].*//')"
    echo "${uri:-http://deb.debian.org/debian}"
}

ensure_docker() {
    if docker info >/dev/null 2>&1; then return; fi
    command -v dockerd >/dev/null || { log "installing Debian's docker.io"; apt_install docker.io; }
    log "starting dockerd"
    dockerd >"$WORK/dockerd.log" 2>&1 &
    STARTED_DOCKERD=$!
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && return; sleep 1; done
    tail -20 "$WORK/dockerd.log" >&2
    log "error: dockerd did not come up"; exit 3
}

ensure_compose() {
    if docker compose version >/dev/null 2>&1; then COMPOSE=(docker compose); return; fi
    command -v docker-compose >/dev/null || { log "installing Debian's docker-compose"; apt_install docker-compose; }
    COMPOSE=(docker-compose)
}

ensure_base() {
    if [ -z "${TANDEM_SMOKE_FRESH:-}" ] && docker image inspect "$BASE" >/dev/null 2>&1; then
        log "base image $BASE present"; return
    fi
    command -v debootstrap >/dev/null || apt_install debootstrap
    local mirror rootfs="$WORK/rootfs"
    mirror="$(debian_mirror)"
    log "debootstrap $SUITE from $mirror -> $BASE"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates "$SUITE" "$rootfs" "$mirror" >"$WORK/debootstrap.log" 2>&1 \
        || { tail -20 "$WORK/debootstrap.log" >&2; log "error: debootstrap failed"; exit 3; }
    chroot "$rootfs" apt-get clean
    rm -rf "$rootfs"/var/lib/apt/lists/*
    tar -C "$rootfs" -c . | docker import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
    rm -rf "$rootfs"
}

build_images() {
    local nocache=() base_py host_py
    [ -z "${TANDEM_SMOKE_FRESH:-}" ] || nocache=(--no-cache)
    # Wheels for the image, made here (CPU torch, every dependency) when the base's Python is the
    # venv's: the image build then needs no index at all.
    source scripts/lib/venv.sh
    ensure_venv test
    base_py="$(docker run --rm "$BASE" python3 -c 'import sys; print(sys.version_info[:2])')"
    host_py="$("$TANDEM_PY" -c 'import sys; print(sys.version_info[:2])')"
    rm -rf .whl
    if [ "$base_py" = "$host_py" ]; then
        log "wheels for the image (Python $host_py) -> .whl/"
        # shellcheck disable=SC2046
        # async-timeout: redis needs it below Python 3.11.3 (Debian's 3.11.2 in the image), which
        # the host's newer 3.11.x resolves away; the image installs from these wheels offline
        "$TANDEM_PY" -m pip wheel -q --wheel-dir .whl "torch==$TORCH_VERSION" . "async-timeout>=4.0.3" $(cpu_torch_index_args)
    fi
    log "building tandem:smoke on $BASE"
    docker build -q "${nocache[@]}" --network host -t tandem:smoke --build-arg BASE_IMAGE="$BASE" . >/dev/null
    log "building Redis and Prometheus images from Debian packages"
    docker build -q "${nocache[@]}" --network host -t tandem-redis:smoke --build-arg BASE_IMAGE="$BASE" \
        --build-arg PACKAGES=redis-server -f deploy/apt.Dockerfile deploy >/dev/null
    docker build -q "${nocache[@]}" --network host -t tandem-prometheus:smoke --build-arg BASE_IMAGE="$BASE" \
        --build-arg PACKAGES=prometheus -f deploy/apt.Dockerfile deploy >/dev/null
}

quickstart_in_container() {
    # The README's first command on a plain Debian (its python3 refuses system-wide installs):
    # scripts/up.sh must make its own venv, install, and serve a cached repeat. pip may take torch
    # from .whl (so no multi-GB download happens), everything else it resolves as a user's would.
    log "quickstart (scripts/up.sh) in a container of $BASE"
    local out="$WORK/quickstart.log" ca=()
    # Trust what this host trusts (a machine behind a TLS-inspecting proxy has its own CA).
    local host_ca="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
    [ -f "$host_ca" ] && ca=(-v "$host_ca:/etc/host-ca.crt:ro" -e PIP_CERT=/etc/host-ca.crt)
    docker run --rm --network host -v "$PWD:/mnt:ro" -e PIP_FIND_LINKS=/src/.whl "${ca[@]}" "$BASE" bash -c '
        mkdir /src && tar -C /mnt --exclude=./.venv --exclude=./.git -cf - . | tar -C /src -xf - && cd /src &&
        ! python3 -m pip --version 2>/dev/null &&   # no system pip: nothing but the venv can install
        bash scripts/up.sh --exit-after-demo --router-port 0 --kvstore-port 0 --worker-base-port 0 --num-blocks 256' \
        >"$out" 2>&1 || { tail -30 "$out" >&2; log "error: quickstart failed in the container"; return 1; }
    grep -q "creating the virtual environment" "$out" && grep -Eq "prompt [0-9]+ tokens \(cached [1-9]" "$out" \
        || { tail -30 "$out" >&2; log "error: quickstart gave no cached repeat"; return 1; }
    log "quickstart passed: venv created, demo repeat served from cache"
}

free_port() { "$TANDEM_PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

compose() { "${COMPOSE[@]}" -p "$PROJECT" "$@"; }

wait_healthy() {
    local end=$((SECONDS + 300)) service id status
    for service in redis kvstore worker-0 router; do
        while :; do
            id="$(compose ps -q "$service")"
            status="$(docker inspect -f '{{.State.Health.Status}}' "$id" 2>/dev/null || echo missing)"
            [ "$status" = healthy ] && break
            if [ $SECONDS -gt $end ]; then compose logs --tail 40 >&2; log "error: $service is $status"; return 1; fi
            sleep 2
        done
        log "$service healthy"
    done
}

cleanup() {
    local code=$?
    rm -rf .whl
    if [ ${#COMPOSE[@]} -gt 0 ]; then
        compose down -v --remove-orphans >/dev/null 2>&1 || true
    fi
    if [ -n "$STARTED_DOCKERD" ]; then
        kill "$STARTED_DOCKERD" 2>/dev/null || true
        wait "$STARTED_DOCKERD" 2>/dev/null || true
    fi
    rm -rf "$WORK"
    exit $code
}
trap cleanup EXIT

started=$SECONDS
ensure_docker
ensure_compose
ensure_base
build_images
if [ -d .whl ]; then quickstart_in_container; fi
rm -rf .whl
export TANDEM_IMAGE=tandem:smoke TANDEM_REDIS_IMAGE=tandem-redis:smoke TANDEM_PROMETHEUS_IMAGE=tandem-prometheus:smoke
export TANDEM_BASE_IMAGE="$BASE"
router_port="$(free_port)"; prometheus_port="$(free_port)"; http_port="$(free_port)"
export TANDEM_ROUTER_PUBLISH="127.0.0.1:$router_port" TANDEM_PROMETHEUS_PUBLISH="127.0.0.1:$prometheus_port"
export TANDEM_ROUTER_HTTP_PUBLISH="127.0.0.1:$http_port"
log "compose up (${COMPOSE[*]}); router on 127.0.0.1:$router_port, Prometheus on 127.0.0.1:$prometheus_port"
compose up -d --no-build >/dev/null 2>&1 || { compose logs --tail 40 >&2; exit 1; }
wait_healthy
log "contract tests against the deployed stack"
TANDEM_CONTRACT_ROUTER="127.0.0.1:$router_port" TANDEM_CONTRACT_PROMETHEUS="http://127.0.0.1:$prometheus_port" \
TANDEM_CONTRACT_HTTP="http://127.0.0.1:$http_port/v1" \
    "$TANDEM_PY" -m pytest -q -p no:randomly tests/contract
log "compose down"
compose down -v --remove-orphans >/dev/null 2>&1
left="$(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT")"
[ -z "$left" ] || { log "error: containers left: $left"; exit 1; }
log "passed in $((SECONDS - started)) s; nothing of $PROJECT is left running"
