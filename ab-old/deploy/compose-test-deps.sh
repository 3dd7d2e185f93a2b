#!/usr/bin/env bash
# What `make compose-test` needs, from the Debian archive, where missing: docker.io (when no
# Docker engine answers and no dockerd is installed) and debootstrap (for the local base image,
# unless OPENJEV_BASE_IMAGE names one). apt-get runs as root, or through passwordless sudo.
set -euo pipefail
PATH=$PATH:/usr/sbin:/sbin   # dockerd and debootstrap live there; a user's PATH may lack them
need=()
if ! command -v docker >/dev/null || { ! docker info >/dev/null 2>&1 && ! command -v dockerd >/dev/null; }; then
  need+=(docker.io)
fi
if [[ -z ${OPENJEV_BASE_IMAGE:-} ]] && ! command -v debootstrap >/dev/null; then
  need+=(debootstrap)
fi
[[ ${#need[@]} -eq 0 ]] && exit 0
if [[ $(id -u) == 0 ]]; then
  as_root=()
elif command -v sudo >/dev/null && sudo -n true 2>/dev/null; then
  as_root=(sudo -n)
else
  echo "compose-deps: ${need[*]} missing, and installing needs root: run as root, with passwordless sudo," \
    "or install them first (apt-get install ${need[*]})" >&2
  exit 1
fi
if ! command -v apt-get >/dev/null; then
  echo "compose-deps: ${need[*]} missing and no apt-get here: install a Docker engine and debootstrap" >&2
  exit 1
fi
echo "compose-deps: installing ${need[*]} from the Debian archive"
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get update -qq
"${as_root[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}"
