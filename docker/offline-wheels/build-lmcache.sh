#!/usr/bin/env bash
# Build LMCache's compiled extension (lmcache.cuda_ops and its C++ modules) against the torch a host serves
# with. PyPI's lmcache 0.5.6 wheel was built against another torch: with torch 2.11 its cuda_ops fails to
# import (undefined symbol c10::NotImplementedError) and LMCache runs a Python fallback its users do not run.
# Needs the sdist (lmcache-0.5.6.tar.gz, from PyPI), nvcc, and a Python whose torch is the serving one with
# LMCache's build tools (setuptools<81, setuptools_scm, grpcio-tools==1.78.0, ninja, wheel); no network.
#   [PYTHON=python3] [ARCHS="9.0"] [JOBS=8] docker/offline-wheels/build-lmcache.sh SDIST OUT_DIR
set -euo pipefail
sdist=$(cd "$(dirname "$1")" && pwd)/$(basename "$1"); out=$(mkdir -p "$2" && cd "$2" && pwd)
python=${PYTHON:-python3}
work=$(mktemp -d)
tar -xzf "$sdist" -C "$work"
# CUDA_HOME, else the toolkit nvcc belongs to as nvcc itself reports it (TOP: nvcc on PATH may be a wrapper
# script elsewhere, whose folder has no include/), else /usr/local/cuda
if [ -z "${CUDA_HOME:-}" ]; then
  top=$( { nvcc --dryrun -c -x cu /dev/null 2>&1 || true; } | sed -n 's/^#\$ TOP=//p' | head -1)
  CUDA_HOME=$(cd "${top:-/usr/local/cuda}" 2>/dev/null && pwd || true)
fi
[ -f "${CUDA_HOME:-}/include/cuda_runtime.h" ] \
  || { echo "build-lmcache: no CUDA toolkit found: put its nvcc on PATH or set CUDA_HOME" >&2; exit 2; }
export CUDA_HOME
export TORCH_CUDA_ARCH_LIST=${ARCHS:-9.0} MAX_JOBS=${JOBS:-8} NVCC_THREADS=1 BUILD_WITH_CUDA=1 ENABLE_CXX11_ABI=1
export LMCACHE_CUDA_MAJOR=${LMCACHE_CUDA_MAJOR:-13}
# torch's CUDA headers include cusparse.h, cublas*.h, cusolverDn.h: from the CUDA wheels torch depends on
# where the toolkit lacks them
headers=$("$python" -c 'import nvidia, os; print(next((p for d in nvidia.__path__ for p in
    [os.path.join(d, "cu13", "include")] if os.path.isdir(p)), ""))' 2>/dev/null || true)
export CPATH=${headers}${CPATH:+:$CPATH}
start=$(date +%s)
"$python" -m pip wheel -q --no-build-isolation --no-deps --no-index -w "$out" "$work"/lmcache-*/
echo "built $(ls "$out"/lmcache-*.whl) in $(( $(date +%s) - start )) s for TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST"
rm -rf "$work"
