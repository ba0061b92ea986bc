#!/usr/bin/env bash
# On the CUDA host: for each set pack.sh made (a folder of parts under PARTS_DIR), join its parts, check them
# and unpack them into one site folder; make that folder a site dir of the host's Python (a .pth, so
# packages' own .pth hooks such as UCM's ucm_patch.pth run too); install PARTS_DIR/wheels/*.whl over them
# (e.g. an LMCache built for the host's torch); then import what the sets serve (IMPORTS). A `stack` set
# (pack.sh STACK=...: torch and vLLM other than the host's) is pip-installed into SITE-stack, which the .pth
# puts in front of the host's own packages, and the GPU is checked under it (a bf16 matrix product, NCCL's
# version) before anything else imports.
#   docker/offline-wheels/bootstrap.sh PARTS_DIR [SITE=/opt/kvscope-site]
#   docker/offline-wheels/bootstrap.sh --pth SHADOW SITE   (the .pth it writes; nothing installed)
set -euo pipefail
site_pth() {  # site_pth SHADOW SITE: the stack first on sys.path (its torch shadows the host's), the sets after
  # the host's packages. The stack's folder goes in front before its own .pth files run (one may import), and
  # whatever they add, appended or inserted anywhere (nvidia-cutlass-dsl's inserts at 0), goes in front too.
  [ -d "$1" ] && echo "import site, sys; old = set(sys.path); sys.path.insert(0, '$1'); site.addsitedir('$1'); sys.path[:] = [p for p in sys.path if p not in old] + [p for p in sys.path if p in old]"
  echo "import site; site.addsitedir('$2')"
}
if [ "${1:-}" = --pth ]; then site_pth "$2" "$3"; exit; fi
parts=$1; site=${2:-/opt/kvscope-site}; shadow=$site-stack
imports=()
mkdir -p "$site"
rm -rf "$shadow"  # a stack of an earlier bootstrap never shadows this one's
for set in "$parts"/*/; do
  [ -f "$set/SHA256" ] || continue
  if [ -f "$set/STACK" ]; then
    [ "$(cat "$set"/wheels.tar.* | sha256sum | cut -d' ' -f1)" = "$(cat "$set/SHA256")" ] \
      || { echo "bootstrap: the parts of $set do not add up to the packed wheels (SHA256 differs)" >&2; exit 1; }
    tmp=$(mktemp -d) && cat "$set"/wheels.tar.* | tar -x -C "$tmp"
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$shadow" "$tmp"/*.whl && rm -rf "$tmp"
    echo "bootstrap: installed stack $(cat "$set/STACK") in front of the host's packages: $(xargs < "$set/PINS")"
    continue
  fi
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
site_pth "$shadow" "$site" > "$purelib/kvscope-site.pth"
if [ -d "$shadow" ]; then
  python3 -c 'import torch
assert torch.__file__.startswith(__import__("sys").argv[1]), f"torch {torch.__version__} from {torch.__file__}, not the stack"
x = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16)
assert torch.isfinite((x @ x).float().sum()).item()
print("bootstrap: torch", torch.__version__, "CUDA", torch.version.cuda, "NCCL", ".".join(map(str, torch.cuda.nccl.version())),
      "on", torch.cuda.get_device_name())' "$shadow"
fi
python3 -c 'import importlib, sys, vllm
for name in sys.argv[1:]:
    importlib.import_module(name)
print("vllm", vllm.__version__, "ready:", ", ".join(sys.argv[1:]))' "${imports[@]}"
