#!/usr/bin/env bash
# Pack wheels.txt (and wheels-connectors.txt, unless CONNECTORS=0) into an offline install for a CUDA host
# with no registry: a site folder (pip --target for Python 3.12 / x86_64), xz-compressed and split into parts
# small enough for one transfer each, and the list of modules bootstrap.sh checks.
#   [CONNECTORS=0] docker/cuda-host/pack.sh [OUT=.device] [PART_MIB=20]
set -euo pipefail
out=${1:-.device}; part_mib=${2:-20}
here=$(cd "$(dirname "$0")" && pwd)
lists=("$here/wheels.txt"); imports="vllm locust ansible pydantic"
if [ "${CONNECTORS:-1}" != 0 ]; then
  lists+=("$here/wheels-connectors.txt")
  # LMCache's multi-process server and the exporter it imports once running among them
  imports+=" ucm lmcache.v1.multiprocess.http_server opentelemetry.exporter.prometheus"
fi
plat=(--python-version 3.12 --implementation cp --only-binary=:all: --platform any)
for p in manylinux_2_{5,17,24,27,28,31,34,35}_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do plat+=(--platform "$p"); done
rm -rf "$out/whl" && mkdir -p "$out/whl" "$out/parts"  # only these lists, no wheels of an older one
cat "${lists[@]}" | grep -v '^#' | grep . | xargs python3 -m pip download -q --no-deps "${plat[@]}" -d "$out/whl"
rm -rf "$out/site"
python3 -m pip install -q --no-deps --no-compile --target "$out/site" "${plat[@]}" "$out"/whl/*.whl
# The playbooks' collections (ansible.posix for NFS mounts, community.docker for containers), from the harness
# venv's `ansible` package (make setup): the whole package would be ~50 MB more, Galaxy may be unreachable.
harness=$(cd "$here/../.." && pwd)/.venv
cols=$("$harness/bin/python" -c 'import ansible_collections; print(list(ansible_collections.__path__)[0])')
for c in ansible/posix community/docker; do
  mkdir -p "$out/site/ansible_collections/$c" && cp -a "$cols/$c/." "$out/site/ansible_collections/$c/"
done
tar -C "$out" -cf - site | xz -T0 -6 > "$out/site.tar.xz"
rm -f "$out"/parts/site.tar.xz.*
size=$(stat -c %s "$out/site.tar.xz"); n=$(( (size + part_mib * 1048576 - 1) / (part_mib * 1048576) ))
split -n "$n" -d "$out/site.tar.xz" "$out/parts/site.tar.xz."
sha256sum "$out/site.tar.xz" | cut -d' ' -f1 > "$out/parts/SHA256"
echo "$imports" > "$out/parts/IMPORTS"
ls -l "$out/parts"
