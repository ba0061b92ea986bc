#!/usr/bin/env bash
# On the CUDA host: for each set pack.sh made (a folder of parts under PARTS_DIR), join its parts, check them
# and unpack them into one site folder; make that folder a site dir of the host's Python (a .pth, so
# packages' own .pth hooks such as UCM's ucm_patch.pth run too); install PARTS_DIR/wheels/*.whl over them
# (e.g. an LMCache built for the host's torch); then import what the sets serve (IMPORTS).
#   docker/cuda-host/bootstrap.sh PARTS_DIR [SITE=/opt/kvscope-site]
set -euo pipefail
parts=$1; site=${2:-/opt/kvscope-site}
imports=()
mkdir -p "$site"
for set in "$parts"/*/; do
  [ -f "$set/SHA256" ] || continue
  [ "$(cat "$set"/site.tar.xz.* | sha256sum | cut -d' ' -f1)" = "$(cat "$set/SHA256")" ] \
    || { echo "bootstrap: the parts of $set do not add up to the packed archive (SHA256 differs)" >&2; exit 1; }
  cat "$set"/site.tar.xz.* | xz -d -T0 | tar -x -C "$site" --strip-components=1
  read -ra more < "$set/IMPORTS" && imports+=("${more[@]}")
  echo "bootstrap: unpacked $(basename "$set")"
done
[ ${#imports[@]} -gt 0 ] || { echo "bootstrap: no packed set under $parts" >&2; exit 1; }
for wheel in "$parts"/wheels/*.whl; do
  [ -f "$wheel" ] || continue
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$wheel"
  echo "bootstrap: installed $(basename "$wheel") over the packed sets"
done
purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$site')" > "$purelib/kvscope-site.pth"
python3 -c 'import importlib, sys, vllm
for name in sys.argv[1:]:
    importlib.import_module(name)
print("vllm", vllm.__version__, "ready:", ", ".join(sys.argv[1:]))' "${imports[@]}"
