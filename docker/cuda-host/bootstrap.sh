#!/usr/bin/env bash
# On the CUDA host: join the parts pack.sh made, check them, unpack the site folder and make it a site dir of
# the host's Python (a .pth, so packages' own .pth hooks such as UCM's ucm_patch.pth run too).
#   docker/cuda-host/bootstrap.sh PARTS_DIR [SITE=/opt/kvscope-site]
set -euo pipefail
parts=$1; site=${2:-/opt/kvscope-site}
[ "$(cat "$parts"/site.tar.xz.* | sha256sum | cut -d' ' -f1)" = "$(cat "$parts/SHA256")" ] \
  || { echo "bootstrap: the parts do not add up to the packed archive (SHA256 differs)" >&2; exit 1; }
mkdir -p "$site" && cat "$parts"/site.tar.xz.* | xz -d | tar -x -C "$site" --strip-components=1
purelib=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "import site; site.addsitedir('$site')" > "$purelib/kvscope-site.pth"
# what the GPU configs start, LMCache's multi-process server and the exporter it imports once running among them
python3 -c 'import vllm, locust, ansible, pydantic, ucm, lmcache.v1.multiprocess.http_server
import opentelemetry.exporter.prometheus; print("vllm", vllm.__version__, "ready")'
