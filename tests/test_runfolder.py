"""The run folder's layout has one owner (kvscope.runfolder): the bench writes and the report reads through it."""

import json
import operator
import re
import shutil
from functools import reduce
from pathlib import Path

import pytest
from conftest import REPO

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
from kvscope.runfolder import TABLES, RunFolder

# A run folder's files and folders, as a path expression would name them outside the module.
HAND_BUILT = re.compile(r'/ "(records|faults|loads|continuations|workloads|locust)"|/ "(run\.json|status\.jsonl)"|'
                        r'/ "(' + "|".join(TABLES) + r')\.csv"|/ "report\.(md|html)"|f"\{\w+\}__\{\w+\}\.jsonl"')

PUBLISHED = RunFolder(REPO / "results" / "2026-12-01-cpu-vllm0.32-lifecycle")  # with a restart and a shared store


def test_no_run_folder_path_is_built_outside_its_module():
    sources = [p for p in (REPO / "loadtests" / "kvscope").rglob("*.py") if p.name != "runfolder.py"]
    found = [f"{p.relative_to(REPO)}:{i}: {line.strip()}" for p in sources
             for i, line in enumerate(p.read_text().splitlines(), 1) if HAND_BUILT.search(line)]
    assert not found, "\n".join(found)


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
    rows = [json.loads(line) for line in PUBLISHED.status.read_text().splitlines()]
    row = next(r for r in rows if where[-1] in reduce(operator.getitem, where[:-1], r))
    reduce(operator.getitem, where, row)["renamed"] = 1
    (tmp_path / "status.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ArtifactError, match="renamed"):
        read_jsonl(tmp_path / "status.jsonl", StatusRow)


def test_a_flat_run_json_loads_each_treatment_with_its_servers_manifest_and_is_written_back_flat(tmp_path):
    # versions 0 and 1 wrote a treatment as one flat object (Treatment was a Manifest); published runs keep that form
    published = REPO / "results" / "2026-12-01-h200-vllm0.26-qwen3-4b-bf16-invariant" / "run.json"
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


INVARIANT = REPO / "results" / "2026-12-01-h200-vllm0.26-qwen3-4b-bf16-invariant" / "run.json"


def test_a_treatments_form_is_its_run_jsons_version_flat_before_2_nested_from_2(tmp_path):
    flat = json.loads(INVARIANT.read_text())
    write_json(tmp_path / "new.json", read_json(INVARIANT, RunInfo).model_copy(update={"schema_version": 2}))
    nested = json.loads((tmp_path / "new.json").read_text())
    for doc, version, words in ((flat, 2, "nests"), (nested, 1, "flat"), (nested, 0, "flat")):
        (tmp_path / "x.json").write_text(json.dumps({**doc, "schema_version": version}))
        with pytest.raises(ArtifactError, match=f"schema_version {version}: each treatment is {words}"):
            read_json(tmp_path / "x.json", RunInfo)


def test_a_flat_treatment_deployed_as_its_own_name_re_renders_byte_for_byte(tmp_path):
    doc = json.loads(INVARIANT.read_text())
    golden = doc["servers"][0]
    assert golden["deployed_as"] is None
    golden["deployed_as"] = golden["config"]
    (tmp_path / "a.json").write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n")
    write_json(tmp_path / "b.json", read_json(tmp_path / "a.json", RunInfo))
    assert (tmp_path / "b.json").read_text() == (tmp_path / "a.json").read_text()


def test_a_flat_treatment_without_schema_version_reads_as_version_1_as_the_flat_form_wrote_it(tmp_path):
    doc = json.loads(INVARIANT.read_text())
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
    from kvscope.analyze import report
    from kvscope.cli import main

    name = "2026-12-01-h200-vllm0.26-tiny-fp32-lmcache-mp-1user"
    plain, packed = (shutil.copytree(REPO / "results" / name, tmp_path / d / name) for d in ("plain", "packed"))
    (packed / "records" / "empty__rag-zipf.jsonl").touch()  # a treatment that recorded nothing stays so
    assert main(["compress", str(packed)]) == 0
    assert sorted(p.name for p in (packed / "records").iterdir()) == sorted(
        [p.name + ".gz" for p in (plain / "records").iterdir()] + ["empty__rag-zipf.jsonl"])
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
    # a treatment re-run after compress (--resume) leaves both forms in the folder: the report names both
    (packed / "records" / "baseline__rag-zipf.jsonl.gz").unlink()
    shutil.copy(plain / "records" / "baseline__rag-zipf.jsonl", packed / "records")
    assert RunFolder(packed).records_glob == "records/*.jsonl and records/*.jsonl.gz"


def test_a_truncated_gzip_of_records_is_an_error_naming_the_file(tmp_path):
    rf = RunFolder(tmp_path)
    (tmp_path / "records").mkdir()
    rf.records("apc", "rag-zipf").write_text(
        (REPO / "results" / "2026-12-01-h200-vllm0.26-tiny-fp32-lmcache-mp-1user" / "records" /
         "control__rag-zipf.jsonl").read_text())
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
