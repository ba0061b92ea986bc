#!/usr/bin/env bash
# Builds the GB10 image from PyPI (linux/arm64) on any Docker host, under qemu emulation where the host is
# not arm64 (qemu-user-static with binfmt_misc), then runs docker/verify_image.py inside it against the
# shipped libraries with the image's own cuobjdump. Prints the build log and the verification's table to
# stdout; exit status: the verification's. Run from anywhere: docker/gb10-pypi/build.sh (make image-gb10-pypi).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$(dirname "$here")")
pin() { awk -v k="$1:" '/^gb10-pypi:/{f=1} f && $1==k {print $2; exit}' "$repo/docker/versions.yaml"; }
echo "== base: Debian trixie arm64 from Debian's packages"
base=$("$repo/docker/base/build.sh" linux/arm64 trixie)
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
cp -al "$here/wheels" "$ctx/wheels"  # hard links: the context is assembled, not copied
cp -r "$repo/connector" "$ctx/connector"
cp "$here/Dockerfile" "$repo/docker/verify_image.py" "$ctx/"
echo "== image $tag (linux/arm64)"
docker buildx version >/dev/null 2>&1 || export DOCKER_BUILDKIT=0
if ! docker image inspect "$tag" >/dev/null 2>&1; then
  docker build --platform linux/arm64 --network host "${args[@]:1}" --tag "$tag" "$ctx"
fi
docker image inspect "$tag" --format 'image {{.Id}} {{.Architecture}} {{.Size}} bytes'
echo "== verify_image.py --arch 121 inside the image (emulated)"
docker run --rm --platform linux/arm64 --entrypoint python3 "$tag" /opt/kvscope/verify_image.py --arch 121 \
  --cuobjdump /opt/venv/lib/python3.13/site-packages/nvidia/cu13/bin/cuobjdump --without ucm=/opt/kvscope/ucm-cp312
