"""Each folder layout has one owner: the run folder's (kvscope.runfolder: the bench writes and the report reads
through it), the deployment folder's (kvscope.deploy.folder) and the rollout folder's (kvscope.rollout.folder)."""

import gzip
import json
import operator
import re
import shutil
from functools import reduce
from pathlib import Path

import pytest
from conftest import REPO, ansible

from kvscope import files
from kvscope.artifacts import (
    SCHEMA_VERSION,
    ArtifactError,
    Record,
    RunInfo,
    StatusRow,
    read_json,
    read_jsonl,
    write_json,
)
from kvscope.config import matrix as matrix_mod
from kvscope.config.render import render
from kvscope.deploy.folder import DRY_RUN, LOCAL, DeploymentFolder
from kvscope.rollout.folder import RolloutFolder, host_state
from kvscope.runfolder import TABLES, RunFolder

# A run folder's files and folders, as a path expression would name them outside the module.
HAND_BUILT = re.compile(r'/ "(records|faults|loads|continuations|workloads|locust|hosts)"|/ "(run\.json|status\.jsonl)"|'
                        r'["\'][^"\'\s]*\bhosts/|'  # a host's collected files (hosts/<host>/)
                        r'/ "(' + "|".join(TABLES) + r')\.csv"|/ "report\.(md|html)"|f"\{\w+\}__\{\w+\}\.jsonl"|'
                        r'\.glob\("\*\.jsonl')  # a folder's JSONL files, in one form or the other

PUBLISHED = RunFolder(REPO / "results" / "2026-12-01-cpu-vllm0.32-lifecycle")  # with a restart and a shared store


# A deployment folder's and a rollout folder's files, as a quoted name or a path expression would spell them.
DEPLOYMENT_HAND_BUILT = re.compile(r'''["'](?:[^"'\s]*/)?(?:server\.(?:pid|log)|manifest\.json|failed\.json|'''
                                   r'''rendered(?:-[^"'\s]*)?\.json|deployment\.json)["']|/ ["']stores["']|["']runs/(?:local|dry-run)\b''')
ROLLOUT_HAND_BUILT = re.compile(r'''["'](?:[^"'\s]*/)?(?:\.?rollout\.(?:json|md)(?:\.tmp)?|\.lock|gate-scenarios\.yaml|'''
                                r'''restore-[^"'\s]*)["']|/ ["'](?:batches|logs|state|gate)["']|["'](?:batches|logs|state)/''')
OWNERS = [(HAND_BUILT, "kvscope/runfolder.py"), (DEPLOYMENT_HAND_BUILT, "kvscope/deploy/folder.py"),
          (ROLLOUT_HAND_BUILT, "kvscope/rollout/folder.py")]


@pytest.mark.parametrize(("hand_built", "owner"), OWNERS, ids=["run", "deployment", "rollout"])
def test_no_folder_path_is_built_outside_its_owner(hand_built, owner):
    sources = [p for p in (REPO / "loadtests").rglob("*.py") if p != REPO / "loadtests" / owner]
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in sources
             for i, line in enumerate(p.read_text().splitlines(), 1) if hand_built.search(line)]
    assert not found, "\n".join(found)


@pytest.mark.parametrize(("line", "pattern"), [('run_dir / "server.pid"', DEPLOYMENT_HAND_BUILT),
                                               ('f"{config}/manifest.json"', DEPLOYMENT_HAND_BUILT),
                                               ('Path(run_dir).resolve() / "stores"', DEPLOYMENT_HAND_BUILT),
                                               ('Path("runs/local/deployment.json")', DEPLOYMENT_HAND_BUILT),
                                               ('default="runs/local"', DEPLOYMENT_HAND_BUILT),
                                               ('Path("runs/dry-run")', DEPLOYMENT_HAND_BUILT),
                                               ('folder / "hosts" / host / "deployment.json"', HAND_BUILT),
                                               ('f"results/{run_id}/hosts/{host}/deployment.json"', HAND_BUILT),
                                               ('folder / "batches" / f"{n:02d}"', ROLLOUT_HAND_BUILT),
                                               ('Path(folder) / "rollout.json"', ROLLOUT_HAND_BUILT),
                                               ('step.log = "logs/final.log"', ROLLOUT_HAND_BUILT)])
def test_the_guard_sees_a_hand_built_path(line, pattern):
    assert pattern.search(line)


# The Ansible roles, the playbooks, the inventories, the make overlays and the shell scripts spell the deployment
# folder's paths (and a run folder's hosts/<host>/, where the collect role fetches each host's) in YAML and bash;
# each is read here as a template (a variable part as *) and must be one the model makes.
SPELLERS = sorted([*(REPO / "ansible").rglob("*.yml"), *(REPO / "ansible").rglob("*.sh"), *(REPO / "ansible").rglob("*.mk"),
                   *(REPO / "loadtests" / "benchmarks").rglob("*.sh"), REPO / "Makefile"])
SPELT_PATH = re.compile(r"\b(?:RUN_DIR|STATE_DIR|RUN_FOLDER)(?:/[\w.*-]+)*")
SPELT_RUNS = re.compile(r"\bruns/[\w.*-]+(?:/[\w.*-]+)*")  # a deployment folder the Makefile names itself
SPELT_NAME = re.compile(r"(?<![\w.*-])(?:server|manifest|failed|deployment|rendered)[\w*-]*\.(?:pid|log|json)(?![\w-])")


def _as_template(line: str) -> str:
    """A line with the deployment folder as RUN_DIR, rollout-state's folder as STATE_DIR, the collect role's run
    folder (and an inventory's results/{run_id}) as RUN_FOLDER, and every other variable (Jinja, bash, make, an
    inventory's {host}) as *."""
    line = re.sub(r"\{\{\s*kvscope_run_dir\s*\}\}|\bkvscope_run_dir(?=\s*~)|\$\{?run_dir\}?|\$\(RUN_DIR\)", "RUN_DIR", line)
    line = re.sub(r"\{\{\s*rollout_state_to\s*\}\}", "STATE_DIR", line)
    line = re.sub(r"\{\{\s*collect_to\s*\}\}|\bresults/\{run_id\}", "RUN_FOLDER", line)
    line = re.sub(r"\$\(abspath ([^)]*)\)", r"\1", line)
    line = re.sub(r"\s*~\s*'([^']*)'", r"\1", line)  # Jinja's concatenation: kvscope_run_dir ~ '/' ~ x ~ '/server.pid'
    line = re.sub(r"\s*~\s*[\w.]+", "*", line)
    line = re.sub(r"\{\{\s*\(?\s*((?:RUN_DIR|STATE_DIR)[^|}]*?)\)?\s*(?:\|[^}]*)?\}\}", r"\1", line)
    line = re.sub(r"\{\{.*?\}\}", "*", line)
    line = re.sub(r"\$\{?\w+\}?|\$\(\w+\)", "*", line)
    return re.sub(r"\{\w+\}", "*", line)


def test_ansible_and_the_scripts_spell_the_deployment_folder_as_its_model():
    folder = DeploymentFolder(Path("RUN_DIR"))
    server = folder.server("*")
    paths = {str(p) for p in (folder.root, folder.rendered, folder.rendered_for("*"), folder.deployment, folder.stores,
                              folder.shared_stores, server.root, server.pid, server.definition, server.log,
                              server.manifest, server.failed, host_state(Path("STATE_DIR"), "*"))}
    collected = RunFolder(Path("RUN_FOLDER")).host("*")  # each file at its place in it (the collect role's relpath)
    paths |= {str(collected.root), str(collected.deployment), str(collected.root / "*")}
    names = {Path(p).name for p in paths} - {"*", "RUN_DIR", "STATE_DIR", "RUN_FOLDER"}
    spelt = [(f"{p.relative_to(REPO)}:{i}", _as_template(line)) for p in SPELLERS
             for i, line in enumerate(p.read_text().splitlines(), 1)]
    found_paths = [(where, m) for where, line in spelt for m in SPELT_PATH.findall(line)]
    found_names = [(where, m) for where, line in spelt for m in SPELT_NAME.findall(line)]
    assert not [f"{where}: {m}" for where, m in found_paths if m not in paths]
    assert not [f"{where}: {m}" for where, m in found_names if m not in names]
    # the Makefile's own deployment folders (make deploy DRY_RUN=1's)
    made = {str(p) for f in (DeploymentFolder(LOCAL), DeploymentFolder(DRY_RUN)) for p in (f.root, f.rendered_for("*"))}
    runs = [(where, m) for where, line in spelt if where.startswith("Makefile:") for m in SPELT_RUNS.findall(line)]
    assert runs and not [f"{where}: {m}" for where, m in runs if m not in made]
    # the scan reads what the roles spell: every file of a server folder, the folder's own files and the stores
    assert {m for _, m in found_paths} >= {str(server.pid), str(server.log), str(folder.rendered), str(folder.shared_stores),
                                          "RUN_FOLDER/hosts/*/*", "RUN_FOLDER/hosts/*/deployment.json"}
    assert {m for _, m in found_names} >= {"server.pid", "server.log", "manifest.json", "failed.json", "deployment.json"}


@pytest.mark.parametrize(("line", "template"), [
    ('"{{ kvscope_run_dir }}/{{ server.config }}/server.pid"', "RUN_DIR/*/server.pid"),
    ("> {{ (kvscope_run_dir ~ '/' ~ item.server.config ~ '/server.log') | quote }} 2>&1", "RUN_DIR/*/server.log"),
    ('cp "$run_dir/deployment.json" "$out/"', "RUN_DIR/deployment.json"),
    ("--deployment $(call q,$(RUN_DIR)/deployment.json)", "RUN_DIR/deployment.json"),
    ('dest: "{{ rollout_state_to }}/{{ inventory_hostname }}.json"', "STATE_DIR/*.json"),
    ('dest: "{{ collect_to }}/hosts/{{ inventory_hostname }}/{{ item.path | relpath(kvscope_run_dir) }}"',
     "RUN_FOLDER/hosts/*/*"),
    ("kvscope_bench_deployment: results/{run_id}/hosts/{host}/deployment.json", "RUN_FOLDER/hosts/*/deployment.json")])
def test_a_spelt_path_reads_as_its_template(line, template):
    assert SPELT_PATH.findall(_as_template(line)) == [template]


def test_the_collect_role_fetches_each_hosts_deployment_folder_where_the_run_folder_has_it(tmp_path):
    deployed = DeploymentFolder(tmp_path / "runs")
    deployed.server("apc").root.mkdir(parents=True)
    for path in (deployed.deployment, deployed.server("apc").manifest, deployed.server("apc").log):
        path.write_text(path.name)
    deployed.server("apc").pid.write_text("1 2 3")  # not collected
    run = RunFolder(tmp_path / "results" / "r1")
    out = ansible("collect.yml", deployed.root, "-e", f"collect_to={run.root}")
    assert out.returncode == 0, out.stdout[-2000:]
    collected = run.host("localhost")
    assert sorted(str(p.relative_to(run.root)) for p in run.root.rglob("*") if p.is_file()) == sorted(
        str(p.relative_to(run.root)) for p in (collected.deployment, collected.server("apc").manifest,
                                               collected.server("apc").log))
    assert collected.server("apc").manifest.read_text() == "manifest.json"


def test_the_renderer_puts_shared_stores_where_the_deployment_folder_has_them(tmp_path):
    # config.render lays out stores/ (config stage: it does not import the deploy stage); the NFS role mounts
    # the shared folder the model names
    m = matrix_mod.load(REPO / "loadtests" / "kvscope" / "matrix.yaml")
    cfg = next(c for c in m.configs if c.shared_stores)
    folder = DeploymentFolder(tmp_path)
    out = render(m, cfg, "cpu", tmp_path, folder.stores, "127.0.0.1")
    shared = [p for p in out.stores.values() if Path(p).parent == folder.shared_stores]
    assert shared and len(shared) == len(cfg.shared_stores)


def test_the_deployment_and_rollout_layouts(tmp_path):
    folder = DeploymentFolder(str(tmp_path))
    assert folder.server("apc").pid == tmp_path / "apc" / "server.pid"
    assert folder.rendered_for("node1") == tmp_path / "rendered-node1.json"
    (tmp_path / "apc").mkdir()
    folder.server("apc").manifest.write_text("{}")
    assert [s.config for s in folder.servers_with("manifest.json")] == ["apc"]
    rollout = RolloutFolder(tmp_path)
    batch = rollout.batch(3)
    assert batch.log("change") == tmp_path / "batches" / "03" / "logs" / "change.log"
    assert rollout.relative(batch.gate_run("h1")) == "batches/03/gate/h1" and batch.rollout == rollout


def test_the_default_deployment_folder_is_the_local_inventorys():
    from kvscope.deploy import inventory

    local = inventory.bench_hosts(str(REPO / "ansible" / "inventories" / "local"))
    assert local.deployments(None) == [DeploymentFolder(LOCAL).deployment]


def test_the_layout(tmp_path):
    rf = RunFolder(str(tmp_path))
    assert rf.records("apc", "rag-zipf") == tmp_path / "records" / "apc__rag-zipf.jsonl"
    assert rf.workload("rag-zipf", "measure") == tmp_path / "workloads" / "rag-zipf.measure.jsonl"
    assert rf.locust("apc", "rag-zipf", "prime") == tmp_path / "locust" / "apc__rag-zipf.prime"
    assert rf.table("verdicts") == tmp_path / "verdicts.csv"
    with pytest.raises(ValueError, match="not a table"):
        rf.table("verdict")
    rf.create()
    assert (tmp_path / "records").is_dir() and (tmp_path / "workloads").is_dir()


@pytest.mark.parametrize("where", [["machine"], ["load"], ["scorer"], ["scorer", "largest_differences", 0],
                                   ["servers", 0], ["scenarios", "restart"]])
def test_an_unknown_key_in_a_part_of_run_json_is_refused(tmp_path, where):
    doc = json.loads(PUBLISHED.run_json.read_text())
    reduce(operator.getitem, where, doc)["renamed"] = 1  # a renamed key must not read as an absent one
    (tmp_path / "run.json").write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="renamed"):
        read_json(tmp_path / "run.json", RunInfo)


@pytest.mark.parametrize("where", [["reset"], ["reset", "writer_reset"], ["phases", "measure"], ["phases", "restart"]])
def test_an_unknown_key_in_a_part_of_a_status_row_is_refused(tmp_path, where):
    rows = [json.loads(line) for line in files.lines(PUBLISHED.status)]
    row = next(r for r in rows if where[-1] in reduce(operator.getitem, where[:-1], r))
    reduce(operator.getitem, where, row)["renamed"] = 1
    (tmp_path / "status.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ArtifactError, match="renamed"):
        read_jsonl(tmp_path / "status.jsonl", StatusRow)


def test_a_flat_run_json_loads_each_treatment_with_its_servers_manifest_and_is_written_back_flat(tmp_path):
    # versions 0 and 1 wrote a treatment as one flat object (Treatment was a Manifest); published runs keep that form
    published = REPO / "results" / "2026-12-03-h200-vllm0.26-qwen3-4b-bf16-exact-step-cap" / "run.json"
    flat = json.loads(published.read_text())
    assert flat["schema_version"] == 1 and "manifest" not in flat["servers"][0]
    run = read_json(published, RunInfo)
    shift = next(t for t in run.servers if t.config == "canary-shift")
    assert (shift.deployed_as, shift.manifest.config, shift.fault, shift.role) == ("canary", "canary", "shift", "canary")
    assert shift.manifest.block_size == 32 and shift.url == f"http://127.0.0.1:{shift.manifest.port}"
    golden = run.golden()
    assert golden.deployed_as == golden.config == "baseline" and golden.run_dir
    write_json(tmp_path / "run.json", run)
    assert (tmp_path / "run.json").read_text() == published.read_text()

    # a new run.json nests each treatment's manifest, and reads back as it was
    new = run.model_copy(update={"schema_version": SCHEMA_VERSION})
    write_json(tmp_path / "new.json", new)
    doc = json.loads((tmp_path / "new.json").read_text())
    canary = next(t for t in doc["servers"] if t["config"] == "canary-shift")
    assert set(canary) == {"config", "manifest", "run_dir", "fault", "scheme"} and canary["manifest"]["config"] == "canary"
    assert read_json(tmp_path / "new.json", RunInfo) == new


FLAT_RUN = REPO / "results" / "2026-12-03-h200-vllm0.26-qwen3-4b-bf16-exact-step-cap" / "run.json"


def test_a_treatments_form_is_its_run_jsons_version_flat_before_2_nested_from_2(tmp_path):
    flat = json.loads(FLAT_RUN.read_text())
    write_json(tmp_path / "new.json", read_json(FLAT_RUN, RunInfo).model_copy(update={"schema_version": 2}))
    nested = json.loads((tmp_path / "new.json").read_text())
    for doc, version, words in ((flat, 2, "nests"), (nested, 1, "flat"), (nested, 0, "flat")):
        (tmp_path / "x.json").write_text(json.dumps({**doc, "schema_version": version}))
        with pytest.raises(ArtifactError, match=f"schema_version {version}: each treatment is {words}"):
            read_json(tmp_path / "x.json", RunInfo)


def test_a_flat_treatment_deployed_as_its_own_name_re_renders_byte_for_byte(tmp_path):
    doc = json.loads(FLAT_RUN.read_text())
    golden = doc["servers"][0]
    assert golden["deployed_as"] is None
    golden["deployed_as"] = golden["config"]
    (tmp_path / "a.json").write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    write_json(tmp_path / "b.json", read_json(tmp_path / "a.json", RunInfo))
    assert (tmp_path / "b.json").read_text() == (tmp_path / "a.json").read_text()


def test_a_flat_treatment_without_schema_version_reads_as_version_1_as_the_flat_form_wrote_it(tmp_path):
    doc = json.loads(FLAT_RUN.read_text())
    del doc["servers"][0]["schema_version"]
    (tmp_path / "a.json").write_text(json.dumps(doc))
    assert read_json(tmp_path / "a.json", RunInfo).servers[0].manifest.schema_version == 1


def test_run_json_keeps_the_scenario_settings_each_run_recorded_and_reads_each_columns_level_and_repeat(tmp_path):
    # three generations of published scenarios: without a load level, with one, with trace/reuse/restart settings
    old, swept = (read_json(REPO / "results" / name / "run.json", RunInfo)
                  for name in ("2026-11-29-cpu-vllm0.32", "2026-12-01-cpu-vllm0.32-lifecycle"))
    first = next(iter(old.scenarios.values()))
    assert (first.users, first.repeat) == (None, 1) and "users" not in first.model_dump()
    restart = swept.scenarios["restart"]
    assert restart.restart and restart.prime == "replay" and restart.users and restart.repeat == 1


def test_a_compressed_run_scores_and_renders_as_the_plain_one_and_its_report_names_the_gzipped_records(
        tmp_path, monkeypatch):
    # compress gzips every JSONL file of the folder (records, workloads, continuations, fault and load logs,
    # status.jsonl: the workloads, continuations and status were 34 of a clone's 92 MB), and the run folder
    # reads each in either form
    from kvscope.analyze import report
    from kvscope.cli import main

    name = "2026-12-06-cpu-vllm0.32-tiny-gemma3-sliding-window-n80"  # continuations, fault and load logs
    plain, packed = (_unpacked(REPO / "results" / name, tmp_path / d / name) for d in ("plain", "packed"))
    (packed / "records" / "empty__rag-zipf.jsonl").touch()  # a treatment that recorded nothing stays so
    assert main(["compress", str(packed)]) == 0
    kinds = {p.relative_to(plain).parts[0] for p in plain.rglob("*.jsonl")}
    assert kinds == {"records", "workloads", "continuations", "faults", "loads", "status.jsonl"}
    assert sorted(str(p.relative_to(packed)) for p in packed.rglob("*.jsonl*")) == sorted(
        [str(p.relative_to(plain)) + ".gz" for p in plain.rglob("*.jsonl") if p.stat().st_size] +
        [str(p.relative_to(plain)) for p in plain.rglob("*.jsonl") if not p.stat().st_size] +
        ["records/empty__rag-zipf.jsonl"])
    (packed / "records" / "empty__rag-zipf.jsonl").unlink()
    rendered = {}
    for folder in (plain, packed):
        monkeypatch.chdir(folder.parent)
        report.write(Path(name))
        rendered[folder] = {f.name: f.read_text() for f in folder.iterdir() if f.suffix in (".csv", ".md")}
    assert rendered[plain].keys() == rendered[packed].keys()
    for f, text in rendered[plain].items():
        expected = text.replace("(`records/*.jsonl`)", "(`records/*.jsonl.gz`)") if f == "report.md" else text
        assert rendered[packed][f] == expected, f
    assert "(`records/*.jsonl.gz`)" in rendered[packed]["report.md"]
    # the gzip header names the plain file (what `gunzip -N` restores)
    assert b"control__rag-zipf.jsonl\0" in (packed / "records" / "control__rag-zipf.jsonl.gz").read_bytes()[:64]
    assert b"status.jsonl\0" in (packed / "status.jsonl.gz").read_bytes()[:64]
    # a folder whose records alone were gzipped (kvscope before 2026-12-06), a treatment re-run after (--resume):
    # the report names both forms
    (packed / "records" / "baseline__rag-zipf.jsonl.gz").unlink()
    shutil.copy(plain / "records" / "baseline__rag-zipf.jsonl", packed / "records")
    assert RunFolder(packed).records_glob == "records/*.jsonl and records/*.jsonl.gz"


def test_a_compressed_run_is_not_resumed_and_the_bench_says_how_to_unpack_it(tmp_path, capsys):
    # a resume rewrites the workloads and appends to status.jsonl, plain: beside their gzipped forms neither
    # would hold the run
    from kvscope.cli import main

    name = "2026-12-01-h200-vllm0.26-tiny-fp32-lmcache-mp-1user"
    run = _unpacked(REPO / "results" / name, tmp_path / name)
    assert main(["compress", str(run)]) == 0
    before = {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    capsys.readouterr()
    assert main(["bench", "--resume", "--run-id", name, "--results", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "was compressed" in err and "gunzip" in err
    assert {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def _unpacked(published: Path, copy: Path) -> Path:
    """A copy of a published run with its JSONL files as the bench wrote them, plain (published runs gzip them)."""
    shutil.copytree(published, copy)
    for packed in copy.rglob("*.jsonl.gz"):
        packed.with_suffix("").write_bytes(gzip.decompress(packed.read_bytes()))
        packed.unlink()
    return copy


def test_a_truncated_gzip_of_records_is_an_error_naming_the_file(tmp_path):
    rf = RunFolder(tmp_path)
    (tmp_path / "records").mkdir()
    rf.records("apc", "rag-zipf").write_bytes(gzip.decompress(
        (REPO / "results" / "2026-12-01-h200-vllm0.26-tiny-fp32-lmcache-mp-1user" / "records" /
         "control__rag-zipf.jsonl.gz").read_bytes()))
    [(packed, _)] = rf.compress()
    assert rf.records("apc", "rag-zipf") == packed
    packed.write_bytes(packed.read_bytes()[:-40])
    with pytest.raises(ArtifactError, match=r"apc__rag-zipf\.jsonl\.gz: a truncated or broken gzip file"):
        read_jsonl(packed, Record)
    # records appended after compress: neither form holds them all, and the reader says so
    (tmp_path / "records" / "apc__rag-zipf.jsonl").write_text("{}\n")
    with pytest.raises(ArtifactError, match="written after the folder was compressed"):
        rf.records("apc", "rag-zipf")
    # a treatment run again starts its records afresh, in the plain form the bench appends to
    assert rf.clear_records("apc", "rag-zipf") == tmp_path / "records" / "apc__rag-zipf.jsonl"
    assert not any((tmp_path / "records").iterdir())


def test_a_published_run_is_not_compressed(capsys):
    from kvscope.cli import main

    assert main(["compress", str(PUBLISHED.root)]) == 2
    assert "a published run" in capsys.readouterr().err
