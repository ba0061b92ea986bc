"""Shared fixtures: the repository's environments and a real deployment made through Ansible."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
MATRIX = REPO / "loadtests" / "kvscope" / "matrix.yaml"  # the shipped storage-config matrix
MODEL = REPO / "models" / "tiny-qwen3"
PLAYBOOK = REPO / ".venv" / "bin" / "ansible-playbook"
INVENTORY = REPO / "ansible" / "inventories" / "local"


def ansible(playbook: str, run_dir: Path, *extra: str) -> subprocess.CompletedProcess:
    """Run one of kvscope's playbooks against the local inventory with an isolated run folder."""
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    cmd = [str(PLAYBOOK), "-i", str(INVENTORY), str(REPO / "ansible" / playbook),
           "-e", f"kvscope_run_dir={run_dir}", *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def failure_of(result: subprocess.CompletedProcess) -> str:
    """What a failed play or make said: each task failure's opening (where Ansible's modules put the error,
    before the build log they append), then the output's tail."""
    failures = [line[:1500] for line in result.stdout.splitlines() if line.startswith(("fatal:", "failed:"))]
    return "\n".join([*failures, "...", result.stdout[-3000:], result.stderr[-2000:]])


def servers_of(run_dir: Path) -> dict[str, dict]:
    doc = json.loads((run_dir / "deployment.json").read_text())
    return {s["config"]: s for s in doc["servers"]}


@pytest.fixture(scope="session")
def model_dir() -> Path:
    if not (MODEL / "model.safetensors").exists():
        pytest.fail("the tiny model is missing: run `make model` (make test does it)")
    return MODEL


SESSION_CONFIGS = "baseline,control,apc,example-fs,kvscope-fs,canary"
# The session's servers listen on the matrix's ports + 100, so the tests pass beside a running `make deploy`.
SESSION_DEPLOY = ("-e", f"vllm_configs={SESSION_CONFIGS}", "-e", "vllm_port_offset=100")


def pytest_configure(config):
    # A test run started with Ctrl-C (SIGINT) ignored (a simple command run with & by sh or bash, nohup, a
    # runner) passes that on to every process it starts, and the bench chain's Ctrl-C test fails: give it back
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    config.addinivalue_line("markers", "server: starts real vLLM servers (minutes); `make test-fast` skips them")
    config.addinivalue_line("markers", "slow: real servers for longer than CI's budget allows; `make test` skips "
                                       "them, `make test-slow` runs them")


def pytest_collection_modifyitems(items):
    """Tests on the session's servers run last: the modules that deploy servers of their own (the cluster,
    the connector's) then never run beside them, nor beside a `make deploy` (memory on a 24 GiB machine).
    Of those, the ones on the CPU image run last, so that `make test` builds it beside the others."""
    items.sort(key=lambda item: ("deployment" in item.fixturenames, "cpu_image" in item.fixturenames))


@pytest.fixture(scope="session")
def deployment(tmp_path_factory, model_dir):
    """The session's servers, deployed once by the real playbook, then torn down."""
    run_dir = tmp_path_factory.mktemp("run")
    result = ansible("deploy.yml", run_dir, *SESSION_DEPLOY)
    if result.returncode != 0:
        ansible("teardown.yml", run_dir)
        pytest.fail(f"deploy failed:\n{failure_of(result)}")
    yield run_dir
    ansible("teardown.yml", run_dir)
