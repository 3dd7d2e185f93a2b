#!/usr/bin/env bash
# A python:3.11-slim stand-in made from Debian's own packages, for machines that reach Debian's
# archive and PyPI but no image registry (CI here). Users pull the public python image instead.
#   deploy/base-image/build.sh [TAG [ROOTFS]]   (root; needs a running dockerd, and debootstrap
#                                                unless ROOTFS was made before)
#   deploy/base-image/build.sh --rootfs DIR     (root; needs debootstrap, not dockerd)
# The second form makes the image's filesystem alone, into DIR (marked finished by DIR.done);
# the first imports it when ROOTFS names such a DIR (then removes it), else makes its own. CI
# makes it while `make test` runs (.ci/run), as nothing there needs the engine.
# Debian 12's python3 is 3.11, the Python the project's CPU torch wheel is built for. The
# host's CA bundle is copied in so that pip inside image builds trusts what the host trusts.
set -euo pipefail
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

make_rootfs() {
  local root=$1
  echo "debootstrap bookworm (minbase + python3) into $root"
  debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$root" "$MIRROR" >"$root.log" 2>&1 || { tail -40 "$root.log"; exit 1; }
  rm -f "$root.log"
  chmod 755 "$root"  # mktemp made it 0700: it becomes the image's / (non-root users must traverse it)
  cp /etc/ssl/certs/ca-certificates.crt "$root/etc/ssl/certs/ca-certificates.crt"
  chroot "$root" apt-get clean
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
  # `python` as in the public image (Dockerfiles and health checks run `python -m ...`), and a
  # venv on PATH: Debian's system pip refuses to install into /usr (PEP 668).
  ln -sf python3 "$root/usr/bin/python"
  chroot "$root" python3 -m venv /usr/local/python
}

if [[ ${1:-} == --rootfs ]]; then
  DIR=${2:?usage: build.sh --rootfs DIR}
  rm -rf "$DIR" "$DIR.done"
  mkdir -p "$DIR"
  make_rootfs "$DIR"
  touch "$DIR.done"
  exit 0
fi
TAG=${1:-openjev-base:bookworm}
if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG exists"
  # a finished filesystem handed in is not needed: removed, as an import would have
  if [[ -n ${2:-} && -f $2.done ]]; then rm -rf "$2" "$2.done"; fi
  exit 0
fi
if [[ -n ${2:-} && -f $2.done ]]; then
  ROOT=$2
  echo "the filesystem made before in $ROOT"
  trap 'rm -rf "$ROOT" "$ROOT.done"' EXIT
else
  ROOT=$(mktemp -d /var/tmp/openjev-base.XXXXXX)
  trap 'rm -rf "$ROOT"' EXIT
  make_rootfs "$ROOT"
fi
tar -C "$ROOT" -c . | docker import \
  --change 'ENV PATH=/usr/local/python/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' - "$TAG"
echo "base image $TAG built"
