"""The bench's plan, typed: `kvscope bench --plan`, the Locust spec file, and the command lines' shared helpers.
Nothing here starts a server."""

from __future__ import annotations

import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from kvscope import auth, cli
from kvscope.artifacts import Deployment, Manifest, Treatment, read_json, write_json
from kvscope.run import locustspec, orphans, treatments
from kvscope.run.locustspec import LocustSpec, LocustWorkers


def test_the_plumbing_the_ansible_roles_call_stands_on_no_part_of_the_users_cli():
    probe = "import sys, kvscope.plumbing; print(sorted(m for m in sys.modules if m == 'kvscope.cli'))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


# --- Locust reads one spec file ------------------------------------------------------------------------------


def treatment(config: str = "canary-shift", role: str = "canary", fault: str | None = "shift") -> Treatment:
    return Treatment(config=config, fault=fault, manifest=Manifest(
        config="canary", role=role, port=8123, platform="endpoint", served_model_name="m", server_args=[],
        vllm_version=None, kv_capacity_tokens=None, block_size=16, prefix_caching=False, model_path="/nowhere",
        model_hash="served:m", store_reset="keep"))


POPEN = subprocess.Popen


class Ran:
    """What run_locust started, instead of starting it: the master's command and each worker's ssh command."""

    def __init__(self, monkeypatch):
        self.master: list[str] = []
        self.workers: list[list[str]] = []
        monkeypatch.setattr(treatments.subprocess, "run", self.run)
        monkeypatch.setattr(treatments.subprocess, "Popen", self.popen)

    def run(self, cmd, **kw):
        self.master = cmd
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def popen(self, cmd, **kw):
        self.workers.append(cmd)
        return POPEN(["true"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def kvscope_options(cmd: list[str]) -> list[str]:
    return [a for a in cmd if a.startswith("--kvscope-")]


def test_locust_gets_one_spec_file_and_no_other_kvscope_option(tmp_path, monkeypatch):
    ran = Ran(monkeypatch)
    treatments.run_locust(treatment(), tmp_path / "w.jsonl", tmp_path / "r.jsonl", 4, 3, 2.5, 60,
                          spec=tmp_path / "locust" / "x.spec.json")
    assert kvscope_options(ran.master) == [locustspec.FLAG]
    path = Path(ran.master[ran.master.index(locustspec.FLAG) + 1])
    assert path == tmp_path / "locust" / "x.spec.json"
    assert read_json(path, LocustSpec) == LocustSpec(
        workload=str(tmp_path / "w.jsonl"), records=str(tmp_path / "r.jsonl"), config="canary-shift", block_size=16, model="m",
        workers=3, rate=2.5, fault="shift", prompt_ids=False)
    assert ran.master[ran.master.index("--processes") + 1] == "3"


def test_golden_keeps_its_prompt_ids_and_a_spec_defaults_beside_the_records(tmp_path, monkeypatch):
    ran = Ran(monkeypatch)
    treatments.run_locust(treatment("baseline", "golden", None), tmp_path / "w.jsonl", tmp_path / "r.jsonl", 1, 1,
                          0.0, 60)
    spec = read_json(Path(ran.master[ran.master.index(locustspec.FLAG) + 1]), LocustSpec)
    assert spec.prompt_ids and spec.fault is None and spec.workers == 1 and spec.records == str(tmp_path / "r.jsonl")
    assert "--processes" not in ran.master


def test_workers_on_other_hosts_get_the_same_spec_path_in_their_ssh_command(tmp_path, monkeypatch):
    ran = Ran(monkeypatch)
    remote = LocustWorkers(hosts=["kvh1", "kvh2"], ssh_config="/etc/kv/ssh", master_host="10.77.0.1")
    treatments.run_locust(treatment(), tmp_path / "w.jsonl", tmp_path / "r.jsonl", 2, 1, 0.0, 60, remote)
    path = ran.master[ran.master.index(locustspec.FLAG) + 1]
    assert read_json(Path(path), LocustSpec).workers == 2  # the master waits for both hosts' records
    assert [w[:4] for w in ran.workers] == [["ssh", "-F", "/etc/kv/ssh", "kvh1"], ["ssh", "-F", "/etc/kv/ssh", "kvh2"]]
    for w in ran.workers:
        worker = shlex.split(w[4])
        assert kvscope_options(worker) == [locustspec.FLAG] and worker[worker.index(locustspec.FLAG) + 1] == path
        assert worker[worker.index("--master-host") + 1] == "10.77.0.1" and "--worker" in worker


def test_a_resume_is_refused_while_a_locust_runs_on_a_spec_of_its_run_folder(tmp_path):
    spec = tmp_path / "run" / "locust" / "a__s.measure.spec.json"
    other = tmp_path / "other" / "locust" / "a__s.measure.spec.json"
    sleepers = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", locustspec.FLAG, str(path)])
                for path in (spec, other)]
    try:
        assert orphans.writers(tmp_path / "run") == [sleepers[0].pid]
    finally:
        for s in sleepers:
            s.kill()
            s.wait()


# --- kvscope bench --plan ------------------------------------------------------------------------------------

SCENARIOS = """scenarios:
  - {name: rep, kind: repeat, endpoint: completions, repeats: 3, max_tokens: 4}
  - {name: back, kind: repeat, repeats: 2, max_tokens: 4, prime: replay, restart: true}
"""


def deployment(tmp_path: Path, model_dir: Path) -> Path:
    def server(config: str, role: str, port: int, **kw) -> Manifest:
        return Manifest(config=config, role=role, port=port, platform="cpu", served_model_name="tiny", server_args=[],
                        vllm_version="0.32.0", kv_capacity_tokens=16384, block_size=16, prefix_caching=role in (
                            "candidate", "canary"), model_path=str(model_dir), model_hash="f" * 64, **kw)

    (tmp_path / "runs").mkdir(exist_ok=True)
    path = tmp_path / "runs" / "deployment.json"
    write_json(path, Deployment(servers=[server("apc", "candidate", 8101), server("baseline", "golden", 8100),
                                         server("canary", "canary", 8102, faults=["shift", "zeros"])]))
    (tmp_path / "s.yaml").write_text(SCENARIOS)
    return path


def bench(tmp_path: Path, model_dir: Path, *extra: str) -> list[str]:
    return ["bench", "--deployment", str(deployment(tmp_path, model_dir)), "--results", str(tmp_path / "results"),
            "--scenarios-file", str(tmp_path / "s.yaml"), "--scenarios", "rep,back", "--run-id", "r",
            "--restart-cmd", "make restart CONFIG={config}", *extra]


def nothing_may_start(monkeypatch) -> list[str]:
    """Every process started and every connection opened from now on fails, and is named in the list."""
    tried: list[str] = []

    def refuse(what):
        def fail(*args, **kw):
            tried.append(f"{what} {args[:2]}")
            raise OSError(f"{what}: nothing may start")
        return fail

    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("process"))
    monkeypatch.setattr(socket.socket, "connect", refuse("connect"))
    monkeypatch.setattr(treatments, "run", refuse("treatments.run"))
    return tried


def test_bench_plan_prints_the_plan_and_starts_nothing(tmp_path, monkeypatch, capsys, model_dir):
    tried = nothing_may_start(monkeypatch)
    assert cli.main(bench(tmp_path, model_dir, "--users", "1,4", "--plan")) == 0
    out = capsys.readouterr().out
    assert tried == [] and not (tmp_path / "results").exists()  # no process, no connection, no run folder
    assert f"run r: {tmp_path / 'results' / 'r'} (new)" in out
    servers = [line.split()[:2] for line in out.split("servers (")[1].split("scenarios (")[0].splitlines()[1:]]
    assert servers == [["baseline", "golden"], ["apc", "candidate"], ["canary-shift", "canary"],
                       ["canary-zeros", "canary"]]  # golden first, a treatment per canary fault
    assert "rep@u1" in out and "rep@u4" in out and "back@u4" in out and "measure 3 requests" in out
    assert "restart command: make restart CONFIG={config}" in out
    assert "16 treatments; nothing was started" in out


def test_bench_plan_prints_no_secret(tmp_path, monkeypatch, capsys, model_dir):
    nothing_may_start(monkeypatch)
    monkeypatch.setenv(auth.KEY_ENV, "sk-live-0123456")
    monkeypatch.setenv("KVSCOPE_COMMAND", "make bench KVSCOPE_API_KEY=sk-live-0123456 NOTE=hf_secret_token_1")
    monkeypatch.setenv("HF_TOKEN", "hf_secret_token_1")
    argv = bench(tmp_path, model_dir, "--plan")
    argv[argv.index("--restart-cmd") + 1] = "restart.sh {config} --token sk-live-0123456 --password pw-is-long"
    assert cli.main(argv) == 0
    out = capsys.readouterr().out
    assert "sk-live-0123456" not in out and "hf_secret_token_1" not in out and "pw-is-long" not in out, out
    assert f"make bench KVSCOPE_API_KEY={auth.REDACTED}" in out and f"--token {auth.REDACTED}" in out


@pytest.mark.parametrize("extra, says", [
    (["--configs", "nope"], "config(s) ['nope'] are not deployed"),
    (["--scenarios", "nope"], "unknown scenario(s) ['nope']"),
    (["--users", "two"], "--users 'two': expected a number"),
    (["--run-id", "../up"], "--run-id '../up' (RUN_ID)"),
    (["--restart-cmd", ""], "restart servers: give --restart-cmd"),
    (["--resume"], "has no run.json; nothing to continue"),
    (["--worker-hosts", "h1"], "Locust workers on h1 need --master-host"),
    # a Locust process that gets no user sends nothing: its share of the sessions waited out the time limit
    (["--users", "1", "--processes", "2"], "--processes 2: more Locust processes than the 1 user"),
])
def test_bench_plan_refuses_bad_input_as_the_bench_does(tmp_path, monkeypatch, capsys, model_dir, extra, says):
    tried = nothing_may_start(monkeypatch)
    assert cli.main(bench(tmp_path, model_dir, *extra)) == 2
    refused = capsys.readouterr().err
    assert says in refused, refused
    assert cli.main(bench(tmp_path, model_dir, *extra, "--plan")) == 2
    assert capsys.readouterr().err == refused
    assert tried == []
