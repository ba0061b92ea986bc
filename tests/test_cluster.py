"""The cluster path for real, on one machine: network-namespace hosts with their own sshd, the process runtime
deployed over SSH to two of them (rollouts on them: tests/test_rollout_cluster.py), Locust's distributed mode with a
worker on each host and the master here, the records and logs collected to the controller, and teardown."""

from __future__ import annotations

import csv
import json
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import PLAYBOOK, REPO, failure_of

from kvscope.run.records import read
from kvscope.runfolder import RunFolder

pytestmark = pytest.mark.server

NETNS = REPO / "ansible" / "inventories" / "netns"
HOSTS_SH = REPO / "ansible" / "scripts" / "netns-hosts.sh"
SSH_CONFIG = Path("/var/lib/kvscope/netns/config")
# One server a host, for CI's time (the inventory's host_vars give each two): golden on kvh1, the RAM tier on kvh2
# (its only real-server test; apc and kvscope-fs serve the session's tests in test_bench.py and test_deploy.py)
DEPLOY_ONE_A_HOST = ("-e", """{"vllm_configs": "{{ {'kvh1': 'baseline', 'kvh2': 'kvscope-ram'}[inventory_hostname] }}"}""")
SMALL = """scenarios:
  - name: rag-small
    kind: rag
    num_docs: 6
    doc_tokens_median: 120
    docs_per_query: 2
    num_queries: 8
"""


def playbook(name: str, run_root, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    cmd = [str(PLAYBOOK), "-i", str(NETNS), str(REPO / "ansible" / name), "-e", f"kvscope_run_root={run_root}", *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def hosts():
    up = subprocess.run(["bash", str(HOSTS_SH), "up"], capture_output=True, text=True)
    if up.returncode != 0:
        pytest.fail(f"namespace hosts did not come up (root and openssh-server needed):\n{up.stderr}")
    yield
    subprocess.run(["bash", str(HOSTS_SH), "down"], capture_output=True)


def test_the_test_hosts_keep_keys_root_owned_outside_the_work_tree_and_check_host_keys(hosts):
    state = SSH_CONFIG.parent
    assert not state.is_relative_to(REPO) and not (REPO / "runs" / "netns" / "ssh").exists()
    mode = state.stat()
    assert mode.st_uid == 0 and stat.S_IMODE(mode.st_mode) == 0o700
    assert not any("StrictModes no" in p.read_text() for p in state.glob("sshd_*.conf"))
    assert "StrictHostKeyChecking yes" in SSH_CONFIG.read_text() and "/dev/null" not in SSH_CONFIG.read_text()
    known = (state / "known_hosts").read_text()
    assert "kvh1,10.77.0.11 ssh-ed25519 " in known and "kvh2,10.77.0.12 ssh-ed25519 " in known
    ok = subprocess.run(["ssh", "-F", str(SSH_CONFIG), "kvh1", "true"], capture_output=True, text=True, timeout=30)
    assert ok.returncode == 0, ok.stderr


def test_deploy_bench_with_distributed_locust_collect_and_teardown_across_hosts(hosts, tmp_path, model_dir):
    run_root = tmp_path / "runs"
    try:
        result = playbook("deploy.yml", run_root, "--limit", "kvh1,kvh2", *DEPLOY_ONE_A_HOST)  # not kvh3 (the control)
        assert result.returncode == 0, failure_of(result)
        deployments = [run_root / h / "deployment.json" for h in ("kvh1", "kvh2")]
        where = {s["config"]: s["host"] for d in deployments for s in json.loads(d.read_text())["servers"]}
        assert where == {"baseline": "10.77.0.11", "kvscope-ram": "10.77.0.12"}
        status = playbook("status.yml", run_root)  # `make status INVENTORY=...`: every host's servers
        assert status.returncode == 0 and all(re.search(rf"{c}\s+port \d+\s+pid \d+\s+healthy", status.stdout)
                                              for c in where), status.stdout[-3000:]

        (tmp_path / "small.yaml").write_text(SMALL)
        bench = subprocess.run(
            [sys.executable, "-m", "kvscope.cli", "bench", "--deployment", ",".join(map(str, deployments)),
             "--results", str(tmp_path / "results"), "--scenarios-file", str(tmp_path / "small.yaml"),
             "--scenarios", "rag-small", "--users", "2", "--run-id", "cluster", "--report", "--min-hits", "3",
             "--inventory", str(NETNS)],  # its Locust workers, ssh config and master address, as make bench's
            cwd=REPO, capture_output=True, text=True, timeout=1200)
        assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
        folder = tmp_path / "results" / "cluster"
        for config in where:
            recs = [r for r in read(folder / "records" / f"{config}__rag-small.jsonl") if r.phase == "measure"]
            assert len(recs) == 8 and all(r.ok for r in recs)
            assert {r.worker for r in recs} == {0, 1}  # both hosts' workers sent load, the master wrote it
        with open(folder / "verdicts.csv") as f:
            verdicts = {row["config"]: row["verdict"] for row in csv.DictReader(f)}
        assert verdicts == {"baseline": "GOLDEN", "kvscope-ram": "PASS"}

        result = playbook("collect.yml", run_root, "-e", f"collect_to={folder}")
        assert result.returncode == 0, result.stdout[-3000:]
        assert RunFolder(folder).host("kvh1").server("baseline").manifest.exists()
        assert RunFolder(folder).host("kvh2").server("kvscope-ram").log.exists()
    finally:
        result = playbook("teardown.yml", run_root)
    assert result.returncode == 0, result.stdout[-3000:]
    assert not list(run_root.glob("*/*/server.pid"))
