"""Rollouts for real, on two network-namespace hosts (three took 17.5 minutes of CI): kvh1 serves the golden
baseline, and both serve kvscope-fs. `make rollout` rolls a faulty new kvscope-fs (the canary connector's
`second-hit` fault: right on a prefix's first hit, wrong from its second) and stops after host 1, which serves
its previous kvscope-fs again while kvh2 never changes; then it rolls a good new kvscope-fs (a smaller disk
tier) to both, one at a time."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import MATRIX, PLAYBOOK, REPO, failure_of

from kvscope.rollout.record import identity, load

pytestmark = [pytest.mark.server, pytest.mark.slow]  # 11.5 minutes on 2 cores: `make test-slow`

NETNS = REPO / "ansible" / "inventories" / "netns"
HOSTS_SH = REPO / "ansible" / "scripts" / "netns-hosts.sh"
HOSTS = ["kvh1", "kvh2"]


def tier_matrix(path: Path, faulty: bool) -> Path:
    """loadtests/kvscope/matrix.yaml with a new kvscope-fs: the faulty canary connector, or a disk tier of 8 GiB."""
    doc = yaml.safe_load((MATRIX).read_text())
    tier = next(c for c in doc["configs"] if c["name"] == "kvscope-fs")
    extra = tier["kv_transfer_config"]["kv_connector_extra_config"]
    if faulty:
        tier["description"] = "kvscope-fs, next version: right on a prefix's first hit, wrong from its second"
        tier["kv_transfer_config"].update(kv_connector="FaultCanary", kv_connector_module_path="kvscope_connector.canary")
        extra["fault"] = "second-hit"
    else:
        tier["description"] = "kvscope-fs, next version: a disk tier of 8 GiB"
        extra["fs_bytes"] = 8 * 2**30
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def two_hosts(folder: Path) -> Path:
    """The namespace inventory without kvh3."""
    shutil.copytree(NETNS, folder)
    doc = yaml.safe_load((folder / "hosts.yml").read_text())
    del doc["all"]["children"]["vllm_servers"]["hosts"]["kvh3"]
    (folder / "hosts.yml").write_text(yaml.safe_dump(doc))
    return folder


def playbook(name: str, run_root: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}
    cmd = [str(PLAYBOOK), "-i", str(run_root.parent / "netns"), str(REPO / "ansible" / name),
           "-e", f"kvscope_run_root={run_root}", *extra]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)


def make_rollout(run_root: Path, results: Path, matrix: Path, rollout_id: str) -> subprocess.CompletedProcess:
    """`make rollout` as a user types it (setup and the model are made already: -o keeps make from redoing them)."""
    cmd = ["make", "-o", ".venv/.installed", "-o", "models/tiny-qwen3/model.safetensors", "rollout",
           f"INVENTORY={run_root.parent / 'netns'}", "CONFIGS=kvscope-fs", f"MATRIX={matrix}", f"ROLLOUT_ID={rollout_id}",
           # a gate smaller than the default (12 repeats, 16 RAG queries, 20 verified hits): CI's time
           f"ROLLOUT_ARGS=-e kvscope_run_root={run_root} --results {results} --gate-repeats 8 --gate-queries 10 "
           "--min-hits 12"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    print(out.stdout[-6000:], out.stderr[-3000:])  # the real run's lines (docs/deploy.md shows them)
    return out


def exit_code(out: subprocess.CompletedProcess) -> int:
    """The rollout's own exit code: make exits 2 whenever a recipe fails, and names the recipe's code."""
    return 0 if out.returncode == 0 else int(re.search(r"Error (\d+)", out.stderr).group(1))


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, model_dir):
    up = subprocess.run(["bash", str(HOSTS_SH), "up", "2"], capture_output=True, text=True)
    if up.returncode != 0:
        pytest.fail(f"namespace hosts did not come up (root and openssh-server needed):\n{up.stderr}")
    run_root = tmp_path_factory.mktemp("rollout") / "runs"
    two_hosts(run_root.parent / "netns")  # its overlay.mk copied with it: make rollout reads it, as for the user's
    try:
        # kvh1: the golden baseline and kvscope-fs; kvh2: kvscope-fs (one playbook run, the hosts at once)
        configs = "{{ 'baseline,kvscope-fs' if inventory_hostname == 'kvh1' else 'kvscope-fs' }}"
        deployed = playbook("deploy.yml", run_root, "-e", f"vllm_configs={configs}")
        assert deployed.returncode == 0, failure_of(deployed)
        yield run_root
    finally:
        playbook("teardown.yml", run_root)
        subprocess.run(["bash", str(HOSTS_SH), "down"], capture_output=True)


def served(run_root: Path, host: str) -> dict:
    return {s["config"]: s for s in json.loads((run_root / host / "deployment.json").read_text())["servers"]}


def test_a_faulty_tier_stops_after_host_1_which_serves_its_previous_config_again_the_others_never_change(
        cluster, tmp_path):
    matrix = tier_matrix(tmp_path / "faulty.yaml", faulty=True)
    before = {h: served(cluster, h) for h in HOSTS}
    out = make_rollout(cluster, tmp_path / "results", matrix, "faulty")
    assert exit_code(out) == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "stopped at host 1 (kvh1): FAIL, " in out.stdout and "hits wrong, rolled back" in out.stdout
    r = load(tmp_path / "results" / "faulty")
    first = r.batches[0]
    assert first.hosts == ["kvh1"] and first.state == "rolled-back" and [b.state for b in r.batches[1:]] == ["pending"]
    gate = first.gates[0]
    assert gate.verdicts["kvscope-fs"] == "FAIL" and gate.wrong_hits > 0 and gate.verdicts["baseline"] == "GOLDEN"
    assert "FaultCanary" in json.dumps(first.after["kvh1"].servers["kvscope-fs"].manifest.server_args)
    # host 1 serves its previous kvscope-fs again: the same definition, a new process, healthy
    assert identity(first.restored["kvh1"].serving("kvscope-fs")) == identity(first.before["kvh1"].serving("kvscope-fs"))
    now = served(cluster, "kvh1")["kvscope-fs"]
    assert now["server_args"] == before["kvh1"]["kvscope-fs"]["server_args"] and now["pid"] != before["kvh1"]["kvscope-fs"]["pid"]
    assert "KVScopeConnector" in json.dumps(now["server_args"])
    # the other never changed: the same process
    assert served(cluster, "kvh2")["kvscope-fs"]["pid"] == before["kvh2"]["kvscope-fs"]["pid"]
    assert served(cluster, "kvh1")["baseline"]["pid"] == before["kvh1"]["baseline"]["pid"]
    assert "kvh2: untouched" in out.stdout
    # the record renders; re-running does not roll again
    report = subprocess.run([sys.executable, "-m", "kvscope.cli", "report", str(tmp_path / "results" / "faulty")],
                            cwd=REPO, capture_output=True, text=True, timeout=120)
    assert report.returncode == 1 and "stopped at host 1 (kvh1): FAIL" in report.stdout
    assert (tmp_path / "results" / "faulty" / first.gates[0].folder / "report.md").exists()
    again = make_rollout(cluster, tmp_path / "results", matrix, "faulty")
    assert exit_code(again) == 1 and "has finished (stopped); nothing is rolled again" in again.stdout
    assert served(cluster, "kvh1")["kvscope-fs"]["pid"] == now["pid"]


def test_a_good_tier_rolls_to_every_host_one_at_a_time_every_gate_pass(cluster, tmp_path):
    matrix = tier_matrix(tmp_path / "good.yaml", faulty=False)
    out = make_rollout(cluster, tmp_path / "results", matrix, "good")
    assert exit_code(out) == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "rolled to 2 of 2 hosts, every gate PASS" in out.stdout
    r = load(tmp_path / "results" / "good")
    assert [b.hosts for b in r.batches] == [["kvh1"], ["kvh2"]] and all(b.state == "passed" for b in r.batches)
    assert all(g.verdicts["kvscope-fs"] == "PASS" and g.verified_hits >= 12 for b in r.batches for g in b.gates)
    for h in HOSTS:
        assert f'"fs_bytes": {8 * 2**30}' in served(cluster, h)["kvscope-fs"]["server_args"][-1]
