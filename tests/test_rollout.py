"""Rollouts without servers: the engine's batches, decisions, record, Ctrl-C and resume, on fake hosts whose
versions change as the playbooks would change them. tests/test_rollout_cluster.py runs them for real."""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from kvscope.artifacts import Manifest, RenderedServer
from kvscope.auth import REDACTED
from kvscope.rollout import cli as rollout_cli
from kvscope.rollout import report
from kvscope.rollout.ansible import RolloutError, parse_state
from kvscope.rollout.engine import Engine, StopFlag
from kvscope.rollout.record import (
    EXIT_ROLLBACK_FAILED,
    GateResult,
    HostState,
    Rollout,
    ServerState,
    load,
    restorable,
    save,
    sha256,
)


def manifest(config: str, version: str, pid: int, role: str = "candidate") -> Manifest:
    args = ["--model", "/m", "--served-model-name", "m", "--host", "127.0.0.1", "--port", "8104", "--kv-transfer-config",
            json.dumps({"kv_connector": "KVScopeConnector", "kv_connector_extra_config": {"v": version}})]
    return Manifest(config=config, role=role, port=8104, platform="cpu", served_model_name="m", server_args=args,
                    vllm_version="0.32", kv_capacity_tokens=16384, block_size=64, prefix_caching=False,
                    model_path="/m", model_hash="h", pid=pid)


class FakeHosts:
    """Hosts h1..h3 serve baseline (h1) and tier v1; change() rolls the tier to `new`; restore() puts back what
    was recorded. `broken_restore`: a rollback that leaves nothing running; `crash`: the new version never starts."""

    def __init__(self, new: str = "v2", broken_restore: bool = False, crash: bool = False, on_change=None,
                 on_teardown=None):
        self.new, self.broken_restore, self.crash, self.on_change = new, broken_restore, crash, on_change
        self.on_teardown = on_teardown
        self.pid = 100
        self.serving = {h: {"tier": ("v1", self._pid())} for h in ("h1", "h2", "h3")}
        self.serving["h1"]["baseline"] = ("golden", self._pid())
        self.changes: list[str] = []
        self.deployed: list[str] = []  # the sha256 of the matrix each change deployed

    def _pid(self) -> int:
        self.pid += 1
        return self.pid

    def _server(self, config: str, version: str, pid: int) -> ServerState:
        role = "golden" if config == "baseline" else "candidate"
        m = manifest(config, version, pid, role)
        return ServerState(config=config, health="healthy", manifest=m,
                           rendered=RenderedServer(**m.model_dump(include=set(RenderedServer.model_fields))))

    def state(self, hosts, dest, log) -> dict[str, HostState]:
        return {h: HostState(host=h, run_dir=f"/runs/{h}", servers={c: self._server(c, v, p) for c, (v, p)
                                                                     in self.serving[h].items()}) for h in hosts}

    def change(self, hosts, matrix, log) -> int:
        self.changes += hosts
        if self.on_teardown:
            self.on_teardown(hosts)
        self.deployed.append(sha256(matrix))  # deploy.yml reads it after the teardown
        for h in hosts:
            self.serving[h].pop("tier", None)
            if not self.crash:
                self.serving[h]["tier"] = (self.new, self._pid())
        if self.on_change:
            self.on_change(hosts)
        return 1 if self.crash else 0

    def restore(self, before: HostState, folder, log) -> int:
        self.serving[before.host].pop("tier", None)
        if self.broken_restore:
            return 2
        old = before.serving("tier")
        if old is not None:
            ident = json.loads(old.manifest.server_args[-1])["kv_connector_extra_config"]["v"]
            self.serving[before.host]["tier"] = (ident, self._pid())
        return 0


def fake_gate(hosts: FakeHosts, inconclusive: bool = False):
    def gate(r, batch, host, folder) -> GateResult:
        version = hosts.serving[host]["tier"][0]
        if version == "bad":
            return GateResult(host=host, folder=f"batches/{batch.index:02d}/gate/{host}", exit_code=1,
                              verdicts={"baseline": "GOLDEN", "tier": "FAIL"}, hits=12, wrong_hits=7)
        if inconclusive:
            return GateResult(host=host, folder="g", exit_code=3, verdicts={"tier": "UNVERIFIED"},
                              why={"tier": "4 verified cache hits (at least 20 needed)"})
        return GateResult(host=host, folder="g", exit_code=0, verdicts={"baseline": "GOLDEN", "tier": "PASS"},
                          hits=25, verified_hits=25)
    return gate


def rollout(tmp_path, serial: str = "1", inconclusive: str = "stop") -> Rollout:
    hosts = ["h1", "h2", "h3"]
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text("configs: []  # what the fake hosts deploy\n")
    r = Rollout(rollout_id="r1", command="make rollout", inventory="inv", configs=["tier"], matrix=str(matrix),
                matrix_sha256=sha256(matrix), serial=serial, inconclusive=inconclusive, hosts=hosts,
                gate={"repeats": 12, "queries": 16, "min_hits": 20}, batches=rollout_cli.batches(hosts, serial))
    save(tmp_path, r)
    return r


def engine(tmp_path, hosts: FakeHosts, r: Rollout | None = None, unverified: bool = False, **kw) -> Engine:
    lines: list[str] = []
    e = Engine(r or rollout(tmp_path, **kw), tmp_path, hosts, gate=fake_gate(hosts, unverified),
               out=lambda *a, **k: lines.append(a[0]))
    e.lines = lines  # type: ignore[attr-defined]
    return e


def test_a_good_version_rolls_to_every_host_one_at_a_time_each_gated(tmp_path):
    hosts = FakeHosts()
    e = engine(tmp_path, hosts)
    assert e.run() == 0
    assert hosts.changes == ["h1", "h2", "h3"]
    r = load(tmp_path)
    assert [b.state for b in r.batches] == ["passed"] * 3 and r.outcome == "completed"
    assert r.golden == {"host": "h1", "config": "baseline"}
    assert report.headline(r) == "rolled to 3 of 3 hosts, every gate PASS"
    assert all(line.startswith(f"{h}: rolled: serves tier ") for h, line in zip(r.hosts, map(
        lambda h: report.host_line(r, h), r.hosts)))
    steps = [s.name for s in r.batches[0].steps]
    assert steps == ["record", "change", "after", "gate-h1"] and all(s.seconds is not None for s in r.batches[0].steps)
    assert "rolled to 3 of 3 hosts, every gate PASS" in (tmp_path / "rollout.md").read_text()


def test_a_faulty_version_stops_at_host_1_which_is_rolled_back_and_the_others_never_change(tmp_path):
    hosts = FakeHosts(new="bad")
    e = engine(tmp_path, hosts)
    h2_before = hosts.serving["h2"]["tier"]
    assert e.run() == 1
    assert hosts.changes == ["h1"] and hosts.serving["h1"]["tier"][0] == "v1"
    assert hosts.serving["h2"]["tier"] == h2_before  # same version, same process
    r = load(tmp_path)
    assert report.headline(r) == "stopped at host 1 (h1): FAIL, 7 of 12 hits wrong, rolled back"
    lines = report.summary(r)
    assert lines[1].startswith("  h1: rolled back: serves tier ") and "again, as before (gate FAIL, 7 of 12" in lines[1]
    assert lines[2].startswith("  h2: untouched: serves tier ") and lines[3].startswith("  h3: untouched")
    assert [b.state for b in r.batches] == ["rolled-back", "pending", "pending"]
    assert r.batches[0].decision == "stopped, rolled back"
    assert [s.name for s in r.batches[0].steps][-2:] == ["rollback", "restored"]
    # `kvscope report` renders the record and gives the rollout's exit code
    out = subprocess.run([sys.executable, "-m", "kvscope.cli", "report", str(tmp_path)], capture_output=True, text=True)
    assert out.returncode == 1 and "stopped at host 1 (h1): FAIL, 7 of 12 hits wrong, rolled back" in out.stdout
    assert "[report](batches/01/gate/h1/report.md)" in (tmp_path / "rollout.md").read_text()


def test_a_version_that_does_not_start_is_crashed_and_rolled_back(tmp_path):
    hosts = FakeHosts(crash=True)
    assert engine(tmp_path, hosts).run() == 1
    r = load(tmp_path)
    assert report.headline(r).startswith("stopped at host 1 (h1): CRASHED: tier not deployed, rolled back")
    assert hosts.serving["h1"]["tier"][0] == "v1"


def test_a_rollback_that_fails_is_the_worst_outcome_and_says_the_host_serves_neither(tmp_path):
    hosts = FakeHosts(new="bad", broken_restore=True)
    assert engine(tmp_path, hosts).run() == 4
    r = load(tmp_path)
    assert r.outcome == "rollback-failed" and r.batches[0].state == "rollback-failed"
    assert report.headline(r).endswith("ROLLBACK FAILED")
    line = report.host_line(r, "h1")
    assert line.startswith("h1: ROLLBACK FAILED: serves no tier") and "serves neither the old nor the new tier" in line
    assert "failed on h1 (exit 2)" in r.batches[0].steps[-2].outcome
    # re-running retries the rollback; this time it works
    hosts.broken_restore = False
    assert engine(tmp_path, hosts, r=load(tmp_path)).run() == 1
    assert load(tmp_path).batches[0].state == "rolled-back" and hosts.serving["h1"]["tier"][0] == "v1"


def test_inconclusive_gates_stop_or_continue_as_asked(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    hosts = FakeHosts()
    assert engine(tmp_path / "a", hosts, unverified=True, inconclusive="continue").run() == 3
    assert "3 gate(s) inconclusive, continued" in report.headline(load(tmp_path / "a"))
    hosts = FakeHosts()
    assert engine(tmp_path / "b", hosts, unverified=True, inconclusive="stop").run() == 1
    assert report.headline(load(tmp_path / "b")).startswith(
        "stopped at host 1 (h1): inconclusive: tier UNVERIFIED (4 verified cache hits (at least 20 needed)), rolled back")
    # an INVALID verdict (a golden that was not cache-off, a reset that did not reset) also exits 3, and is not
    # what `continue` lets through: only INCOMPLETE and UNVERIFIED are
    (tmp_path / "c").mkdir()
    hosts = FakeHosts()

    def invalid_golden(r, batch, host, folder) -> GateResult:
        return GateResult(host=host, folder="g", exit_code=3, verdicts={"baseline": "INVALID", "tier": "UNVERIFIED"},
                          why={"baseline": "it ran with --kv-offloading-size"})
    e = Engine(rollout(tmp_path / "c", inconclusive="continue"), tmp_path / "c", hosts, gate=invalid_golden,
               out=lambda *a, **k: None)
    assert e.run() == 1 and hosts.changes == ["h1"] and load(tmp_path / "c").batches[0].state == "rolled-back"


def test_ctrl_c_stops_between_steps_with_the_state_recorded_and_a_rerun_resumes_without_rolling_twice(tmp_path):
    def interrupt(hosts_):
        if hosts_ == ["h2"]:
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C while h2's playbook runs

    hosts = FakeHosts(on_change=interrupt)
    stop = StopFlag()
    old = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        stop.install()
        e = engine(tmp_path, hosts)
        e.stop = stop
        assert e.run() == 130
    finally:
        signal.signal(signal.SIGINT, old[0])
        signal.signal(signal.SIGTERM, old[1])
    r = load(tmp_path)
    assert r.outcome == "interrupted" and r.interrupted == "Ctrl-C between steps"
    assert [b.state for b in r.batches] == ["passed", "gating", "pending"]  # the change step finished, then it stopped
    assert report.headline(r).startswith("interrupted at host 2 (h2) (gating)")
    assert "INTERRUPTED while gating" in report.host_line(r, "h2")
    assert report.host_line(r, "h3").startswith("h3: untouched")
    r.outcome = "running"
    assert engine(tmp_path, hosts, r=r).run() == 0
    assert hosts.changes == ["h1", "h2", "h3"]  # h1 and h2 were not rolled again
    assert report.headline(load(tmp_path)) == "rolled to 3 of 3 hosts, every gate PASS"


def test_a_host_that_could_not_be_restored_exactly_is_never_changed(tmp_path):
    hosts = FakeHosts(new="v2")
    real_state = hosts.state

    def redacted(hs, dest, log):
        out = real_state(hs, dest, log)
        for s in out.values():
            if "tier" in s.servers:
                s.servers["tier"].rendered = None
        return out

    hosts.state = redacted  # type: ignore[method-assign]
    with pytest.raises(RolloutError, match="could not be rolled back"):
        engine(tmp_path, hosts).run()
    assert hosts.changes == []


def test_batches_follow_serial_as_a_number_or_a_percentage():
    hosts = ["a", "b", "c", "d"]
    assert [b.hosts for b in rollout_cli.batches(hosts, "1")] == [["a"], ["b"], ["c"], ["d"]]
    assert [b.hosts for b in rollout_cli.batches(hosts, "3")] == [["a", "b", "c"], ["d"]]
    assert [b.hosts for b in rollout_cli.batches(hosts, "50%")] == [["a", "b"], ["c", "d"]]
    assert [b.hosts for b in rollout_cli.batches(hosts, "10%")] == [[h] for h in hosts]
    with pytest.raises(RolloutError):
        rollout_cli.batches(hosts, "many")


def test_what_restores_a_server_is_its_rendered_definition_or_an_unredacted_manifest():
    m = manifest("tier", "v1", 5)
    exact = RenderedServer(**m.model_dump(include=set(RenderedServer.model_fields)))
    assert restorable(m, {"tier": exact}) == exact
    assert restorable(m, {}) == exact  # nothing redacted: the manifest is the definition
    secret = exact.model_copy(update={"env": {"HF_TOKEN": "s3cret"}})
    redacted = m.model_copy(update={"env": {"HF_TOKEN": REDACTED}})
    assert restorable(redacted, {"tier": secret}) == secret
    assert restorable(redacted, {}) is None
    other = secret.model_copy(update={"server_args": [*secret.server_args, "--seed", "1"]})
    assert restorable(redacted, {"tier": other}) is None  # rendered.json holds another definition


def test_a_hosts_state_file_reads_servers_health_failures_and_images():
    m = manifest("tier", "v1", 7)
    deployment = {"servers": [json.loads(m.model_dump_json(by_alias=True))],
                  "failed": [{"config": "apc", "why": "process died", "error": "ValueError: x"}]}
    doc = {"host": "h1", "run_dir": "/r", "runtime": "container",
           "files": {"deployment.json": base64.b64encode(json.dumps(deployment).encode()).decode()},
           "status": [], "containers": ["tier\tkvscope/kvscope-cpu:v2\tUp 3 minutes (healthy)"]}
    st = parse_state(doc)
    assert st.serving("tier").image == "kvscope/kvscope-cpu:v2"
    assert st.servers["apc"].health == "failed: process died: ValueError: x"
    assert st.serving("tier").rendered is not None  # from the unredacted manifest


def test_make_rollout_passes_the_inventory_configs_image_and_serial_and_needs_configs():
    out = subprocess.run(["make", "-n", "-B", "rollout", "INVENTORY=ansible/inventories/netns", "CONFIGS=kvscope-fs",
                          "IMAGE=kvscope/kvscope-cpu:v2", "SERIAL=50%", "MATRIX=new.yaml"], cwd=REPO,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    line = next(x for x in out.stdout.replace("\\\n", " ").splitlines() if "kvscope.cli" in x and "rollout" in x)
    line = " ".join(line.split())  # each user value one quoted shell word
    assert "--matrix 'new.yaml' rollout --inventory 'ansible/inventories/netns' --configs 'kvscope-fs'" in line
    assert "--image 'kvscope/kvscope-cpu:v2'" in line and "--serial '50%'" in line
    assert "netns-hosts.sh up" in out.stdout
    missing = subprocess.run(["make", "-n", "rollout"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert missing.returncode != 0 and "CONFIGS" in missing.stderr


def test_a_second_ctrl_c_aborts_the_change_and_says_the_host_may_serve_neither_until_resumed(tmp_path):
    def abort(hosts_):
        if hosts_ == ["h1"] and len(hosts.changes) == 1:
            raise KeyboardInterrupt  # what the second Ctrl-C raises while the playbook runs

    hosts = FakeHosts(on_change=abort)
    assert engine(tmp_path, hosts).run() == 130
    r = load(tmp_path)
    assert r.batches[0].state == "changing" and r.batches[0].steps[-1].outcome == "aborted"
    line = report.host_line(r, "h1")
    assert line.startswith("h1: INTERRUPTED while changing") and "it may serve neither the old nor the new tier" in line
    r.outcome = "running"
    assert engine(tmp_path, hosts, r=r).run() == 0
    assert hosts.changes == ["h1", "h1", "h2", "h3"]  # h1's change was redone, nothing else twice


def test_a_golden_server_that_stopped_serving_gives_no_verdict_so_the_batch_is_rolled_back(tmp_path):
    hosts = FakeHosts()
    e = engine(tmp_path, hosts)

    def golden_gone(r, batch, host, folder):
        raise RolloutError("kvh1: baseline is not serving (nothing)")

    e.gate = golden_gone
    assert e.run() == 1
    r = load(tmp_path)
    assert r.batches[0].state == "rolled-back" and hosts.serving["h1"]["tier"][0] == "v1"
    assert report.headline(r).startswith("stopped at host 1 (h1): CRASHED: baseline kvh1: baseline is not serving")


def test_a_resumed_rollout_reads_its_matrix_from_where_the_command_names_it(tmp_path):
    # the matrix moved (loadtests/matrix.yaml -> loadtests/kvscope/matrix.yaml) with the same content: the
    # resumed rollout's plan matches by sha256, and its deploys must not read the recorded, vanished path
    r = rollout(tmp_path).model_copy(update={"outcome": "stopped", "interrupted": "Ctrl-C"})
    again = r.model_copy(update={"matrix": "moved/m.yaml", "outcome": "running"})
    out = rollout_cli.resumed(r, again)
    assert (out.matrix, out.matrix_sha256, out.outcome, out.interrupted) == ("moved/m.yaml", r.matrix_sha256, "running",
                                                                             None)
    assert out.batches == r.batches and out.rollout_id == r.rollout_id  # the rest is the recorded rollout's


@pytest.mark.parametrize("edited_during,states", [("change", ["passed", "pending", "pending"]),
                                                  ("record", ["passed", "changing", "pending"])])
def test_a_matrix_edited_mid_rollout_is_refused_before_the_next_change_and_a_rerun_with_it_restored_resumes(
        tmp_path, edited_during, states):
    # each batch's change deploys the matrix file as it is then: an edit after the start would roll content that
    # the record (its sha256) does not name; refused before the next batch's record, and again before its change
    hosts = FakeHosts()
    e = engine(tmp_path, hosts)
    matrix = Path(e.r.matrix)
    recorded = matrix.read_text()

    def edit(hosts_):
        if hosts_ == ["h1" if edited_during == "change" else "h2"]:
            matrix.write_text(recorded + "# edited\n")

    if edited_during == "change":
        hosts.on_change = edit
    else:
        real_state = hosts.state

        def state(hs, dest, log):
            if dest.name == "before":
                edit(hs)
            return real_state(hs, dest, log)

        hosts.state = state  # type: ignore[method-assign]
    assert e.run() == 2
    assert hosts.changes == ["h1"]  # h2 was never torn down
    r = load(tmp_path)
    assert r.outcome == "interrupted" and [b.state for b in r.batches] == states
    assert f"{matrix} changed since the rollout started" in r.interrupted and r.matrix_sha256[:12] in r.interrupted
    assert report.headline(r).endswith("re-run with --id r1 to resume")
    matrix.write_text(recorded)
    assert engine(tmp_path, hosts, r=rollout_cli.resumed(r, r)).run() == 0
    assert hosts.changes == ["h1", "h2", "h3"] and load(tmp_path).interrupted is None


def test_a_matrix_edited_during_a_changes_teardown_is_not_what_it_deploys(tmp_path):
    # the change's teardown takes minutes before deploy.yml reads the matrix: each batch deploys a copy, in its
    # own folder, of the content whose sha256 was just checked, never the file as it is by then
    hosts = FakeHosts()
    e = engine(tmp_path, hosts)
    matrix = Path(e.r.matrix)
    recorded = matrix.read_text()

    def edit(hosts_):
        matrix.write_text(recorded + "# edited during the teardown, reverted after it\n")

    real_change = hosts.change

    def change(hs, deployed, log):
        rc = real_change(hs, deployed, log)
        matrix.write_text(recorded)
        return rc

    hosts.on_teardown, hosts.change = edit, change  # type: ignore[method-assign]
    assert e.run() == 0
    assert hosts.deployed == [e.r.matrix_sha256] * 3
    for n in (1, 2, 3):
        copy = tmp_path / "batches" / f"{n:02d}" / "matrix.yaml"
        assert copy.read_text() == recorded and copy.stat().st_mode & 0o222 == 0  # read-only


def test_a_change_deploys_the_batchs_copy_with_relative_paths_resolved_beside_the_original(tmp_path, monkeypatch):
    from kvscope.rollout.ansible import Ansible

    calls = []
    monkeypatch.setattr(Ansible, "playbook", lambda self, name, hosts, extra, log: calls.append((name, extra)) or 0)
    ops = Ansible("inv", [], tmp_path / "team" / "m.yaml", ["tier"], None)
    assert ops.change(["h1"], tmp_path / "batches" / "01" / "matrix.yaml", tmp_path / "log") == 0
    assert calls[1] == ("deploy.yml", [f"kvscope_matrix={tmp_path / 'batches' / '01' / 'matrix.yaml'}",
                                       f"vllm_matrix_dir={tmp_path / 'team'}", "vllm_configs=tier"])


# The verdict's tier in the gate (issue 61 item 4): the record says which tier each gate judged on, and a gate
# may require the exact tier (--gate-tier exact; default any).

def gate_run_folder(tmp_path, mode: str = "normal", apc_good: bool = True) -> Path:
    from test_report import BAD, GOOD, four, make_run

    from kvscope.analyze import report as bench_report

    outputs = four(apc=GOOD if apc_good else BAD)  # golden, control and apc: a control makes the exact tier possible
    del outputs["canary-shift"]
    run = make_run(tmp_path / "gate" / "h1", outputs, servers=[("baseline", "golden"), ("control", "control"),
                                                               ("apc", "candidate")], mode=mode)
    bench_report.write(run, min_hits=1)
    return run


@pytest.mark.parametrize("mode, tier", [("normal", "statistical"), ("exact", "exact")])
def test_a_gates_record_says_which_verdict_tier_it_judged_on(tmp_path, mode, tier):
    from kvscope.rollout import gate

    run = gate_run_folder(tmp_path, mode)
    result = gate.result("h1", run, "batches/01/gate/h1", 0, ["apc"])
    assert result.tier == tier and result.tier_required == "any"
    assert report.gate_words(result) == f"PASS, 2 verified hits, {tier} tier"


@pytest.mark.parametrize("required, mode, code", [("any", "normal", 0), ("exact", "normal", 1), ("exact", "exact", 0)])
def test_a_gate_that_requires_the_exact_tier_fails_a_statistical_verdict(tmp_path, monkeypatch, capsys, required,
                                                                         mode, code):
    from kvscope.rollout import gate

    run = gate_run_folder(tmp_path, mode)
    monkeypatch.setattr(gate.plan, "build", lambda options: None)
    monkeypatch.setattr(gate.treatments, "run", lambda plan: run)
    spec = gate.GateSpec(results=str(tmp_path / "gate"), run_id="h1", scenarios_file="s.yaml", servers=[],
                         min_hits=1, tier=required)
    assert gate.run(spec) == code
    out = capsys.readouterr().out
    if code:
        assert ("gate: FAILED: the exact verdict tier is required (--gate-tier exact); this gate's is statistical "
                "(normal mode: nothing proves a correct cache bitwise equal to golden) (exit 1)") in out
    result = gate.result("h1", run, "batches/01/gate/h1", code, ["apc"], required)
    assert result.tier_required == required
    if code:
        assert report.gate_words(result) == ("FAIL: the exact verdict tier is required (--gate-tier exact); this "
                                             "gate's is statistical")


def test_a_gate_that_failed_its_verdicts_says_so_beside_the_tier_it_lacks(tmp_path, monkeypatch, capsys):
    # a wrong hit and a statistical tier where exact is required: the console names both, the wrong hit first
    from kvscope.rollout import gate

    run = gate_run_folder(tmp_path, apc_good=False)
    monkeypatch.setattr(gate.plan, "build", lambda options: None)
    monkeypatch.setattr(gate.treatments, "run", lambda plan: run)
    spec = gate.GateSpec(results=str(tmp_path / "gate"), run_id="h1", scenarios_file="s.yaml", servers=[],
                         min_hits=1, tier="exact")
    assert gate.run(spec) == 1
    words = capsys.readouterr().out.split("gate: ", 1)[1]
    assert words.startswith(gate.report.GATE_WORDS[1]), words
    assert "the exact verdict tier is required (--gate-tier exact); this gate's is statistical" in words


def test_the_gate_tier_option_is_recorded_and_a_record_from_before_it_resumes_as_any(tmp_path):
    r = rollout(tmp_path)  # recorded before --gate-tier: its gate has no "tier"
    asked = r.model_copy(update={"gate": {**r.gate, "tier": "any"}})
    assert rollout_cli.differences(r, asked) == []
    assert rollout_cli.differences(r, r.model_copy(update={"gate": {**r.gate, "tier": "exact"}})) == [
        "--gate-tier 'any' recorded, 'exact' now"]
    report.write(tmp_path, r.model_copy(update={"gate": {**r.gate, "tier": "exact"}}))
    assert "PASS needs 20 verified hits; verdict tier: exact; inconclusive: stop |" in (
        tmp_path / "rollout.md").read_text()
    parser = argparse.ArgumentParser()
    rollout_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["rollout", "--inventory", "inv", "--configs", "tier", "--gate-tier", "exact"])
    assert args.gate_tier == "exact"
    with pytest.raises(SystemExit):
        parser.parse_args(["rollout", "--inventory", "inv", "--configs", "tier", "--gate-tier", "bitwise"])


def test_a_rollback_that_cannot_be_shown_done_is_a_failed_rollback(tmp_path):
    # a new config's first rollout (no host served it before) FAILs its gate; the teardown cannot reach the host
    # and its state cannot be read: "no healthy server" before and after read as restored (exit 1), while the
    # failed version may still serve
    class Unreachable(FakeHosts):
        def __init__(self):
            super().__init__(new="bad")
            for served in self.serving.values():
                served.pop("tier")

        def state(self, hosts, dest, log):
            if "restored" in str(dest):
                return {h: HostState(host=h, run_dir="?", error="not read (exit 4)") for h in hosts}
            return super().state(hosts, dest, log)

        def restore(self, before, folder, log):
            return 4

    hosts = Unreachable()
    assert engine(tmp_path, hosts).run() == EXIT_ROLLBACK_FAILED
    assert load(tmp_path).batches[0].state == "rollback-failed"
