"""`kvscope rollout` as a user runs it, without servers: its options, its lock, what it resumes and what it
writes down, through the real playbook runs (kvscope.rollout.ansible) of a stand-in `ansible-playbook` that
reports hosts serving what the shipped matrix renders, and a stand-in gate (tests/test_rollout.py covers the
engine's decisions; tests/test_rollout_cluster.py rolls real servers)."""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
from conftest import MATRIX

from kvscope import cli
from kvscope.artifacts import Deployment, Manifest, Rendered, RenderedServer
from kvscope.auth import redact_args, redact_env
from kvscope.config import matrix as matrix_mod
from kvscope.config.render import render
from kvscope.deploy import inventory
from kvscope.rollout import ansible
from kvscope.rollout import engine as engine_mod
from kvscope.rollout.record import GateResult, ServerState, definition_errors, load, save

HOSTS = ["h1", "h2"]
API_KEY = "env-api-key-7f3a9c"  # $KVSCOPE_API_KEY where make runs
VAR_KEY = "var-api-key-51d2e8"  # -e vllm_api_key=...
JSON_KEY = "json-store-key-c0ffee"  # -e '{"vllm_store_key": ...}'
SECRETS = (API_KEY, VAR_KEY, JSON_KEY)

FAKE_PLAYBOOK = """#!{python}
# ansible-playbook as the rollout runs it: rollout-state.yml copies each host's state file; the others change
# nothing. Every call's arguments go to calls.jsonl, outside the rollout's folder.
import json, shutil, sys
from pathlib import Path
argv = sys.argv[1:]
with open({calls!r}, "a") as f:
    f.write(json.dumps(argv) + "\\n")
extra = dict(argv[i + 1].split("=", 1) for i, a in enumerate(argv) if a == "-e" and "=" in argv[i + 1])
if any(a.endswith("rollout-state.yml") for a in argv):
    for host in argv[argv.index("--limit") + 1].split(","):
        shutil.copy(Path({states!r}) / (host + ".json"), Path(extra["rollout_state_to"]) / (host + ".json"))
"""


def served(config: str, pid: int) -> tuple[RenderedServer, Manifest]:
    """A server of the shipped matrix as deploy records it: rendered (rendered.json), and its manifest, redacted."""
    m = matrix_mod.load(MATRIX)
    r = render(m, next(c for c in m.configs if c.name == config), "cpu", Path("/m/tiny"), Path("/runs/stores"),
               "127.0.0.1")
    return r, Manifest(**r.model_dump(exclude={"server_args", "env"}), server_args=redact_args(r.server_args),
                       env=redact_env(r.env), pid=pid, vllm_version="0.32", kv_capacity_tokens=16384, block_size=16,
                       prefix_caching=False, model_path="/m/tiny", model_hash="h")


def state_doc(host: str, configs: list[str]) -> dict:
    """What rollout-state.yml reads on a host serving `configs`: its deployment.json, rendered.json, status."""
    servers = [served(c, 100 + n) for n, c in enumerate(configs)]
    files = {"deployment.json": Deployment(servers=[m for _, m in servers]),
             "rendered.json": Rendered(kvscope_servers=[r for r, _ in servers])}
    return {"host": host, "run_dir": f"/runs/{host}",
            "files": {name: base64.b64encode(doc.model_dump_json(by_alias=True).encode()).decode()
                      for name, doc in files.items()},
            "status": [f"{m.config} port {m.port} pid {m.pid} healthy" for _, m in servers]}


class Setup:
    """A results folder, hosts h1 (baseline, kvscope-fs) and h2 (kvscope-fs), the playbook calls made."""

    def __init__(self, tmp_path: Path, monkeypatch):
        self.tmp, self.results, self.calls = tmp_path, tmp_path / "results", tmp_path / "calls.jsonl"
        states = tmp_path / "states"
        states.mkdir()
        for host, configs in {"h1": ["baseline", "kvscope-fs"], "h2": ["kvscope-fs"]}.items():
            (states / f"{host}.json").write_text(json.dumps(state_doc(host, configs)))
        bin_ = tmp_path / "bin"
        bin_.mkdir()
        playbook = bin_ / "ansible-playbook"
        playbook.write_text(FAKE_PLAYBOOK.format(python=sys.executable, calls=str(self.calls), states=str(states)))
        playbook.chmod(0o755)
        monkeypatch.setattr(ansible, "BIN", bin_)
        monkeypatch.setattr(inventory, "servers", lambda inv: list(HOSTS))
        monkeypatch.setenv("KVSCOPE_API_KEY", API_KEY)
        monkeypatch.setenv("KVSCOPE_COMMAND", "make rollout INVENTORY=inv CONFIGS=kvscope-fs "
                                              f"KVSCOPE_API_KEY={API_KEY} ROLLOUT_ARGS=-e\\ vllm_api_key={VAR_KEY}")
        self.verdicts: dict[str, int] = {}  # host -> the gate's exit code (default 0, PASS)
        self.on_gate = None
        monkeypatch.setattr(engine_mod, "run_gate", self.gate)

    def gate(self, r, batch, host, folder) -> GateResult:
        if self.on_gate:
            self.on_gate(host)
        code = self.verdicts.get(host, 0)
        return GateResult(host=host, folder="g", exit_code=code, verdicts={"baseline": "GOLDEN", "kvscope-fs":
                          "PASS" if code == 0 else "FAIL"}, hits=25, wrong_hits=0 if code == 0 else 9,
                          verified_hits=25 if code == 0 else 0)

    def rollout(self, *args: str) -> int:
        return cli.main(["--matrix", str(MATRIX), "rollout", "--inventory", "inv", "--configs", "kvscope-fs",
                         "--results", str(self.results), *args])

    def playbook_calls(self) -> list[list[str]]:
        return [json.loads(line) for line in self.calls.read_text().splitlines()] if self.calls.exists() else []


@pytest.fixture
def setup(tmp_path, monkeypatch) -> Setup:
    return Setup(tmp_path, monkeypatch)


def interrupted(setup: Setup, rollout_id: str, *args: str) -> Path:
    """A rollout stopped by a second Ctrl-C during h1's gate: unfinished, batch 1 gating."""
    def abort(host):
        raise KeyboardInterrupt

    setup.on_gate = abort
    assert setup.rollout("--id", rollout_id, *args) == 130
    setup.on_gate = None
    folder = setup.results / rollout_id
    assert load(folder).outcome == "interrupted"
    return folder


def test_the_rollout_writes_no_key_of_its_environment_command_or_extra_vars_into_any_file(setup):
    setup.verdicts["h1"] = 1  # h1's gate fails: the rollback runs too
    code = setup.rollout("--id", "r", "-e", f"vllm_api_key={VAR_KEY}", "-e", json.dumps({"vllm_store_key": JSON_KEY}),
                         "-e", "kvscope_run_root=/runs")
    assert code == 1
    folder = setup.results / "r"
    written = [p for p in folder.rglob("*") if p.is_file()]
    assert {"rollout.json", "rollout.md", "initial.log", "change.log", "rollback.log"} <= {p.name for p in written}
    for path in written:
        text = path.read_bytes()
        assert not [s for s in SECRETS if s.encode() in text], path
    r = load(folder)
    assert r.extra_vars == ["vllm_api_key=<redacted>", '{"vllm_store_key": "<redacted>"}', "kvscope_run_root=/runs"]
    assert "KVSCOPE_API_KEY=<redacted>" in r.command and "vllm_api_key" in r.command
    assert "-e vllm_api_key=<redacted>" in (folder / "batches" / "01" / "logs" / "change.log").read_text()
    # the playbooks themselves still got the keys
    deploys = [c for c in setup.playbook_calls() if any(a.endswith("deploy.yml") for a in c)]
    assert deploys and all(f"vllm_api_key={VAR_KEY}" in c and json.dumps({"vllm_store_key": JSON_KEY}) in c
                           for c in deploys)


@pytest.mark.parametrize("args,words", [
    (["--id", "../../x"], "--id '../../x'"),
    (["--id", "a/b"], "--id 'a/b'"),
    (["--id", ".hidden"], "--id '.hidden'"),
    (["--min-hits", "0"], "--min-hits 0"),
    (["--gate-queries", "0"], "--gate-queries 0"),
    (["--gate-repeats", "1"], "--gate-repeats 1"),
    (["--gate-users", "0"], "--gate-users 0"),
    (["--gate-timeout-s", "-5"], "--gate-timeout-s -5"),
    (["--gate-timeout-s", "nan"], "--gate-timeout-s nan"),
])
def test_bad_options_are_refused_before_anything_runs(setup, capsys, args, words):
    assert setup.rollout(*args) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err
    assert setup.playbook_calls() == [] and not (setup.tmp / "x").exists()
    assert not setup.results.exists() or not any(setup.results.iterdir())


def test_an_id_naming_a_folder_that_is_not_a_rollouts_is_refused(setup, capsys):
    bench = setup.results / "2026-12-06-bench"
    bench.mkdir(parents=True)
    (bench / "run.json").write_text("{}")
    assert setup.rollout("--id", bench.name) == 2
    err = capsys.readouterr().err
    assert f"{bench} is not a rollout's folder" in err and "Traceback" not in err
    assert sorted(p.name for p in bench.iterdir()) == ["run.json"] and setup.playbook_calls() == []
    (bench / "rollout.json").write_text("{not json")
    assert setup.rollout("--id", bench.name) == 2
    assert "rollout.json" in capsys.readouterr().err and setup.playbook_calls() == []


def test_a_second_rollout_of_a_running_one_is_refused_and_both_never_drive_the_hosts(setup, capsys):
    second: list[int] = []
    calls: list[int] = []

    def again(host):
        if host == "h1":  # while r runs (its gate on h1)
            setup.on_gate = None
            calls.append(len(setup.playbook_calls()))
            second.append(setup.rollout("--id", "r"))
            second.append(setup.rollout())  # without --id: r is unfinished
            calls.append(len(setup.playbook_calls()))

    setup.on_gate = again
    assert setup.rollout("--id", "r") == 0
    assert second == [2, 2]
    err = capsys.readouterr().err
    assert "rollout r is running" in err and "--id r" in err
    assert calls[0] == calls[1]  # the refused ones ran no playbook
    first_calls = len(setup.playbook_calls())
    assert [d.name for d in setup.results.iterdir()] == ["r"]
    # the lock is gone with the rollout that held it: a finished rollout is reported again
    assert setup.rollout("--id", "r") == 0 and len(setup.playbook_calls()) == first_calls


def test_an_unfinished_rollout_is_resumed_only_by_its_id(setup, capsys):
    folder = interrupted(setup, "r")
    # a record planted in results/ with the same plan: never resumed without --id, and its vars never run
    planted = load(folder).model_copy(update={"rollout_id": "planted", "extra_vars": [
        "kvscope_harness_python=/tmp/evil"]})
    (setup.results / "planted").mkdir()
    save(setup.results / "planted", planted)
    before = len(setup.playbook_calls())
    assert setup.rollout() == 2
    err = capsys.readouterr().err
    assert "unfinished" in err and "--id r" in err and "--id planted" in err
    assert len(setup.playbook_calls()) == before
    assert setup.rollout("--id", "r") == 0
    assert load(folder).outcome == "completed"
    assert not [c for c in setup.playbook_calls() if "kvscope_harness_python=/tmp/evil" in c]


@pytest.mark.parametrize("args,named", [
    (["-e", "kvscope_run_root=/elsewhere"], "extra vars"),
    (["--min-hits", "30"], "--min-hits"),
    (["--gate-queries", "8"], "--gate-queries"),
    (["--gate-users", "4"], "--gate-users"),
    (["--gate-timeout-s", "60"], "--gate-timeout-s"),
    (["--gate-repeats", "6"], "--gate-repeats"),
    (["--inconclusive", "continue"], "--inconclusive"),
    (["--golden", "h2/baseline"], "--golden"),
])
def test_a_resume_with_other_options_than_the_records_is_refused_naming_them(setup, capsys, args, named):
    folder = interrupted(setup, "r", "-e", "kvscope_run_root=/runs")
    record = (folder / "rollout.json").read_bytes()
    before = len(setup.playbook_calls())
    assert setup.rollout("--id", "r", "-e", "kvscope_run_root=/runs", *args) == 2
    err = capsys.readouterr().err
    assert "differ" in err and named in err
    assert len(setup.playbook_calls()) == before and (folder / "rollout.json").read_bytes() == record
    assert setup.rollout("--id", "r", "-e", "kvscope_run_root=/runs") == 0  # the refusal let go of the lock


def test_a_resume_uses_the_commands_secret_extra_vars_which_match_the_records_redacted_ones(setup):
    folder = interrupted(setup, "r", "-e", f"vllm_api_key={VAR_KEY}")
    assert load(folder).extra_vars == ["vllm_api_key=<redacted>"]
    before = len(setup.playbook_calls())
    assert setup.rollout("--id", "r", "-e", f"vllm_api_key={VAR_KEY}") == 0
    resumed = setup.playbook_calls()[before:]
    assert resumed and all(f"vllm_api_key={VAR_KEY}" in c for c in resumed)


@pytest.mark.parametrize("tamper,why", [
    (["--config", "/tmp/flags.yaml"], "--config"),
    (["--api-key", "k"], "--api-key"),
    (["--host", "0.0.0.0"], "--host"),
])
def test_a_rollback_of_a_resumed_rollout_deploys_only_a_definition_the_matrix_rules_accept(setup, capsys, tamper, why):
    folder = interrupted(setup, "r")
    r = load(folder)
    server = r.batches[0].before["h1"].servers["kvscope-fs"]
    server.rendered.server_args += tamper
    server.manifest.server_args = redact_args(server.rendered.server_args)  # consistent: only the rules can tell
    save(folder, r)
    before = len(setup.playbook_calls())
    setup.verdicts["h1"] = 1  # the resumed gate fails: the rollback would deploy the record's definition
    assert setup.rollout("--id", "r") == 2
    err = capsys.readouterr().err
    assert "h1: kvscope-fs" in err and why in err and "Traceback" not in err
    assert len(setup.playbook_calls()) == before


def test_a_rollback_definition_that_is_not_its_manifests_is_refused(setup, capsys):
    folder = interrupted(setup, "r")
    r = load(folder)
    r.batches[0].before["h1"].servers["kvscope-fs"].rendered.env["PYTHONPATH"] = "/tmp/evil"
    save(folder, r)
    before = len(setup.playbook_calls())
    assert setup.rollout("--id", "r") == 2
    assert "not the definition its manifest records" in capsys.readouterr().err
    assert len(setup.playbook_calls()) == before


def test_the_lock_file_is_refused_as_a_link(setup, capsys):
    folder = interrupted(setup, "r")
    target = setup.tmp / "elsewhere"
    target.write_text("keep")
    (folder / ".lock").unlink(missing_ok=True)
    os.symlink(target, folder / ".lock")
    assert setup.rollout("--id", "r") == 2
    assert ".lock" in capsys.readouterr().err and target.read_text() == "keep"


def test_a_lock_held_elsewhere_refuses_the_rollout(setup, capsys):
    folder = interrupted(setup, "r")
    with open(folder / ".lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        before = len(setup.playbook_calls())
        assert setup.rollout("--id", "r") == 2
    assert "rollout r is running" in capsys.readouterr().err and len(setup.playbook_calls()) == before


@pytest.mark.parametrize("platform,exact", [("cpu", False), ("cuda", False), ("cuda", True)])
def test_every_shipped_configs_definition_is_one_a_rollback_may_deploy_in_either_spelling(platform, exact):
    m = matrix_mod.load(MATRIX)
    checked = 0
    for cfg in m.configs:
        try:
            r = render(m, cfg, platform, Path("/m/tiny"), Path("/runs/stores"), "127.0.0.1", exact=exact)
        except matrix_mod.ConfigError:
            continue  # not on this platform
        manifest = Manifest(**r.model_dump(exclude={"server_args", "env"}), server_args=redact_args(r.server_args),
                            env=redact_env(r.env), vllm_version="0.32", kv_capacity_tokens=1, block_size=16,
                            prefix_caching=False, model_path="/m/tiny", model_hash="h")
        assert definition_errors(ServerState(config=cfg.name, health="healthy", manifest=manifest, rendered=r)) == []
        args: list[str] = []  # every flag's value as --flag=value
        for a in r.server_args:
            if a.startswith("--"):
                args.append(a)
            else:
                args[-1] += "=" + a
        eq = ServerState(config=cfg.name, health="healthy", rendered=r.model_copy(update={"server_args": args}),
                         manifest=manifest.model_copy(update={"server_args": redact_args(args)}))
        assert definition_errors(eq) == [], cfg.name
        checked += 1
    assert checked >= 5


def test_a_record_whose_topology_flags_are_not_its_recorded_ranks_may_not_be_redeployed():
    m = matrix_mod.load(MATRIX)
    cfg = next(c for c in m.configs if c.topology is not None and "cpu" in c.platforms)
    r = render(m, cfg, "cpu", Path("/m/tiny"), Path("/runs/stores"), "127.0.0.1")

    def state(args: list[str], topology) -> ServerState:
        rendered = r.model_copy(update={"server_args": args, "topology": topology})
        return ServerState(config=cfg.name, health="healthy", rendered=rendered, manifest=Manifest(
            **rendered.model_dump(exclude={"server_args", "env"}), server_args=redact_args(args),
            env=redact_env(r.env), vllm_version="0.32", kv_capacity_tokens=1, block_size=16, prefix_caching=False,
            model_path="/m/tiny", model_hash="h"))

    assert definition_errors(state(r.server_args, r.topology)) == []
    four = [a.replace("--tensor-parallel-size=2", "--tensor-parallel-size=4") for a in r.server_args]
    assert "topology flags are not the ranks" in " ".join(definition_errors(state(four, r.topology)))
    assert any("sets the server's topology" in e for e in definition_errors(state(r.server_args, None)))


def test_a_record_may_not_shard_a_reference_server_or_name_ranks_the_matrix_refuses():
    # the matrix keeps golden and control unsharded and a topology to whole ranks, more than one in all; a
    # record is a file, so its recorded topology is held to the same rules before a rollback deploys it
    m = matrix_mod.load(MATRIX)
    cfg = next(c for c in m.configs if c.topology is not None and "cpu" in c.platforms)
    r = render(m, cfg, "cpu", Path("/m/tiny"), Path("/runs/stores"), "127.0.0.1")

    def state(topology, role="candidate") -> ServerState:
        args = [a.replace("--tensor-parallel-size=2", f"--tensor-parallel-size={topology.get('tensor_parallel')}")
                for a in r.server_args]
        rendered = r.model_copy(update={"server_args": args, "topology": topology, "role": role})
        return ServerState(config=cfg.name, health="healthy", rendered=rendered, manifest=Manifest(
            **rendered.model_dump(exclude={"server_args", "env"}), server_args=redact_args(args),
            env=redact_env(r.env), vllm_version="0.32", kv_capacity_tokens=1, block_size=16, prefix_caching=False,
            model_path="/m/tiny", model_hash="h"))

    assert definition_errors(state(r.topology)) == []
    assert any("stays one unsharded server" in e for e in definition_errors(state(r.topology, role="control")))
    for ranks in ({"tensor_parallel": 0, "pipeline_parallel": 1}, {"tensor_parallel": 1, "pipeline_parallel": 1}):
        assert any("topology" in e for e in definition_errors(state(ranks))), ranks


@pytest.mark.parametrize("planted", ["rollout.md", "batches/01/logs/change.log", "batches"])
def test_a_resume_refuses_a_link_in_the_rollouts_folder_and_writes_through_none(setup, capsys, tmp_path, planted):
    folder = interrupted(setup, "r")
    victim = tmp_path / "victim"
    victim.write_text("ssh-ed25519 AAAA owner\n") if planted != "batches" else victim.mkdir()
    if (folder / planted).exists():
        shutil.move(folder / planted, tmp_path / "moved")  # the rollout's own, kept aside
    (folder / planted).symlink_to(victim)
    before = len(setup.playbook_calls())
    assert setup.rollout("--id", "r") == 2
    assert f"{folder / planted}: a symbolic link" in capsys.readouterr().err
    assert len(setup.playbook_calls()) == before
    assert (victim.read_text() == "ssh-ed25519 AAAA owner\n") if planted != "batches" else not list(victim.iterdir())


def test_a_recorded_reference_with_a_kv_connector_may_not_be_redeployed():
    # the record's trailing --kv-transfer-config was set aside before the cache-off checks: a control record
    # carrying a connector passed, and a rollback would have deployed it (the render refuses the same)
    m = matrix_mod.load(MATRIX)
    r = render(m, m.get("control"), "cpu", Path("/m/tiny"), Path("/runs/stores"), "127.0.0.1")
    args = [*r.server_args, "--kv-transfer-config", '{"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}']
    rendered = r.model_copy(update={"server_args": args})
    state = ServerState(config="control", health="healthy", rendered=rendered, manifest=Manifest(
        **rendered.model_dump(exclude={"server_args", "env"}), server_args=redact_args(args), env=redact_env(r.env),
        vllm_version="0.32", kv_capacity_tokens=1, block_size=16, prefix_caching=False, model_path="/m/tiny",
        model_hash="h"))
    assert any("KV connector" in e for e in definition_errors(state)), definition_errors(state)
