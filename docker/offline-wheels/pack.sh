#!/usr/bin/env bash
# Pack the wheel lists into an offline install for a CUDA host with no registry, one set at a time: a site
# folder per set (pip --target for Python 3.12 / x86_64), xz-compressed and split into parts small enough for
# one transfer each, and the modules bootstrap.sh checks. Sets: `base` (wheels.txt: vLLM, the harness,
# Ansible) and `connectors` (wheels-connectors.txt: UCM, LMCache; with LMCACHE_WHEEL=path, that LMCache wheel,
# e.g. one built for the host's torch, replaces PyPI's). Each set is packed on its own, so one can be
# re-packed without the other. STACK names the torch and vLLM that serve (stacks/STACK.txt, default vllm0.26:
# the host's torch): a stack's pins replace wheels.txt's of the same name and go as a third set, `stack`, of the
# wheels as published (re-compressing them saves little), which bootstrap.sh installs in front of the host's
# packages.
#   [STACK=vllm0.26|vllm0.28|vllm0.34] [SETS="base connectors stack"] [LMCACHE_WHEEL=path] \
#     docker/offline-wheels/pack.sh [OUT=.device] [PART_MIB=20]
#   STACK=... docker/offline-wheels/pack.sh --list base|connectors|stack   (the pins a set packs; nothing downloaded)
set -euo pipefail
out=${1:-.device}; part_mib=${2:-20}
here=$(cd "$(dirname "$0")" && pwd)
stack=${STACK:-vllm0.26}; stack_list="$here/stacks/$stack.txt"
[ -f "$stack_list" ] || { echo "pack.sh: no stack $stack ($(cd "$here/stacks" && ls | sed 's/.txt$//' | xargs))" >&2; exit 2; }
pins() { grep -v '^#' "$1" | grep . || true; }
pin_names() { pins "$1" | sed 's/==.*//' | tr 'A-Z_' 'a-z-'; }
plat=(--python-version 3.12 --implementation cp --only-binary=:all: --platform any)
for p in manylinux_2_{5,17,18,24,27,28,31,34,35}_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done

set_pins() {  # set_pins NAME: what a set packs (the stack's pins replace wheels.txt's of the same name)
  case $1 in
    base) pins "$here/wheels.txt" | awk -F== -v drop="$(pin_names "$stack_list" | xargs)" \
      'BEGIN { n = split(drop, d, " "); for (i = 1; i <= n; i++) skip[d[i]] = 1 }
        { k = tolower($1); gsub("_", "-", k); if (!(k in skip)) print }' ;;
    connectors) pins "$here/wheels-connectors.txt" | { if [ -n "${LMCACHE_WHEEL:-}" ]; then grep -v '^lmcache=='; else cat; fi; } ;;
    stack) pins "$stack_list" ;;
    *) echo "pack.sh: unknown set $1 (base, connectors, stack)" >&2; exit 2 ;;
  esac
}
if [ "$out" = --list ]; then set_pins "${2:?pack.sh --list SET}"; exit; fi

pack_set() {  # pack_set NAME IMPORTS
  local name=$1 imports=$2 work="$out/$1" parts="$out/parts/$1"
  rm -rf "$work" "$parts" && mkdir -p "$work/whl" "$parts"  # only this list, no wheels of an older one
  set_pins "$name" | xargs python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/whl"
  if [ "$name" = connectors ] && [ -n "${LMCACHE_WHEEL:-}" ]; then cp "$LMCACHE_WHEEL" "$work/whl/"; fi
  # linux_x86_64: the tag of a wheel built here (build-lmcache.sh's); downloads stay manylinux
  python3 -m pip install -q --no-deps --no-compile --target "$work/site" "${plat[@]}" --platform linux_x86_64 \
    "$work"/whl/*.whl
  if [ "$name" = base ]; then
    # The playbooks' collections (ansible.posix for NFS mounts, community.docker for containers), from the
    # harness venv's `ansible` package (make setup): the whole package would be ~50 MB more.
    local cols; cols=$("$here/../../.venv/bin/python" -c 'import ansible_collections; print(list(ansible_collections.__path__)[0])')
    for c in ansible/posix community/docker; do
      mkdir -p "$work/site/ansible_collections/$c" && cp -a "$cols/$c/." "$work/site/ansible_collections/$c/"
    done
  fi
  echo "packing $name: $(du -sh "$work/site" | cut -f1) unpacked"
  tar -C "$work" -cf - site | xz -T0 -6 > "$work/site.tar.xz"
  local size n
  size=$(stat -c %s "$work/site.tar.xz"); n=$(( (size + part_mib * 1048576 - 1) / (part_mib * 1048576) ))
  split -n "$n" -d "$work/site.tar.xz" "$parts/site.tar.xz."
  sha256sum "$work/site.tar.xz" | cut -d' ' -f1 > "$parts/SHA256"
  echo "$imports" > "$parts/IMPORTS"
  ls -l "$parts"
}

pack_stack() {  # the stack's wheels as published, split into parts; bootstrap.sh pip-installs them
  local work="$out/stack" parts="$out/parts/stack"
  rm -rf "$work" "$parts" && mkdir -p "$work/whl" "$parts"
  set_pins stack | xargs python3 -m pip download -q --no-deps "${plat[@]}" -d "$work/whl"
  tar -C "$work/whl" -cf "$work/wheels.tar" .
  local size n
  size=$(stat -c %s "$work/wheels.tar"); n=$(( (size + part_mib * 1048576 - 1) / (part_mib * 1048576) ))
  split -n "$n" -d "$work/wheels.tar" "$parts/wheels.tar."
  sha256sum "$work/wheels.tar" | cut -d' ' -f1 > "$parts/SHA256"
  echo torch > "$parts/IMPORTS"
  echo "$stack" > "$parts/STACK"
  pins "$stack_list" > "$parts/PINS"
  ls -l "$parts"
}

default_sets="base connectors"; [ -n "$(pins "$stack_list")" ] && default_sets+=" stack"
mkdir -p "$out/parts" && echo "$stack" > "$out/parts/STACK"
for set in ${SETS:-$default_sets}; do
  case $set in
    stack) pack_stack ;;
    base) pack_set base "vllm locust ansible pydantic" ;;
    # LMCache's multi-process server and the exporter it imports once running among them
    connectors) pack_set connectors \
      "ucm lmcache.v1.multiprocess.http_server opentelemetry.exporter.prometheus" ;;
    *) set_pins "$set" ;;  # refuses it
  esac
done
