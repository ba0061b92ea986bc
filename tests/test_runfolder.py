"""The run folder's layout has one owner (kvscope.runfolder): the bench writes and the report reads through it."""

import json
import operator
import re
from functools import reduce

import pytest
from conftest import REPO

from kvscope.artifacts import ArtifactError, RunInfo, StatusRow, read_json, read_jsonl
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


@pytest.mark.parametrize("where", [["machine"], ["load"], ["scorer"], ["scorer", "largest_differences", 0]])
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
