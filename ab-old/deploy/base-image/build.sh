#!/usr/bin/env bash
# A python:3.11-slim stand-in made from Debian's own packages, for machines that reach Debian's
# archive and PyPI but no image registry (CI here). Users pull the public python image instead.
#   deploy/base-image/build.sh [TAG]      (root; needs debootstrap and a running dockerd)
# Debian 12's python3 is 3.11, the Python the project's CPU torch wheel is built for. The
# host's CA bundle is copied in so that pip inside image builds trusts what the host trusts.
set -euo pipefail
TAG=${1:-openjev-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG exists"; exit 0
fi
ROOT=$(mktemp -d /var/tmp/openjev-base.XXXXXX)
trap 'rm -rf "$ROOT"' EXIT
echo "debootstrap bookworm (minbase + python3) into $ROOT"
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
  bookworm "$ROOT" "$MIRROR" >"$ROOT.log" 2>&1 || { tail -40 "$ROOT.log"; exit 1; }
rm -f "$ROOT.log"
chmod 755 "$ROOT"  # mktemp made it 0700: it becomes the image's / (non-root users must traverse it)
cp /etc/ssl/certs/ca-certificates.crt "$ROOT/etc/ssl/certs/ca-certificates.crt"
chroot "$ROOT" apt-get clean
rm -rf "$ROOT"/var/lib/apt/lists/* "$ROOT"/var/cache/apt/*.bin
# `python` as in the public image (Dockerfiles and health checks run `python -m ...`), and a
# venv on PATH: Debian's system pip refuses to install into /usr (PEP 668).
ln -sf python3 "$ROOT/usr/bin/python"
chroot "$ROOT" python3 -m venv /usr/local/python
tar -C "$ROOT" -c . | docker import \
  --change 'ENV PATH=/usr/local/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' - "$TAG"
echo "base image $TAG built"
