#!/usr/bin/env bash
# Builds the GB10 image from PyPI (linux/arm64) on any Docker host: the packages are installed here with
# pip's cross-platform install, the image's own steps and docker/verify_image.py run under qemu emulation
# where the host is not arm64 (qemu-user-static with binfmt_misc); the check reads the shipped libraries
# with the image's own cuobjdump. Prints the build log and the verification's table to
# stdout; exit status: the verification's. Run from anywhere: docker/gb10-pypi/build.sh (make image-gb10-pypi).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$(dirname "$here")")
source "$here/pins.sh"
echo "== base: Debian trixie arm64 from Debian's packages"
base=${KVSCOPE_BASE:-$("$repo/docker/base/build.sh" linux/arm64 trixie)}  # KVSCOPE_BASE: one made before
echo "$base"
echo "== wheels: PyPI, linux/arm64, CPython 3.13"
[ -f "$here/wheels/torch-$(pin TORCH_VERSION)-cp313-cp313-manylinux_2_28_aarch64.whl" ] || "$here/wheelhouse.sh"
info=$(cd "$repo" && "${PYTHON:-.venv/bin/python}" -m kvscope.plumbing image-info --image gb10-pypi --base "$base")
mapfile -t args < <(python3 -c 'import json, sys
d = json.load(sys.stdin)
print("kvscope/kvscope-gb10-pypi:" + d["tag"])
print("\n".join([f"--build-arg={k}={v}" for k, v in d["build_args"].items()]
                + [f"--label={k}={v}" for k, v in d["labels"].items()]))' <<< "$info")
tag=${args[0]}
ctx=$(mktemp -d)
trap 'rm -rf "$ctx"' EXIT
echo "== install for linux/arm64, CPython 3.13, on this host (pip's cross-platform install, no emulation)"
# pip checks Requires-Python against the host's Python, not 3.13: the target's is given and checked by tags
"${PYTHON_HOST:-python3}" -m pip --isolated install --quiet --no-index --find-links "$here/wheels" \
  --target "$ctx/site" --only-binary=:all: --python-version 3.13 --implementation cp --abi cp313 \
  "${platforms[@]}" --ignore-requires-python --no-compile \
  "torch==$(pin TORCH_VERSION)" "vllm==$(pin VLLM_VERSION)" "lmcache==$(pin LMCACHE_VERSION)" \
  "nvidia-cuda-cuobjdump==$(pin CUOBJDUMP_VERSION)" six safetensors xxhash  # safetensors: vLLM's loader; xxhash: the connector's
cp -r "$repo/connector" "$ctx/connector-src"  # pip builds in the source folder: a copy keeps the checkout clean
"${PYTHON_HOST:-python3}" -m pip --isolated install --quiet --no-index --find-links "$here/wheels" --no-deps \
  --target "$ctx/connector" "$ctx/connector-src"
cp -r "$ctx/connector/." "$ctx/site/"
rm -rf "$ctx"/site/{torchvision,torchaudio,torchcodec}* "$ctx/site/bin"  # vLLM's media extras; host scripts
"${PYTHON_HOST:-python3}" -m zipfile -e \
  "$here/wheels/ucm-cp312/uc_manager_cuda_cu130-$(pin UCM_VERSION)-cp312-cp312-manylinux_2_28_aarch64.whl" "$ctx/ucm-cp312"
cp "$here/Dockerfile" "$repo/docker/verify_image.py" "$ctx/"
du -sh "$ctx/site"
echo "== image $tag (linux/arm64)"
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0
if ! docker image inspect "$tag" >/dev/null 2>&1; then
  docker build --platform linux/arm64 --network host "${args[@]:1}" --tag "$tag" "$ctx"
fi
docker image inspect "$tag" --format 'image {{.Id}} {{.Architecture}} {{.Size}} bytes'
echo "== verify_image.py --arch 121 inside the image (emulated)"
docker run --rm --platform linux/arm64 --entrypoint python3 "$tag" /opt/kvscope/verify_image.py --arch 121 \
  --cuobjdump /opt/venv/lib/python3.13/site-packages/nvidia/cu13/bin/cuobjdump --without ucm=/opt/kvscope/ucm-cp312
