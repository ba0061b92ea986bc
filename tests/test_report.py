"""Reports from raw records alone: the gate's exit code, and bad input named by file."""

import json
from dataclasses import asdict

import pytest

from kvscope import report
from kvscope.records import Record

SERVERS = [("baseline", "golden"), ("apc", "candidate"), ("canary-shift", "canary")]


def make_run(folder, outputs: dict[str, list[list[int]]], workload=b'{"request_id": "r0"}\n'):
    """A run folder as bench writes it, with the given output tokens per config."""
    (folder / "records").mkdir(parents=True)
    (folder / "workloads").mkdir()
    (folder / "workloads" / "s.measure.jsonl").write_bytes(workload)
    servers = [{"config": c, "role": r, "port": 8100 + i, "platform": "cpu", "vllm_version": "0.32.0",
                "model_path": "/m/tiny-qwen3", "model_hash": "f" * 64, "kv_capacity_tokens": 1024,
                "block_size": 64, "server_args": ["--model", "/m", "--port", str(8100 + i)]}
               for i, (c, r) in enumerate(SERVERS)]
    run = {"run_id": folder.name, "command": "kvscope bench (test)", "servers": servers, "scenarios": {"s": {}},
           "machine": {"cpu": "test", "cores": 2, "memory_gib": 1, "arch": "x86_64", "os": "linux", "python": "3",
                       "gpu": None},
           "load": {"users": 1}, "kv_capacity_tokens_for_sizing": 1024}
    (folder / "run.json").write_text(json.dumps(run))
    for config, outs in outputs.items():
        with open(folder / "records" / f"{config}__s.jsonl", "w") as f:
            for i, toks in enumerate(outs):
                r = Record(config=config, scenario="s", phase="measure", request_id=f"r{i}", session_id=f"r{i}",
                           turn=0, endpoint="chat", start_unix_s=float(i), ok=True, ttft_s=0.1 + 0.01 * i,
                           e2e_s=0.5, itl_s=[0.01], prompt_tokens=200, cached_tokens=0 if config == "baseline" else 128,
                           output_token_ids=toks, top_logprobs=[[["a", -0.1], ["b", -3.0]]] * len(toks),
                           prompt_sha="p%d" % i, prompt_block_hashes=["h0", "h1", "h2"])
                f.write(json.dumps(asdict(r)) + "\n")
    return folder


GOOD = [[1, 2, 3], [4, 5, 6]]
BAD = [[1, 9, 3], [4, 5, 6]]


def test_report_passes_when_the_canary_fails_and_the_rest_are_identical(tmp_path):
    run = make_run(tmp_path / "run1", {"baseline": GOOD, "apc": GOOD, "canary-shift": BAD})
    assert report.write(run) == 0
    md = (run / "report.md").read_text()
    assert "`apc`: fidelity **PASS**" in md and "`canary-shift`: fidelity **FAIL**" in md
    for name in ("summary.csv", "scores.csv", "verdicts.csv", "ttft_cdf.png", "ttft_vs_cached.png",
                 "hit_rates.png", "fidelity_matrix.png"):
        assert (run / name).stat().st_size > 0, name
    assert "vLLM 0.32.0" in md and "kvscope bench (test)" in md


def test_gate_fails_on_a_candidate_fail_and_on_a_silent_canary(tmp_path):
    assert report.write(make_run(tmp_path / "a", {"baseline": GOOD, "apc": BAD, "canary-shift": BAD})) == 1
    assert report.write(make_run(tmp_path / "b", {"baseline": GOOD, "apc": GOOD, "canary-shift": GOOD})) == 1


def test_missing_golden_records_are_named(tmp_path):
    run = make_run(tmp_path / "run", {"apc": GOOD, "canary-shift": BAD})
    with pytest.raises(report.RunError, match=r"baseline__s\.jsonl: golden records missing"):
        report.write(run)


def test_truncated_records_are_named(tmp_path):
    run = make_run(tmp_path / "run", {"baseline": GOOD, "apc": GOOD, "canary-shift": BAD})
    with open(run / "records" / "apc__s.jsonl", "a") as f:
        f.write('{"config": "apc", "scen')
    with pytest.raises(report.RunError, match=r"apc__s\.jsonl:3: truncated"):
        report.write(run)


def test_compare_refuses_runs_with_different_workloads(tmp_path):
    a = make_run(tmp_path / "a", {"baseline": GOOD, "apc": GOOD, "canary-shift": BAD})
    b = make_run(tmp_path / "b", {"baseline": GOOD, "apc": GOOD, "canary-shift": BAD})
    c = make_run(tmp_path / "c", {"baseline": GOOD, "apc": GOOD, "canary-shift": BAD}, workload=b'{"x": 1}\n')
    assert "| a |" in report.compare([a, b]) and "| b |" in report.compare([a, b])
    with pytest.raises(report.RunError, match="different workloads"):
        report.compare([a, c])


def test_a_config_that_did_not_start_gets_a_crashed_row_and_fails_the_gate(tmp_path):
    run = make_run(tmp_path / "run1", {"baseline": GOOD, "apc": GOOD, "canary-shift": BAD})
    doc = json.loads((run / "run.json").read_text())
    doc["crashed"] = [{"config": "ucm-blend", "why": "process died",
                       "error": "Connector UCMBlendConnector uses deprecated 2-argument constructor signature."},
                      {"config": "canary-perturb", "role": "canary", "why": "process died", "error": "boom"}]
    (run / "run.json").write_text(json.dumps(doc))
    assert report.write(run) == 1
    md = (run / "report.md").read_text()
    assert "| ucm-blend | candidate | **CRASHED** (unexpected)" in md
    assert "| canary-perturb | canary | **CRASHED** (unexpected)" in md  # a canary that never ran proves nothing
    assert "`ucm-blend`: **did not start** (process died): `Connector UCMBlendConnector" in md
