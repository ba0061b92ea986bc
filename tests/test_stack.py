"""The serving stack: which torch and vLLM a CUDA host serves with, and what a run records of it."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO

from kvscope.deploy.servers import package_versions


def test_the_versions_recorded_name_the_cuda_its_torch_was_built_for(tmp_path):
    # torch/version.py is read, not imported: a torch that cannot import still says which build it is
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise ImportError('not on this machine')\n")
    (tmp_path / "torch" / "version.py").write_text("__version__ = '2.13.0'\ncuda: Optional[str] = '13.0'\n")
    found = package_versions(f"env PYTHONPATH={tmp_path} {sys.executable}")
    assert found["torch-cuda"] == "13.0"
    assert "torch-cuda" not in package_versions(str(REPO / ".venv-vllm" / "bin" / "python"))  # the CPU build: None


def pack_list(stack: str, part: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", REPO / "docker" / "offline-wheels" / "pack.sh", "--list", part],
                          env={"STACK": stack, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, timeout=60)


def test_a_stack_replaces_the_base_sets_pins_of_the_same_name_and_adds_its_own_set():
    base = pack_list("vllm0.28", "base")
    assert base.returncode == 0, base.stderr
    assert not any(line.lower().startswith(("vllm==", "torch==", "apache-tvm-ffi==")) for line in base.stdout.split())
    assert "locust==2.47.0" in base.stdout.split()  # the rest of wheels.txt stays
    stack = pack_list("vllm0.28", "stack").stdout.split()
    assert {"vllm==0.28.0", "torch==2.13.0", "triton==3.7.1", "nvidia-nccl-cu13==2.29.7"} <= set(stack)
    host = pack_list("vllm0.26", "base").stdout.split()
    assert "vllm==0.26.0" in host and pack_list("vllm0.26", "stack").stdout.split() == []  # the host's torch
    unknown = pack_list("vllm9", "base")
    assert unknown.returncode == 2 and "no stack vllm9 (vllm0.26 vllm0.28 vllm0.34)" in unknown.stderr


def test_the_stacks_torch_shadows_the_hosts_even_when_a_stack_pth_inserts_at_the_front(tmp_path):
    # vLLM 0.34's stack ships nvidia-cutlass-dsl, whose .pth does sys.path.insert(0, ...): with the stack's
    # entries taken as "what addsitedir appended", the host's last entry went in front and the servers of an
    # H100 run (2026-12-06) imported the host's torch 2.11 under vLLM 0.34
    for where, version in (("purelib", "2.11"), ("stack", "2.14")):  # the host's torch beside the .pth, as there
        (tmp_path / where / "torch").mkdir(parents=True)
        (tmp_path / where / "torch" / "__init__.py").write_text(f"__version__ = '{version}'\n")
    (tmp_path / "stack" / "cutlass_dsl.pth").write_text(
        f"import sys; sys.path.insert(0, {str(tmp_path / 'dsl')!r})\n")
    pth = subprocess.run(["bash", REPO / "docker" / "offline-wheels" / "bootstrap.sh", "--pth", tmp_path / "stack",
                          tmp_path / "site"], capture_output=True, text=True, timeout=60)
    assert pth.returncode == 0, pth.stderr
    (tmp_path / "purelib" / "kvscope-site.pth").write_text(pth.stdout)
    code = f"import site; site.addsitedir({str(tmp_path / 'purelib')!r}); import torch; print(torch.__version__)"
    out = subprocess.run([sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.split() == ["2.14"], out.stderr
