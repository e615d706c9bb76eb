#!/usr/bin/env bash
# Build a stand-in for `python:3.11-slim` from Debian packages, for machines where Docker Hub
# cannot be reached but the Debian mirrors can (the Dockerfile takes it as BASE_IMAGE):
#
#   scripts/debian_base_image.sh [TAG]        # default tag: tandem-base:bookworm
#   docker build --build-arg BASE_IMAGE=tandem-base:bookworm ...
#
# `debootstrap --variant=minbase bookworm` with python3 (3.11), python3-venv and ca-certificates,
# then `docker import`. The host's extra CA certificates (/usr/local/share/ca-certificates, e.g. a
# TLS-intercepting proxy's) are added to the image's trust store and pip is pointed at it, so
# `pip install` inside the build reaches PyPI as the host does. An existing TAG is kept (delete
# it to rebuild). Needs root, debootstrap and a running Docker engine.
set -euo pipefail
TAG=${1:-tandem-base:bookworm}
# the Debian archive of this machine's own apt sources (DEBIAN_MIRROR overrides): no host here
MIRROR=$("$(dirname "$0")/apt_mirror.sh") || { echo "no Debian source in /etc/apt (set DEBIAN_MIRROR)" >&2; exit 1; }
if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG already present" >&2
  exit 0
fi
command -v debootstrap >/dev/null || {
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq debootstrap >/dev/null
}
ROOT=$(mktemp -d /var/tmp/tandem-base.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
  bookworm "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 || { tail -20 "$ROOT.log" >&2; exit 1; }
rm -f "$ROOT.log"
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$ROOT/usr/local/share/ca-certificates/"
  chroot "$ROOT" update-ca-certificates >/dev/null
fi
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin
tar -C "$ROOT" -c . | docker import \
  --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' - "$TAG" >/dev/null
echo "built base image $TAG ($(docker image inspect -f '{{.Size}}' "$TAG") bytes)" >&2
