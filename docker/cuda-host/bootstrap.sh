#!/usr/bin/env bash
# On the CUDA host: join the parts pack.sh made, check them, unpack the site folder and make it a site dir of
# the host's Python (a .pth, so packages' own .pth hooks such as UCM's ucm_patch.pth run too), then import
# what the packed set serves (the parts' IMPORTS).
#   docker/cuda-host/bootstrap.sh PARTS_DIR [SITE=/opt/kvscope-site]
set -euo pipefail
parts=$1; site=${2:-/opt/kvscope-site}
[ "$(cat "$parts"/site.tar.xz.* | sha256sum | cut -d' ' -f1)" = "$(cat "$parts/SHA256")" ] \
  || { echo "bootstrap: the parts do not add up to the packed archive (SHA256 differs)" >&2; exit 1; }
mkdir -p "$site" && cat "$parts"/site.tar.xz.* | xz -d -T0 | tar -x -C "$site" --strip-components=1
purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$site')" > "$purelib/kvscope-site.pth"
python3 -c 'import importlib, sys, vllm
for name in sys.argv[1:]:
    importlib.import_module(name)
print("vllm", vllm.__version__, "ready:", ", ".join(sys.argv[1:]))' $(cat "$parts/IMPORTS")
