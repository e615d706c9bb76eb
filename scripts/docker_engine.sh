#!/usr/bin/env bash
# Make a Docker engine with the Compose v2 (>= 2.24) and buildx plugins available on a Debian 12
# machine (root), for the compose test (scripts/compose_test.py); .ci/run calls it.
#
#   scripts/docker_engine.sh    exit 0: `docker info` answers and `docker compose` is >= 2.24
#
# Each step is skipped when its result is already there, so a second run on the same machine
# costs seconds (images and the build cache stay in /var/lib/docker between runs):
#   1. `apt-get install docker.io` (dockerd, containerd, runc; Debian 12's client is 20.10);
#   2. Compose v2 and buildx, static Go binaries packaged in Debian 13 (trixie) as
#      docker-compose (2.26) and docker-buildx: their .deb files are fetched from the pool/ of
#      the Debian archive the machine's apt sources name (scripts/apt_mirror.sh) (or, once those versions have left it, by `apt-get download` with trixie in a
#      private source list; the system's sources are not touched) and unpacked into
#      /usr/local/lib/docker/cli-plugins/;
#   3. dockerd started in the background (overlay2, vfs where overlay2 fails), log in
#      /var/log/tandem-dockerd.log, when no engine answers.
# On failure it prints why and exits non-zero; the compose test then skips with that reason.
set -euo pipefail
PLUGINS=/usr/local/lib/docker/cli-plugins
COMPOSE_DEB=pool/main/d/docker-compose/docker-compose_2.26.1-4_amd64.deb
BUILDX_DEB=pool/main/d/docker-buildx/docker-buildx_0.13.1+ds1-3_amd64.deb

fail() { echo "docker engine unavailable: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "not root"
command -v apt-get >/dev/null || fail "no apt-get (not Debian)"
# the Debian archive of this machine's own apt sources (DEBIAN_MIRROR overrides): no host here
MIRROR=$("$(dirname "$0")/apt_mirror.sh") || fail "no Debian source in /etc/apt (set DEBIAN_MIRROR)"

if ! command -v dockerd >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker.io) \
    >/dev/null 2>&1 || fail "apt-get install docker.io failed"
fi

compose_ok() {
  local v
  v=$(docker compose version --short 2>/dev/null) || return 1
  v=${v#v}
  [ "${v%%.*}" -gt 2 ] || { [ "${v%%.*}" = 2 ] && [ "$(echo "$v" | cut -d. -f2)" -ge 24 ]; }
}
fetch_deb() {  # fetch_deb PACKAGE POOL_PATH DIR: the .deb into DIR/p.deb
  curl -fsSL --retry 3 -o "$3/p.deb" "$MIRROR/$2" && return 0
  # the pinned version left the pool: ask apt, with trixie in a private list (system untouched)
  echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $MIRROR trixie main" \
    >"$3/sources.list"
  mkdir -p "$3/lists/partial"
  local opts=(-qq -o "Dir::Etc::sourcelist=$3/sources.list" -o Dir::Etc::sourceparts=-
              -o "Dir::State::Lists=$3/lists")
  apt-get "${opts[@]}" update >/dev/null 2>&1 \
    && (cd "$3" && apt-get "${opts[@]}" download "$1" >/dev/null 2>&1) \
    && mv "$3"/"$1"_*.deb "$3/p.deb"
}
plugin() {  # plugin NAME POOL_PATH: unpack the .deb's cli-plugins/NAME into $PLUGINS
  local tmp rc=0
  tmp=$(mktemp -d)
  chmod 755 "$tmp"  # apt's download user must write there
  fetch_deb "$1" "$2" "$tmp" && dpkg-deb -x "$tmp/p.deb" "$tmp/x" \
    && install -D -m 0755 "$tmp/x/usr/libexec/docker/cli-plugins/$1" "$PLUGINS/$1" || rc=1
  rm -rf "$tmp"
  return $rc
}
[ "$(dpkg --print-architecture)" = amd64 ] || compose_ok || fail "plugin .debs pinned for amd64 only"
compose_ok || plugin docker-compose "$COMPOSE_DEB" || fail "cannot fetch $COMPOSE_DEB"
docker buildx version >/dev/null 2>&1 || plugin docker-buildx "$BUILDX_DEB" || fail "cannot fetch $BUILDX_DEB"
compose_ok || fail "docker compose is not >= 2.24: $(docker compose version 2>&1 | head -1)"

if ! docker info >/dev/null 2>&1; then
  for driver in overlay2 vfs; do
    dockerd --storage-driver="$driver" >>/var/log/tandem-dockerd.log 2>&1 &
    pid=$!
    for _ in $(seq 30); do
      docker info >/dev/null 2>&1 && break 2
      kill -0 "$pid" 2>/dev/null || break
      sleep 1
    done
    kill "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
  done
  docker info >/dev/null 2>&1 || fail "dockerd did not start (see /var/log/tandem-dockerd.log)"
fi
echo "docker engine $(docker info -f '{{.ServerVersion}}') ($(docker info -f '{{.Driver}}')), compose $(docker compose version --short), buildx $(docker buildx version | cut -d' ' -f2)" >&2
