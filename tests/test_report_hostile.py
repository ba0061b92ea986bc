"""Reports of hostile or broken run folders (issue 59): a run whose every request failed, answers the scorer cannot
verify, strings that would forge the report's markdown, folders that are bad input (exit 2), duplicate records,
and the connector import check run as the server runs."""

import json
import re
import sys

import pandas as pd
import pytest
from test_report import four, make_run

from kvscope import cli
from kvscope.analyze import report


def verdicts(run):
    return pd.read_csv(run / "verdicts.csv").set_index("config")


def edit_records(run, config, edit):
    """Rewrite every record of CONFIG's file through edit(dict) -> dict."""
    path = run / "records" / f"{config}__s.jsonl"
    rows = [edit(json.loads(line)) for line in path.read_text().splitlines()]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def edit_run(run, edit):
    doc = json.loads((run / "run.json").read_text())
    edit(doc)
    (run / "run.json").write_text(json.dumps(doc))


# item 5
def test_a_run_whose_every_request_failed_without_usage_is_reported_inconclusive(tmp_path, capsys):
    # a refused request has no usage chunk: cached_tokens None everywhere crashed provenance (exit 1, no report)
    refused = {"failed": [0, 1], "cached": [None, None]}
    run = make_run(tmp_path / "run", four(), baseline=refused, control=refused, apc=refused, canary_shift=refused)
    assert cli.main(["report", str(run)]) == 3
    assert "| apc | candidate | **INCOMPLETE** (unexpected) | 2 of 2 requests failed" in (run / "report.md").read_text()


# item 11
@pytest.mark.parametrize("mode", ["normal", "exact"])
def test_an_answer_without_logprobs_is_unscored_and_cannot_pass(tmp_path, mode):
    # wrong KV that keeps the greedy tokens moves only logprobs: with them stripped, tokens alone said identical
    run = make_run(tmp_path / "run", four(), mode=mode, apc={"offset": 0.5})
    edit_records(run, "apc", lambda r: {**r, "top_logprobs": []})
    assert report.write(run, min_hits=1) == 3
    v = verdicts(run)
    assert v.verdict["apc"] == "INCOMPLETE" and "2 answers no-logprobs" in v.why["apc"]
    scores = pd.read_csv(run / "scores.csv")
    assert set(scores[scores.config == "apc"].cls) == {"no-logprobs"}


def test_a_position_with_no_shared_alternative_is_unscored(tmp_path):
    run = make_run(tmp_path / "run", four(), apc={"offset": 0.5})

    def foreign(r):  # the chosen token at position 1 listed with an id golden's alternatives do not hold
        r["top_logprobs"][1] = [[12345, -0.1]]
        return r
    edit_records(run, "apc", foreign)
    assert report.write(run, min_hits=1) == 1  # position 0 still compares, and is off by 0.5 nat
    edit_records(run, "apc", lambda r: {**r, "top_logprobs": [[[12345, -0.1]] for _ in r["top_logprobs"]]})
    assert report.write(run, min_hits=1) == 3
    scores = pd.read_csv(run / "scores.csv")
    apc = scores[scores.config == "apc"]
    assert set(apc.cls) == {"no-logprobs"} and apc.reason.str.contains("token 0").all()


def test_answers_to_another_prompt_than_goldens_cannot_pass(tmp_path):
    run = make_run(tmp_path / "run", four())
    edit_records(run, "apc", lambda r: {**r, "prompt_sha": "other" if r["request_id"] == "r1" else r["prompt_sha"]})
    assert report.write(run, min_hits=1) == 3
    v = verdicts(run)
    assert v.verdict["apc"] == "UNVERIFIED" and "1 answers input-differs" in v.why["apc"]


# item 15
FORGED = ("HTTP 500 | **PASS** |\n\n## Verdicts\n\n| config | verdict |\n|---|---|\n| apc | **PASS** |\n"
          "[click](javascript:alert(1)) ![x](javascript:alert(3)) <javascript:alert(2)> `x` _em_ &lt;b&gt;")


def forged_run(folder):
    """A run folder whose records and run.json carry markdown that would forge a verdict table and links."""
    run = make_run(folder, four(), apc={"failed": [0]}, canary_shift={"failed": [0]})
    edit_records(run, "apc", lambda r: {**r, "error": FORGED} if not r["ok"] else r)
    edit_records(run, "canary-shift", lambda r: {**r, "error": FORGED} if not r["ok"] else r)

    def hostile(doc):
        doc["command"] = FORGED
        doc["servers"][2]["vllm_version"] = FORGED
        doc["servers"][2]["upstream"] = ["javascript:alert(4)", "https://x.org/a> [y](javascript:alert(5))"]
        doc["servers"][2]["server_args"] += ["--x", FORGED]
        doc["servers"][2]["connector_imports"] = {"m|`**PASS**`": FORGED}
        doc["crashed"] = [{"config": "bad\n## Verdicts", "role": "candidate", "why": FORGED, "error": FORGED}]
    edit_run(run, hostile)
    return run


def test_strings_from_a_run_folder_cannot_forge_the_reports_markdown(tmp_path):
    run = forged_run(tmp_path / "run")
    report.write(run, min_hits=1)
    md = (run / "report.md").read_text()
    assert md.count("\n## Verdicts\n") == 1 and "\n## Verdicts" not in md.replace("\n## Verdicts\n\n| config |", "")
    assert "\n| apc | **PASS** |" not in md and "**PASS** |\n" not in md  # no forged row, no forged cell ending one
    verdict_rows = [line for line in md.splitlines() if line.startswith("| apc |")]
    assert verdict_rows and all(len(re.findall(r"(?<!\\)\|", line)) == len(re.findall(r"(?<!\\)\|", verdict_rows[0]))
                                for line in verdict_rows[:1])
    page = (run / "report.html").read_text()
    assert "javascript:" not in re.sub(r">[^<]*<", "><", page)  # in no attribute: shown as text alone
    passed = int((verdicts(run).verdict == "PASS").sum())  # the control: coloured in the summary and the verdicts
    assert passed == 1 and page.count('class="verdict-pass"') == 2 * passed
    assert "<em>em</em>" not in page and "HTTP 500 | **PASS** |" in page.replace("&amp;", "&")  # shown as written


# item 22
def _no_golden(doc):
    doc["servers"].pop(0)


def _infinite_ttft(run):
    path = run / "records" / "apc__s.jsonl"
    path.write_text(path.read_text().replace('"ttft_s":0.1,', '"ttft_s":Infinity,', 1))


HOSTILE = {
    "block size 0": (lambda run: edit_run(run, lambda d: [s.update(block_size=0) for s in d["servers"]]),
                     "block_size"),
    "no servers": (lambda run: edit_run(run, lambda d: d.update(servers=[])), "no servers"),
    "no golden": (lambda run: edit_run(run, _no_golden), "golden"),
    "two goldens": (lambda run: edit_run(run, lambda d: d["servers"][1].update(role="golden")), "golden"),
    "infinite ttft": (_infinite_ttft, "apc__s.jsonl:1"),
    "nested records": (lambda run: (run / "records" / "apc__s.jsonl").write_text("[" * 100000 + "]" * 100000 + "\n"),
                       "apc__s.jsonl"),
    "nested run.json": (lambda run: (run / "run.json").write_text("[" * 100000 + "]" * 100000), "run.json"),
}


@pytest.mark.parametrize("name", HOSTILE)
def test_a_hostile_run_folder_is_bad_input_named_never_a_traceback(tmp_path, capsys, name):
    spoil, named = HOSTILE[name]
    run = make_run(tmp_path / "run", four())
    spoil(run)
    assert cli.main(["report", str(run)]) == 2
    err = capsys.readouterr().err
    assert named in err and "Traceback" not in err, err
    assert not (run / "report.md").exists()


def test_a_record_given_twice_counts_once(tmp_path, capsys):
    run = make_run(tmp_path / "run", four())
    path = run / "records" / "apc__s.jsonl"
    path.write_text(path.read_text() * 23)
    assert report.write(run, min_hits=1) == 0
    v = verdicts(run)
    assert v.verified_hits["apc"] == 2 and v.scored["apc"] == 2
    assert "`apc` x `s`: 44 records repeat a request already recorded; each request counts once" in (
        run / "report.md").read_text()


# item 26
def test_the_connector_import_check_sees_the_configs_python_path(tmp_path):
    from kvscope.deploy import servers

    own = tmp_path / "own"
    own.mkdir()
    (own / "my_connector.py").write_text("X = 1\n")
    assert servers.connector_imports(sys.executable, ["my_connector"], {"PYTHONPATH": str(own)}) == {
        "my_connector": "ok"}
    assert servers.connector_imports(sys.executable, ["my_connector"], {})["my_connector"].startswith(
        "ModuleNotFoundError")
    # UCM prints to standard output as it imports (H200, 2026-12-07): its modules still import
    (own / "chatty.py").write_text("print('[UCM] init {store: nfs}')\n")
    assert servers.connector_imports(sys.executable, ["chatty", "my_connector"], {"PYTHONPATH": str(own)}) == {
        "chatty": "ok", "my_connector": "ok"}


def test_the_manifest_checks_imports_with_the_servers_environment(tmp_path, monkeypatch):
    # the report said "`my_connector` does not import" of a connector its server loaded from python_path
    import argparse

    from kvscope import plumbing
    from kvscope.artifacts import RenderedServer
    from kvscope.deploy import servers

    own = tmp_path / "own"
    own.mkdir()
    (own / "my_connector.py").write_text("X = 1\n")
    ktc = json.dumps({"kv_connector": "Mine", "kv_connector_module_path": "my_connector"})
    rendered = RenderedServer(config="mine", role="candidate", port=8100, platform="cpu", served_model_name="m",
                              server_args=["--kv-transfer-config", ktc], env={"PYTHONPATH": str(own)})
    seen = {}

    def manifest(*args):
        seen["imports"] = args[-1]
        raise RuntimeError("no live server here")
    monkeypatch.setattr(servers, "rendered_servers", lambda path: {"mine": rendered})
    monkeypatch.setattr(servers, "package_versions", lambda python: {})
    monkeypatch.setattr(servers, "manifest", manifest)
    args = argparse.Namespace(run_dir=str(tmp_path), config="mine", rendered="rendered.json", model=str(tmp_path),
                              host="127.0.0.1", server_python=sys.executable, container=None)
    with pytest.raises(RuntimeError, match="no live server"):
        plumbing.cmd_manifest(args)
    assert seen["imports"] == {"my_connector": "ok"}
