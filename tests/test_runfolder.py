"""The run folder's layout has one owner (kvscope.runfolder): the bench writes and the report reads through it."""

import re

import pytest
from conftest import REPO

from kvscope.runfolder import TABLES, RunFolder

# A run folder's files and folders, as a path expression would name them outside the module.
HAND_BUILT = re.compile(r'/ "(records|faults|loads|continuations|workloads|locust)"|/ "(run\.json|status\.jsonl)"|'
                        r'/ "(' + "|".join(TABLES) + r')\.csv"|/ "report\.(md|html)"|f"\{\w+\}__\{\w+\}\.jsonl"')


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
