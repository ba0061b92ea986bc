#!/usr/bin/env bash
# Downloads every wheel the GB10 image from PyPI installs into docker/gb10-pypi/wheels: linux/arm64, Python
# 3.13 (Debian trixie's), from PyPI alone (--isolated: no local pip configuration or mirror). UCM's aarch64
# wheel exists only for CPython 3.12, so it lands in wheels/ucm-cp312 (inspected for kernels, not installed).
# pip evaluates `python_version` markers with the host's Python, not 3.13: vLLM's and LMCache's
# Python > 3.11 requirements (six, setuptools < 81) are named here.
set -euo pipefail
cd "$(dirname "$0")"
source ./pins.sh
pip_download() { "${PYTHON:-python3}" -m pip --isolated download --quiet --only-binary=:all: \
  --index-url "${PYPI_INDEX:-https://pypi.org/simple}" --implementation cp "${platforms[@]}" "$@"; }
pip_download --dest wheels --python-version 3.13 --abi cp313 --abi abi3 --abi none \
  "torch==$(pin TORCH_VERSION)" "vllm==$(pin VLLM_VERSION)" "lmcache==$(pin LMCACHE_VERSION)" \
  "nvidia-cuda-cuobjdump==$(pin CUOBJDUMP_VERSION)" safetensors xxhash "setuptools>=77.0.3,<81" wheel six
pip_download --dest wheels/ucm-cp312 --no-deps --python-version 3.12 --abi cp312 \
  "uc-manager-cuda-cu130==$(pin UCM_VERSION)"
echo "docker/gb10-pypi/wheels: $(find wheels -name '*.whl' | wc -l) wheels, $(du -sh wheels | cut -f1)"
