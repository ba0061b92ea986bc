"""Reports from raw records alone: verdicts, the gate's exit code, detection power, and bad input named by file.

Each loophole that let a run PASS without evidence has a test here: failed or missing answers, a scenario
that never ran, no cache hits, answers without token ids, a golden server that was not cache-off.
"""

import io
import json
import math

import numpy as np
import pandas as pd
import pytest

from kvscope.analyze import comparison, fidelity, loaded, report
from kvscope.artifacts import ArtifactError, Record

SERVERS = [("baseline", "golden"), ("control", "control"), ("apc", "candidate"), ("canary-shift", "canary")]
GOOD = [[1, 2, 3], [4, 5, 6]]
BAD = [[1, 9, 3], [7, 5, 6]]
SCENARIO = {"name": "s", "kind": "rag"}  # as an older run.json records it: no load level


def finite(lp: float) -> float | None:
    """A logprob as a record holds it: None where the server sent one that is not a number."""
    return None if math.isnan(lp) else lp


def make_run(folder, outputs: dict[str, list[list[int]]], workload_lines=None, servers=SERVERS, status=True,
             mode="normal", **per_config):
    """A run folder as bench writes it. outputs: tokens per answer and config; per_config[config] may set
    `cached` (tokens per answer), `failed` (indexes of failed answers), `offset` (added to every logprob; NaN: none is a number)."""
    (folder / "records").mkdir(parents=True)
    (folder / "workloads").mkdir()
    n = len(next(iter(outputs.values())))
    lines = n if workload_lines is None else workload_lines
    (folder / "workloads" / "s.measure.jsonl").write_text("".join(f'{{"request_id": "r{i}"}}\n' for i in range(lines)))
    docs = [{"config": c, "role": r, "port": 8100 + i, "platform": "cpu", "vllm_version": "0.32.0",
             "served_model_name": "tiny", "model_path": "/m/tiny-qwen3", "model_hash": "f" * 64,
             "kv_capacity_tokens": 1024, "block_size": 64, "prefix_caching": False,
             "server_args": ["--model", "/m", "--port", str(8100 + i), "--dtype", "float32"]}
            for i, (c, r) in enumerate(servers)]
    run = {"run_id": folder.name, "command": "kvscope bench (test)", "servers": docs, "scenarios": {"s": SCENARIO},
           "machine": {"cpu": "test", "cores": 2, "memory_gib": 1, "arch": "x86_64", "os": "linux", "python": "3",
                       "gpu": None},
           "load": {"users": 1, "processes": 1, "rate_sessions_per_s": 0.0}, "kv_capacity_tokens_for_sizing": 1024, "mode": mode}
    (folder / "run.json").write_text(json.dumps(run))
    if status:
        (folder / "status.jsonl").write_text("".join(json.dumps({"config": c, "scenario": "s", "phases": {}}) + "\n"
                                                     for c in outputs))
    for config, outs in outputs.items():
        opts = per_config.get(config.replace("-", "_"), {})
        role = dict(servers).get(config)
        with open(folder / "records" / f"{config}__s.jsonl", "w") as f:
            for i, toks in enumerate(outs):
                ok = i not in opts.get("failed", ())
                cached = opts.get("cached", [0 if role in ("golden", "control") else 128] * len(outs))[i]
                off = opts.get("offset", 0.0)
                r = Record(config=config, scenario="s", phase="measure", request_id=f"r{i}", session_id=f"r{i}",
                           turn=0, endpoint="chat", start_unix_s=float(i), ok=ok, error=None if ok else "HTTP 500",
                           ttft_s=0.1 + 0.01 * i, e2e_s=0.5, itl_s=[0.01], prompt_tokens=200, cached_tokens=cached,
                           output_token_ids=toks, top_logprobs=[[[t, finite(-0.1 + off)], [999, finite(-3.0 + off)]] for t in toks],
                           prompt_sha=f"p{i}", prompt_block_hashes=["h0", "h1", "h2"])
                f.write(r.model_dump_json() + "\n")
    return folder


def test_exact_mode_fails_a_difference_the_normal_tolerance_would_pass_and_shows_no_speed(tmp_path):
    normal = make_run(tmp_path / "normal", four(), apc={"offset": 1e-7})
    assert report.write(normal, min_hits=1) == 0  # within 3 x the control's 0 floor, at fp32's least tolerance
    exact = make_run(tmp_path / "exact", four(), mode="exact", apc={"offset": 1e-7})
    assert report.write(exact, min_hits=1) == 1
    v = verdicts(exact)
    assert v.verdict["apc"] == "FAIL" and "bitwise equal expected" in v.why["apc"] and v.verdict["control"] == "PASS"
    md = (exact / "report.md").read_text()
    assert "- Mode: **exact**" in md and "no speed-up, TTFT or throughput here" in md
    summary = pd.read_csv(exact / "overview.csv").set_index("config")
    assert summary.speedup_hits.isna().all() and summary.requests_per_s.isna().all()
    scorer = json.loads((exact / "run.json").read_text())["scorer"]
    assert scorer["mode"] == "exact" and scorer["tolerance_nats"] == 0.0


def test_in_exact_mode_a_control_that_differs_says_the_stack_is_not_invariant_and_fails_the_gate(tmp_path):
    run = make_run(tmp_path / "run", four(), mode="exact", control={"offset": 1e-7})
    assert report.write(run, min_hits=1) == 1
    assert verdicts(run).verdict["control"] == "FAIL"
    md = (run / "report.md").read_text()
    assert "**Exact mode does not hold on this stack**: 2 of the control's answers" in md
    assert "control vs golden, `r0@measure` token 0: 1e-07 nat" in md


def test_a_control_answer_that_splits_at_token_0_counts_as_differing(tmp_path):
    # the H200 trace run: 4 of the control's answers split from golden at token 0, where no position is
    # compared, and the report said "96 of them differ at all" of 100 that all differed; in exact mode such a
    # control would not have said the stack is not invariant
    outputs = four()
    outputs["control"] = [[9, 2, 3], [4, 5, 6]]
    run = make_run(tmp_path / "run", outputs, mode="exact")
    assert report.write(run, min_hits=1) == 1
    md = (run / "report.md").read_text()
    assert "**Exact mode does not hold on this stack**: 1 of the control's answers" in md


def verdicts(run):
    return pd.read_csv(run / "verdicts.csv").set_index("config")


def four(apc=GOOD, canary=BAD):
    return {"baseline": GOOD, "control": GOOD, "apc": apc, "canary-shift": canary}


def test_report_passes_when_the_canary_fails_and_the_rest_are_identical(tmp_path):
    run = make_run(tmp_path / "run1", four())
    assert report.write(run, min_hits=1) == 0
    md = (run / "report.md").read_text()
    assert "| apc | candidate | **PASS** | 2 verified cache hits |" in md
    assert "| canary-shift | canary | **FAIL** |" in md and "every verdict as expected (exit 0)" in md
    for name in ("summary.csv", "scores.csv", "verdicts.csv", "power.csv", "ttft_cdf.png", "ttft_vs_cached.png",
                 "hit_rates.png", "fidelity_matrix.png"):
        assert (run / name).stat().st_size > 0, name
    assert "vLLM 0.32.0" in md and "kvscope bench (test)" in md and "- load: users 1, processes 1, rate_sessions_per_s 0.0;" in md
    assert '<details markdown="1"><summary>Server flags per config</summary>' in md  # folded: summary first
    page = (run / "report.html").read_text()  # one self-contained page: every plot inline, nothing fetched
    assert page.count('src="data:image/png;base64,') == 4 and "<table>" in page and 'src="http' not in page
    scorer = json.loads((run / "run.json").read_text())["scorer"]
    assert scorer["version"] == fidelity.SCORER_VERSION and scorer["direct_noise_nats"] == 0.0


def test_gate_fails_on_a_candidate_fail_and_on_a_silent_canary(tmp_path):
    assert report.write(make_run(tmp_path / "a", four(apc=BAD)), min_hits=1) == 1
    assert report.write(make_run(tmp_path / "b", four(canary=GOOD)), min_hits=1) == 1


def test_most_requests_failed_is_incomplete_not_pass(tmp_path):
    run = make_run(tmp_path / "run", four(), apc={"failed": [0]})
    assert report.write(run, min_hits=1) == 3
    assert verdicts(run).loc["apc", "verdict"] == "INCOMPLETE"
    assert "1 of 2 requests failed" in verdicts(run).loc["apc", "why"]


def test_a_locust_run_cut_short_is_incomplete(tmp_path):
    outputs = four()
    outputs["apc"] = GOOD[:1]  # one record of two: Locust was killed after the first
    run = make_run(tmp_path / "run", outputs)
    assert report.write(run, min_hits=1) == 3
    assert verdicts(run).loc["apc", "why"] == "s: 1 of 2 answers recorded"


def test_a_scenario_that_never_ran_is_incomplete(tmp_path):
    outputs = four()
    del outputs["apc"]
    run = make_run(tmp_path / "run", outputs)  # apc is in run.json but has no status row and no records
    assert report.write(run, min_hits=1) == 3
    assert verdicts(run).loc["apc", "why"] == "scenario s did not run"


def test_a_treatment_stopped_mid_run_says_how_many_answers_it_recorded(tmp_path):
    # an H200 trace run stopped in kvscope-fs's treatment: 26 of 100 records, no status row; the report said
    # "did not run"
    outputs = four()
    outputs["apc"] = GOOD[:1]
    run = make_run(tmp_path / "run", outputs, status=False)
    (run / "status.jsonl").write_text("".join(json.dumps({"config": c, "scenario": "s", "phases": {}}) + "\n"
                                              for c in outputs if c != "apc"))
    assert report.write(run, min_hits=1) == 3
    assert verdicts(run).loc["apc", "why"] == "scenario s did not finish: 1 of 2 answers recorded"


def test_no_cache_hits_is_unverified(tmp_path):
    run = make_run(tmp_path / "run", four(), apc={"cached": [0, 0]})
    assert report.write(run, min_hits=1) == 3
    assert verdicts(run).loc["apc", "verdict"] == "UNVERIFIED"
    assert verdicts(run).loc["apc", "why"] == "0 verified cache hits (at least 1 needed)"


def test_answers_without_token_ids_are_incomplete_not_identical(tmp_path):
    run = make_run(tmp_path / "run", four(apc=[[], []]))
    assert report.write(run, min_hits=1) == 3
    assert verdicts(run).loc["apc", "why"] == "2 answers no-token-ids"


def test_a_golden_server_that_hit_a_cache_invalidates_the_run(tmp_path):
    run = make_run(tmp_path / "run", four(), baseline={"cached": [0, 64]})
    assert report.write(run, min_hits=1) == 3
    v = verdicts(run)
    assert v.loc["baseline", "verdict"] == "INVALID" and "1 of its answers report cached" in v.loc["baseline", "why"]
    assert v.loc["apc", "verdict"] == "UNVERIFIED" and "baseline is not cache-off" in v.loc["apc", "why"]


def test_a_golden_endpoint_that_nothing_shows_cache_off_invalidates_the_run(tmp_path):
    # an endpoint whose /metrics has no vllm:cache_config_info, answering without cached_tokens (vLLM without
    # --enable-prompt-tokens-details): its cache-off state was assumed, and every verdict judged against it
    run = make_run(tmp_path / "run", four(), baseline={"cached": [None, None]})
    doc = json.loads((run / "run.json").read_text())
    doc["servers"][0] |= {"prefix_caching": None, "platform": "endpoint"}
    (run / "run.json").write_text(json.dumps(doc))
    assert report.write(run, min_hits=1) != 0
    assert "nothing shows it cache-off" in verdicts(run).why["baseline"]
    answered = make_run(tmp_path / "answered", four())  # answers that report 0 cached tokens show it
    doc = json.loads((answered / "run.json").read_text())
    doc["servers"][0] |= {"prefix_caching": None, "platform": "endpoint"}
    (answered / "run.json").write_text(json.dumps(doc))
    assert report.write(answered, min_hits=1) == 0


def test_the_control_sets_the_tolerance(tmp_path):
    # control off by 1e-4: the tolerance is 3e-4, so apc off by 2e-4 passes, and off by 4e-4 fails
    run = make_run(tmp_path / "a", four(), control={"offset": 1e-4}, apc={"offset": 2e-4})
    assert report.write(run, min_hits=1) == 0
    assert json.loads((run / "run.json").read_text())["scorer"]["tolerance_nats"] == pytest.approx(3e-4)
    run = make_run(tmp_path / "b", four(), control={"offset": 1e-4}, apc={"offset": 4e-4})
    assert report.write(run, min_hits=1) == 1
    assert "logprob off by 0.0004 nat" in verdicts(run).loc["apc", "why"]


def test_without_a_control_the_tolerance_is_assumed_and_says_so(tmp_path):
    outputs = four()
    del outputs["control"]
    servers = [s for s in SERVERS if s[1] != "control"]
    run = make_run(tmp_path / "run", outputs, servers=servers, apc={"offset": 1e-3})
    assert report.write(run, min_hits=1) == 0
    assert "assumed (the run has no control)" in (run / "report.md").read_text()


def write_fault_log(run, config, changed: dict[int, int]):
    (run / "faults").mkdir(exist_ok=True)
    with open(run / "faults" / f"{config}__s.jsonl", "w") as f:
        for i, n in changed.items():
            f.write(json.dumps({"request": f"chatcmpl-r{i}@measure-0a1b2c3d", "fault": "shift", "loaded": 2,
                                "changed": n}) + "\n")


def certify(run, config, tiers):
    doc = json.loads((run / "run.json").read_text())
    next(s for s in doc["servers"] if s["config"] == config)["tiers"] = tiers
    (run / "run.json").write_text(json.dumps(doc))


def write_load_log(run, config, served: dict[int, dict[str, int]]):
    (run / "loads").mkdir(exist_ok=True)
    with open(run / "loads" / f"{config}__s.jsonl", "w") as f:
        for i, tiers in served.items():
            f.write(json.dumps({"request": f"cmpl-r{i}@measure-0a1b2c3d", **tiers}) + "\n")


def test_a_config_passes_only_for_the_tiers_that_served_verified_hits(tmp_path):
    run = make_run(tmp_path / "run", four())
    certify(run, "apc", ["ram", "disk"])
    write_load_log(run, "apc", {0: {"ram": 2}, 1: {"ram": 1, "disk": 1}})
    assert report.write(run, min_hits=2) == 3  # disk served one verified hit: not exercised, inconclusive
    why = verdicts(run).why["apc"]
    assert verdicts(run).verdict["apc"] == "UNVERIFIED"
    assert why == "PASS for ram; disk not exercised (1 verified hits, 2 needed)"
    assert "- `apc`: verified hits each tier served: ram 2, disk 1 (not exercised); it certifies ram, disk" in (
        run / "report.md").read_text()
    assert report.write(run, min_hits=1) == 0 and verdicts(run).why["apc"] == (
        "2 verified cache hits (by tier: ram 2, disk 1)")


def test_a_config_whose_certified_tiers_left_no_log_cannot_pass(tmp_path):
    run = make_run(tmp_path / "run", four())
    certify(run, "apc", ["disk"])
    assert report.write(run, min_hits=1) == 3
    assert verdicts(run).why["apc"] == "its tiers (disk) cannot be observed: no load log kept"


def test_detection_power_counts_the_hits_the_canary_broke(tmp_path):
    run = make_run(tmp_path / "run", four(canary=[[1, 9, 3], [4, 5, 6]]))
    write_fault_log(run, "canary-shift", {0: 2, 1: 0})  # it broke r0 (detected) and left r1 correct
    assert report.write(run, min_hits=1) == 0
    p = pd.read_csv(run / "power.csv").iloc[0]
    assert (p.affected_hits, p.detected, p.rate, p.unaffected_hits, p.unaffected_fail) == (1, 1, 1.0, 1, 0)
    assert p.rate_low95 == pytest.approx(0.2065, abs=1e-4)


def test_a_canary_missed_on_a_hit_it_broke_fails_the_gate(tmp_path):
    run = make_run(tmp_path / "run", four(canary=[[1, 9, 3], [4, 5, 6]]))
    write_fault_log(run, "canary-shift", {0: 2, 1: 1})  # r1 was broken too, and scored identical
    assert report.write(run, min_hits=1) == 1
    v = verdicts(run).loc["canary-shift"]
    assert v.verdict == "FAIL" and not v.as_expected and v.why == "detected on 1 of 2 hits it broke (goal 99%)"


def as_repeats(run, labels):
    """The run's one scenario `s` run again under each label (REPEATS): same workload, same request ids."""
    info = json.loads((run / "run.json").read_text())
    info["scenarios"] = {label: {**SCENARIO, "repeat": i + 1} for i, label in enumerate(labels)}
    info["load"] = {**info["load"], "repeats": len(labels)}
    (run / "run.json").write_text(json.dumps(info))
    for label in labels:
        (run / "workloads" / f"{label}.measure.jsonl").write_text((run / "workloads" / "s.measure.jsonl").read_text())
        for records in (run / "records").glob("*__s.jsonl"):  # each record still names its scenario "s"
            (run / "records" / records.name.replace("__s.", f"__{label}.")).write_text(records.read_text())
    for stale in [*(run / "records").glob("*__s.jsonl"), run / "workloads" / "s.measure.jsonl", run / "status.jsonl"]:
        stale.unlink()


def test_a_repeats_fault_and_load_logs_count_for_their_own_repetition_only(tmp_path):
    # the same request ids run in every repetition: the fault log of #1 (r1 broken, and caught) said nothing of
    # #2's r1, which the canary left correct; summed over repetitions, #2's r1 counted as a missed broken hit
    run = make_run(tmp_path / "run", four(canary=[[1, 9, 3], [4, 5, 6]]))
    as_repeats(run, ["s#1", "s#2"])
    canary = run / "records" / "canary-shift__s#1.jsonl"
    canary.write_text(canary.read_text().replace('"output_token_ids":[4,5,6]', '"output_token_ids":[7,5,6]'))
    (run / "faults").mkdir()
    (run / "loads").mkdir()
    for label, changed, apc_tier in (("s#1", {0: 2, 1: 1}, "ram"), ("s#2", {0: 2, 1: 0}, "disk")):
        (run / "faults" / f"canary-shift__{label}.jsonl").write_text("".join(
            json.dumps({"request": f"chatcmpl-r{i}@measure-0a1b2c3d", "fault": "shift", "loaded": 2, "changed": n})
            + "\n" for i, n in changed.items()))
        (run / "loads" / f"apc__{label}.jsonl").write_text("".join(
            json.dumps({"request": f"cmpl-r{i}@measure-0a1b2c3d", apc_tier: 2}) + "\n" for i in range(2)))
    certify(run, "apc", ["ram", "disk"])
    assert report.write(run, min_hits=2) == 0
    p = pd.read_csv(run / "power.csv").iloc[0]
    assert (p.affected_hits, p.detected, p.unaffected_hits, p.unaffected_fail) == (3, 3, 1, 0)
    assert verdicts(run).why["apc"] == "4 verified cache hits (by tier: ram 2, disk 2)"


def test_the_control_is_compared_with_golden_in_its_own_repetition(tmp_path):
    # golden and the control agree bitwise in each repetition, and #2's answers differ from #1's (another
    # batch): compared across repetitions, the control read as differing and exact mode's tier was lost
    run = make_run(tmp_path / "run", four(), mode="exact")
    as_repeats(run, ["s#1", "s#2"])
    for config in ("baseline", "control", "apc"):
        again = run / "records" / f"{config}__s#2.jsonl"
        again.write_text(again.read_text().replace('"output_token_ids":[4,5,6]', '"output_token_ids":[4,5,8]'))
    assert report.write(run, min_hits=1) == 0
    scorer = json.loads((run / "run.json").read_text())["scorer"]
    assert (scorer["control_answers"], scorer["control_differing"], scorer["tier"]) == (4, 0, "exact")


def test_an_exact_run_with_repeats_and_a_failing_hit_gets_its_report(tmp_path):
    # which stores gave a failing hit's answer was looked up by the records' own scenario ("s"), the scores'
    # by their column ("s#1"): nothing matched, and the report died on max() of nothing
    run = make_run(tmp_path / "run", four(apc=[[1, 2, 3], [4, 5, 7]]), mode="exact")
    as_repeats(run, ["s#1", "s#2"])
    assert report.write(run, min_hits=1) == 1
    assert "`r1` (128 cached tokens): apc" in (run / "report.md").read_text()


def test_missing_golden_records_are_named(tmp_path):
    from kvscope import cli

    outputs = four()
    del outputs["baseline"]
    run = make_run(tmp_path / "run", outputs)  # not interrupted (run.json says so): a folder assembled wrongly
    with pytest.raises(loaded.RunError, match=r"baseline__s\.jsonl: golden records missing"):
        report.write(run)
    assert cli.main(["report", str(run)]) == 2 and not (run / "report.md").exists()


def test_a_golden_treatment_that_recorded_nothing_loses_no_other_result(tmp_path, capsys):
    # golden's treatment ran (its status row says so) and its Locust died before the first answer: the
    # finished treatments are still reported, inconclusive, instead of the report refusing the folder
    from kvscope import cli

    run = make_run(tmp_path / "run", four())
    (run / "records" / "baseline__s.jsonl").unlink()
    status = [json.loads(x) for x in (run / "status.jsonl").read_text().splitlines()]
    status[0]["phases"] = {"measure": {"locust_exit": 2, "seconds": 1.0, "locust_stderr_tail": ["boom"]}}
    (run / "status.jsonl").write_text("".join(json.dumps(x) + "\n" for x in status))
    assert cli.main(["report", str(run)]) == 3
    assert "golden records missing for scenario s: golden recorded no answer" in capsys.readouterr().out
    assert verdicts(run).verdict["apc"] == "INCOMPLETE"


def interrupted_before_golden(folder, golden_file):
    """make_run's folder as a Ctrl-C in scenario t leaves it before golden's first record there: run.json says
    so, t has its workload and no status row; golden's records file is absent, or created and still empty."""
    run = make_run(folder, four())
    doc = json.loads((run / "run.json").read_text())
    doc["scenarios"]["t"], doc["interrupted"] = SCENARIO, "KeyboardInterrupt during baseline x t"
    (run / "run.json").write_text(json.dumps(doc))
    (run / "workloads" / "t.measure.jsonl").write_text('{"request_id": "r0"}\n')
    if golden_file == "empty":
        (run / "records" / "baseline__t.jsonl").touch()
    return run


@pytest.mark.parametrize("golden_file", ["absent", "empty"])
def test_a_run_interrupted_before_goldens_first_record_is_reported_inconclusive(tmp_path, capsys, golden_file):
    from kvscope import cli

    run = interrupted_before_golden(tmp_path / "run", golden_file)
    assert cli.main(["report", str(run)]) == 3  # inconclusive, not bad input (2)
    note = "golden records missing for scenario t: the run was interrupted before golden's first answer; " \
           "fidelity of its treatments not scored"
    assert note in capsys.readouterr().out and note in (run / "report.md").read_text()
    v = verdicts(run)
    assert v.verdict["apc"] == "INCOMPLETE" and v.verdict["control"] == "INCOMPLETE"  # no PASS without golden
    assert v.verdict["canary-shift"] == "FAIL" and v.as_expected["canary-shift"]  # s was scored
    fid = pd.read_csv(run / "summary.csv").set_index(["config", "scenario"]).fidelity
    assert fid["apc", "t"] == "golden missing" and fid["apc", "s"] == "ok"


def test_bench_report_interrupted_before_goldens_first_record_writes_the_report_and_exits_130(tmp_path,
                                                                                             monkeypatch):
    from kvscope import cli
    from kvscope.run import plan, treatments

    run = interrupted_before_golden(tmp_path / "cut", "absent")

    def ctrl_c(*args, **kw):
        raise treatments.Interrupted(run, "KeyboardInterrupt during baseline x t", 4, 8) from KeyboardInterrupt()

    monkeypatch.setattr(plan, "build", lambda options: None)  # the report is under test, not the plan
    monkeypatch.setattr(treatments, "run", ctrl_c)
    assert cli.main(["bench", "--run-id", "cut", "--results", str(tmp_path), "--report"]) == 130
    assert "golden records missing for scenario t" in (run / "report.md").read_text()


def test_truncated_records_are_named(tmp_path):
    run = make_run(tmp_path / "run", four())
    with open(run / "records" / "apc__s.jsonl", "a") as f:  # a line cut short, then another: not a full disk's
        f.write('{"config": "apc", "scen\n{}\n')
    with pytest.raises(loaded.RunError, match=r"apc__s\.jsonl:3: truncated"):
        report.write(run)


def test_compare_refuses_runs_with_different_workloads(tmp_path):
    a = make_run(tmp_path / "a", four())
    b = make_run(tmp_path / "b", four())
    c = make_run(tmp_path / "c", four(), workload_lines=3)
    text = comparison.write([a, b], tmp_path / "ab")
    assert "| apc | a |" in text and "| apc | b |" in text
    assert {p.name for p in (tmp_path / "ab").iterdir()} == {"comparison.md", "comparison.html", "speedup.png"}
    with pytest.raises(loaded.RunError, match="different workloads"):
        comparison.write([a, c])


def test_a_comparison_gives_each_configs_change_from_the_first_run(tmp_path):
    a = make_run(tmp_path / "a", four())
    b = make_run(tmp_path / "b", four())
    recs = b / "records" / "apc__s.jsonl"  # the second run's apc answers twice as fast
    lines = [json.loads(x) for x in recs.read_text().splitlines()]
    recs.write_text("".join(json.dumps({**x, "ttft_s": x["ttft_s"] / 2}) + "\n" for x in lines))
    t = comparison.table([a, b]).set_index(["run", "config"])
    assert t.loc[("b", "apc"), "hit_ttft_p50_ms"] == 52.5 and t.loc[("b", "apc"), "hit_ttft_p50_ms_change"] == -0.5
    assert t.loc[("b", "apc"), "speedup_hits"] == 2.0 and t.loc[("b", "apc"), "speedup_hits_change"] == 1.0
    assert t.loc[("a", "apc"), "speedup_hits_change"] == 0.0
    assert "different machines" not in comparison.write([a, b])


def test_a_comparison_says_when_its_runs_come_from_different_machines(tmp_path):
    a, b = make_run(tmp_path / "a", four()), make_run(tmp_path / "b", four())
    doc = json.loads((b / "run.json").read_text())
    doc["machine"]["cpu"] = "AMD EPYC"  # the published CPU runs' TTFT doubled between two such machines
    (b / "run.json").write_text(json.dumps(doc))
    assert "**These runs come from different machines** (`a`: test, 2 cores, GPU none; `b`: AMD EPYC" in (
        comparison.write([a, b]))


def test_a_comparison_says_when_its_runs_come_from_different_gpus(tmp_path):
    a, b = make_run(tmp_path / "a", four()), make_run(tmp_path / "b", four())
    for run, gpu in ((a, "NVIDIA H200, 143771 MiB, 580.159.04"), (b, "NVIDIA GB10, 122502 MiB, 580.95.05")):
        doc = json.loads((run / "run.json").read_text())
        doc["machine"]["gpu"] = gpu  # the same CPU and cores: the GPU alone tells the machines apart
        (run / "run.json").write_text(json.dumps(doc))
    text = comparison.write([a, b])
    assert "**These runs come from different machines** (`a`: test, 2 cores, GPU NVIDIA H200, 143771 MiB, " \
           "580.159.04; `b`: test, 2 cores, GPU NVIDIA GB10" in text


def test_a_comparison_of_an_exact_and_a_normal_run_gives_the_exact_modes_cost(tmp_path):
    a, b = make_run(tmp_path / "a", four()), make_run(tmp_path / "b", four())
    doc = json.loads((b / "run.json").read_text())
    doc["mode"] = "exact"
    (b / "run.json").write_text(json.dumps(doc))
    slower = {"baseline": 1.5, "control": 1.5, "apc": 2.0, "canary-shift": 2.0}  # as batch-invariant serving is
    for recs in (b / "records").glob("*.jsonl"):
        k = slower[recs.name.split("__")[0]]
        lines = [json.loads(x) for x in recs.read_text().splitlines()]
        recs.write_text("".join(json.dumps({**x, "ttft_s": x["ttft_s"] * k, "itl_s": [t * k for t in x["itl_s"]],
                                            "e2e_s": x["e2e_s"] * k, "start_unix_s": x["start_unix_s"] * k})
                                 + "\n" for x in lines))
    for runs in ([a, b], [b, a]):  # either order: the change is exact against normal
        cost = comparison.mode_cost(runs).set_index("config")
        assert cost.loc["baseline", "ttft_p50_ms_exact"] == round(1.5 * cost.loc["baseline", "ttft_p50_ms_normal"], 2)
        assert cost.loc["baseline", "ttft_p50_change"] == 0.5 and cost.loc["apc", "ttft_p50_change"] == 1.0
        assert cost.loc["baseline", "tpot_p50_change"] == 0.5 and cost.loc["apc", "tpot_p50_change"] == 1.0
        assert cost.loc["apc", "tokens_per_s_change"] == -0.5  # twice the time for the same tokens
    assert "The exact mode's cost" in comparison.write([a, b])
    assert comparison.mode_cost([a, a]) is None and "mode's cost" not in comparison.write([a, a])
    assert comparison.mode_cost([a, b, a]) is None


def test_a_config_that_did_not_start_gets_a_crashed_row_and_fails_the_gate(tmp_path):
    run = make_run(tmp_path / "run1", four())
    doc = json.loads((run / "run.json").read_text())
    doc["crashed"] = [{"config": "ucm-blend", "why": "process died",
                       "error": "Connector UCMBlendConnector uses deprecated 2-argument constructor signature."},
                      {"config": "canary-perturb", "role": "canary", "why": "process died", "error": "boom"}]
    (run / "run.json").write_text(json.dumps(doc))
    assert report.write(run, min_hits=1) == 1
    md = (run / "report.md").read_text()
    assert "| ucm-blend | candidate | **CRASHED** (unexpected)" in md
    assert "| canary-perturb | canary | **CRASHED** (unexpected)" in md  # a canary that never ran proves nothing
    assert "`ucm-blend`: **did not start** (process died): `Connector UCMBlendConnector" in md


def test_the_summary_comes_first_with_numbers_checked_by_hand(tmp_path):
    run = make_run(tmp_path / "run1", four())
    report.write(run, min_hits=1)
    md = (run / "report.md").read_text()
    assert md.index("## Summary") < md.index("## Verdicts")
    ov = pd.read_csv(run / "overview.csv").set_index("config")
    apc = ov.loc["apc"]  # two hits, TTFT 100 and 110 ms, golden the same on the same requests
    assert apc.hits == 2 and apc.hit_ttft_p50_ms == 105.0 and apc.golden_ttft_p50_ms == 105.0
    assert apc.speedup_hits == 1.0 and apc.speedup_ci95 == "1.00–1.00"
    assert apc.advice == "safe on 2 verified hits, 1.00x on hits, not measurably faster"
    assert round(apc.requests_per_s, 2) == 1.33 and apc.output_tokens_per_s == 4.0  # 2 answers, 6 tokens, 1.5 s
    assert ov.loc["canary-shift"].advice == "wrong KV caught: 2 of 2 hits it broke"
    assert ov.loc["baseline"].advice == "the cache-off reference"


def test_a_speedup_interval_is_a_paired_bootstrap():
    from kvscope.analyze import overview

    point, low, high = overview.ratio_ci([(0.2, 0.1)] * 10 + [(0.2, 0.05)] * 10)
    assert point == pytest.approx(0.2 / 0.075) and 2.0 <= low <= point <= high <= 4.0
    assert overview.ratio_ci([]) is None


def test_a_percentile_needs_enough_samples_and_n_stands_beside_it(tmp_path):
    run = make_run(tmp_path / "run1", four())
    report.write(run, min_hits=1)
    s = pd.read_csv(run / "summary.csv").set_index("config").loc["apc"]
    assert s.n_hit == 2 and s.ttft_p50_ms_hit == 105.0
    assert pd.isna(s.ttft_p90_ms_hit) and pd.isna(s.ttft_p99_ms_hit)  # 2 samples: no p90, no p99


def test_the_tier_table_sums_where_tokens_came_from_over_the_measure_phases():
    from kvscope.analyze import overview
    from kvscope.artifacts import StatusRow

    def row(scenario, ram, fs, seconds):
        delta = {"vllm:prompt_tokens_by_source_total{source=local_compute}": 100.0,
                 "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}": 64.0 * (ram + fs),
                 "kvscope:connector_ram_hits_total": ram, "kvscope:connector_fs_hits_total": fs,
                 "kvscope:connector_load_seconds_total": seconds}
        phase = {"locust_exit": 0, "seconds": 1.0, "metrics_delta": delta}
        return StatusRow(config="kvscope-fs", scenario=scenario, phases={"measure": phase, "prime": phase})

    t = overview.tiers([row("a", 2.0, 1.0, 0.003), row("b", 0.0, 1.0, 0.001)]).set_index("config").loc["kvscope-fs"]
    assert (t.tokens_computed, t.tokens_from_connector, t.ram_block_hits, t.disk_block_hits) == (200, 256, 2, 2)
    assert t.load_ms_per_block == 1.0  # 4 ms over 4 blocks; prime phases are not counted
    assert "corrupt_blocks" not in t  # zero everywhere: left out


def test_speculative_decodings_draft_and_accepted_tokens_are_kept_and_summed():
    from kvscope.analyze import overview
    from kvscope.artifacts import StatusRow
    from kvscope.run import metrics

    page = ("# TYPE vllm:spec_decode_num_draft_tokens_total counter\n"  # as vLLM writes it
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0\n'
            "# TYPE vllm:spec_decode_num_accepted_tokens_total counter\n"
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 4.0\n')
    delta = metrics.parse(page)
    assert delta == {"vllm:spec_decode_num_draft_tokens_total": 30.0, "vllm:spec_decode_num_accepted_tokens_total": 4.0}
    phase = {"locust_exit": 0, "seconds": 1.0, "metrics_delta": delta}
    t = overview.tiers([StatusRow(config="apc", scenario="a", phases={"measure": phase})]).set_index("config").loc["apc"]
    assert (t.draft_tokens, t.accepted_draft_tokens) == (30, 4)


def test_goodput_under_an_slo_counts_the_requests_that_met_it(tmp_path):
    from kvscope.analyze import overview

    run = make_run(tmp_path / "run1", four())  # TTFT 100 and 110 ms, one 10 ms gap between tokens
    report.write(run, min_hits=1, slo=overview.parse_slo("ttft=105,tpot=20"))
    apc = pd.read_csv(run / "overview.csv").set_index("config").loc["apc"]
    assert apc.tpot_p50_ms == 10.0 and apc.slo_met == 0.5 and apc.goodput_per_s == round(0.5 * 2 / 1.5, 2)
    assert "SLO: TTFT <= 105 ms and TPOT <= 20 ms" in (run / "report.md").read_text()
    with pytest.raises(ValueError, match="expected ttft=MS"):
        overview.parse_slo("latency=5")


def test_a_cache_that_was_not_reset_is_said_in_the_report(tmp_path):
    run = make_run(tmp_path / "run1", four(), status=False)
    rows = {"apc": {"reset_prefix_cache_http": 404, "stores_wiped": []},
            "canary-shift": {"reset_prefix_cache_http": 200, "stores_wiped": [], "stores_refused": ["kv"]},
            "baseline": {"reset_prefix_cache_http": 404}, "control": {"reset_prefix_cache_http": 200}}
    (run / "status.jsonl").write_text("".join(json.dumps({"config": c, "scenario": "s", "phases": {}, "reset": r})
                                              + "\n" for c, r in rows.items()))
    doc = json.loads((run / "run.json").read_text())
    doc["servers"].append({**doc["servers"][-1], "config": "ucm", "port": 8199, "stores": {"ucm": "/s/ucm"},
                           "store_reset": "keep", "upstream": ["https://github.com/o/r/issues/1"]})
    (run / "run.json").write_text(json.dumps(doc))
    report.write(run, min_hits=1)
    md = (run / "report.md").read_text()
    assert "`apc`: **cache state not controlled**" in md and "answered 404" in md
    assert "`ucm`: **cache state not controlled**" in md and "['ucm'] are kept between treatments" in md
    assert "- `ucm`: upstream reports about this path: <https://github.com/o/r/issues/1>" in md
    assert "`canary-shift`: **cache state not controlled**" in md and "['kv'] lie outside" in md
    assert "`baseline`: **cache state not controlled**" not in md  # cache-off: nothing to reset


def test_a_load_sweep_and_repeats_become_their_own_columns_and_a_sweep_table(tmp_path):
    from kvscope.analyze import overview
    from kvscope.run.plan import variants

    assert list(variants(["s"], [1, 4], 2)) == ["s@u1#1", "s@u4#1", "s@u1#2", "s@u4#2"]
    assert list(variants(["s"], [2], 1)) == ["s"]
    run = make_run(tmp_path / "run1", four())
    info = json.loads((run / "run.json").read_text())
    labels = variants(["s"], [1, 4], 2)
    info["scenarios"] = {label: {**SCENARIO, "users": u, "repeat": r} for label, (_, u, r) in labels.items()}
    info["load"] = {**info["load"], "users": [1, 4], "repeats": 2}
    (run / "run.json").write_text(json.dumps(info))
    for label in labels:
        (run / "workloads" / f"{label}.measure.jsonl").write_text((run / "workloads" / "s.measure.jsonl").read_text())
        for config in four():
            text = (run / "records" / f"{config}__s.jsonl").read_text().replace('"scenario":"s"',
                                                                               f'"scenario":"{label}"')
            (run / "records" / f"{config}__{label}.jsonl").write_text(text)
    for stale in [*(run / "records").glob("*__s.jsonl"), run / "workloads" / "s.measure.jsonl", run / "status.jsonl"]:
        stale.unlink()
    report.write(run, min_hits=1)
    sweep = pd.read_csv(run / "sweep.csv")
    assert list(sweep[sweep.config == "apc"].users) == [1, 4] and (run / "load_sweep.png").exists()
    assert pd.read_csv(run / "overview.csv").set_index("config").loc["apc"].speedup_repeats == "1.00–1.00 over 2"
    assert overview.sweep(report.analyze(loaded.load(run)).loaded.run, {}).requests_per_s.isna().all()  # no records, no throughput


def test_throughput_spans_each_repetition_alone(tmp_path):
    # each repetition's records name the scenario alone ("s"); measured as one span, the other servers'
    # treatments between two repetitions counted as this server's time: 0.02 requests/s instead of 1
    from kvscope.analyze import overview

    def answer(t: float) -> Record:
        return Record(config="apc", scenario="s", phase="measure", request_id=f"r{t}", session_id="s", turn=0,
                      endpoint="chat", start_unix_s=t, e2e_s=1.0, ok=True, output_token_ids=[1] * 10)

    recs = {("apc", "s#1"): [answer(float(i)) for i in range(10)], ("apc", "s#2"): [answer(1000.0 + i) for i in range(10)]}
    assert overview.throughput(overview.columns(recs, "apc")) == (1.0, 10.0)


def test_a_sweep_over_a_scenario_that_sets_its_own_users_is_no_sweep(tmp_path):
    # USERS=1,16 over a scenario of 8 users runs 8 in both columns: the rows said 1 and 16, a load curve
    # between two runs at the same load
    from kvscope.analyze import overview

    run = make_run(tmp_path / "run", four())
    info = json.loads((run / "run.json").read_text())
    info["scenarios"] = {f"s@u{u}": {**SCENARIO, "users": u, "locust_users": 8} for u in (1, 16)}
    (run / "run.json").write_text(json.dumps(info))
    for u in (1, 16):
        (run / "workloads" / f"s@u{u}.measure.jsonl").write_text((run / "workloads" / "s.measure.jsonl").read_text())
        for records in (run / "records").glob("*__s.jsonl"):
            (run / "records" / records.name.replace("__s.", f"__s@u{u}.")).write_text(records.read_text())
    for stale in [*(run / "records").glob("*__s.jsonl"), run / "workloads" / "s.measure.jsonl", run / "status.jsonl"]:
        stale.unlink()
    done = loaded.load(run)
    assert overview.sweep(done.run, done.recs).empty


def test_a_connector_module_that_does_not_import_is_named_in_the_report(tmp_path):
    run = make_run(tmp_path / "run1", four())
    doc = json.loads((run / "run.json").read_text())
    doc["servers"][2]["connector_imports"] = {"lmcache.integration.vllm.vllm_v1_adapter": "ok",
                                              "lmcache.cuda_ops": "ImportError: undefined symbol: _ZN3c10"}
    (run / "run.json").write_text(json.dumps(doc))
    report.write(run, min_hits=1)
    md = (run / "report.md").read_text()
    assert ("connector modules of apc: `lmcache.integration.vllm.vllm_v1_adapter` ok, `lmcache.cuda_ops` "
            "**does not import**: ImportError: undefined symbol: \\_ZN3c10") in md  # escaped: it could open emphasis


def test_a_report_has_one_speed_up_the_summarys(tmp_path):
    # the verdict table once carried a median of per-scenario speed-ups beside the summary's pooled one, and
    # the two disagreed in a published report (0.8 against 0.94): speed lives in the summary alone
    run = make_run(tmp_path / "run", four())
    report.write(run, min_hits=1)
    assert not [c for c in pd.read_csv(run / "verdicts.csv").columns if "speedup" in c]
    md = (run / "report.md").read_text()
    verdict_table = md.split("## Verdicts", 1)[1].split("\n\n", 2)[1]
    assert "speedup" not in verdict_table and "speed-up" in md.split("## Verdicts", 1)[0]


def test_the_summary_keeps_candidates_apart_from_canaries(tmp_path):
    run = make_run(tmp_path / "run", four())
    report.write(run, min_hits=1)
    summary = (run / "report.md").read_text().split("## Summary", 1)[1].split("## Verdicts", 1)[0]
    first, canaries = summary.split("\n| config |")[1], summary.split("Canaries")[1]
    assert "| apc |" in first and "canary-shift" not in first
    assert "| canary-shift | **FAIL** | wrong KV caught" in canaries and "speed-up" not in canaries.split("\n\n")[1]


def test_the_html_colours_each_verdict(tmp_path):
    run = make_run(tmp_path / "run", four())
    report.write(run, min_hits=1)
    page = (run / "report.html").read_text()
    assert '<strong class="verdict-fail">FAIL</strong>' in page and '<strong class="verdict-pass">PASS</strong>' in page
    assert ".verdict-fail" in page and ".verdict-pass" in page  # styled, not only named


def _png(xs, ys, xmax: float | None = None) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3), dpi=100)
    ax.plot(xs, ys)
    ax.set(xscale="log")
    if xmax:
        ax.set_xlim(right=xmax)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def test_one_plot_drawn_on_two_cpus_counts_as_alike_and_a_changed_plot_does_not():
    # numpy's log10 differs in the last bit with and without AVX-512, which moved a log axis's edge by a
    # pixel: a published plot re-rendered on another CPU differed in 476 of 244,944 pixels
    from PIL import Image

    from kvscope.analyze import plots

    xs, ys = [100, 300, 1000, 3000], [0.1, 0.4, 0.8, 1.0]
    drawn = _png(xs, ys, 4000)
    assert plots.drawn_alike(drawn, drawn)
    pixels = np.asarray(Image.open(io.BytesIO(drawn))).copy()
    pixels[:, 300:] = pixels[:, 299:-1].copy()  # everything right of column 300 one pixel over, as on the CPUs
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="png")
    assert buf.getvalue() != drawn and plots.drawn_alike(buf.getvalue(), drawn)
    assert not plots.drawn_alike(_png(xs, ys, 4000 * 1.004), drawn)  # an axis limit moved: every line with it
    assert not plots.drawn_alike(_png(xs, [0.1, 0.5, 0.8, 1.0], 4000), drawn)  # one point moved
    assert not plots.drawn_alike(_png([*xs, 3500], [*ys, 1.0], 4000), drawn)  # a point added


def test_the_environment_names_the_serving_path_each_server_ran(tmp_path):
    plain = make_run(tmp_path / "plain", four())
    report.write(plain, min_hits=1)
    assert "serving path" not in (plain / "report.md").read_text()  # none picked: no line, no key
    run = make_run(tmp_path / "fp8", four())
    doc = json.loads((run / "run.json").read_text())
    doc["servers"] = [{**s, "serving_path": "fp8-kv"} for s in doc["servers"]]
    (run / "run.json").write_text(json.dumps(doc))
    report.write(run, min_hits=1)
    md = (run / "report.md").read_text()
    assert ("- serving path (docs/paths.md): `fp8-kv` on `baseline`, `control`, `apc`, `canary-shift`\n"
            in md.split("## Environment", 1)[1])
    assert all(s["serving_path"] == "fp8-kv" for s in json.loads((run / "run.json").read_text())["servers"])


def test_the_environment_says_per_server_whether_vllms_extensible_kv_cache_sized_it(tmp_path):
    # vLLM 0.34 sizes its KV cache after warm-up on CUDA (enable_extensible_kv_cache) unless
    # --kv-cache-memory-bytes is set; older servers do not report it, and their reports stay as they were
    plain = make_run(tmp_path / "plain", four())
    report.write(plain, min_hits=1)
    assert "extensible KV cache" not in (plain / "report.md").read_text()
    run = make_run(tmp_path / "v034", four())
    doc = json.loads((run / "run.json").read_text())
    doc["servers"] = [{**s, "extensible_kv_cache": s["config"] == "apc"} for s in doc["servers"]]
    (run / "run.json").write_text(json.dumps(doc))
    report.write(run, min_hits=1)
    env = (run / "report.md").read_text().split("## Environment", 1)[1]
    assert "- KV cache sized by vLLM's extensible KV cache (after warm-up) on `apc`; by its profile or " \
           "`--kv-cache-memory-bytes` on `baseline`, `control`, `canary-shift`\n" in env


SHAPE = {"num_hidden_layers": 6, "hidden_size": 256, "intermediate_size": 768, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 3072, "torch_dtype": "float32"}


def environment_shape(tmp_path, name, model_config) -> tuple[str, str]:
    """The Environment's model-shape line of a run whose servers' manifests recorded MODEL_CONFIG, in report.md
    and as report.html shows it."""
    run = make_run(tmp_path / name, four())
    doc = json.loads((run / "run.json").read_text())
    doc["servers"] = [{**s, "model_config": model_config} for s in doc["servers"]]
    (run / "run.json").write_text(json.dumps(doc))
    report.write(run, min_hits=1)
    line = next(x for x in (run / "report.md").read_text().split("## Environment", 1)[1].splitlines()
                if "model shape:" in x)
    return line, (run / "report.html").read_text()


@pytest.mark.parametrize("name, pattern, named", [
    ("gemma3", {"sliding_window": 128, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
     "; attention: 5 sliding_attention : 1 full_attention layers, sliding window 128 tokens"),
    ("qwen3-next", {"full_attention_interval": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                    "num_nextn_predict_layers": 1},
     "; attention: 3 linear_attention : 1 full_attention layers, MTP head of 1 layer"),
    ("deepseek-v2", {"kv_lora_rank": 512, "qk_rope_head_dim": 64},
     "; attention: MLA (a 512-wide latent vector + a 64-wide RoPE key a token)"),
    ("awq", {"quantization_config": {"bits": 4, "group_size": 128, "quant_method": "awq"}},
     "; attention: weights awq 4-bit, groups of 128"),
    ("interval", {"full_attention_interval": 4, "sliding_window_pattern": 6},
     "; attention: 1 full-attention layer in 4, 1 global layer in 6"),
    ("qwen2", {"sliding_window": 32768, "use_sliding_window": False},
     "; attention: no sliding window (use_sliding_window false)"),
])
def test_the_environment_names_the_models_attention_types_and_layer_pattern(tmp_path, name, pattern, named):
    """run.json records each shape's attention types and layer pattern (servers.MODEL_KEYS); the Environment
    names them after the sizes. A run without them (every published run) keeps its line as it was."""
    before = "- server packages: not recorded; model shape: 6 layers, hidden 256, 4 heads / 2 KV heads x 64, " \
             "vocab 3072, weights stored as float32"
    assert environment_shape(tmp_path, "plain", SHAPE)[0] == before
    assert environment_shape(tmp_path, name, {**SHAPE, **pattern})[0] == before + named


def test_a_recorded_layer_pattern_cannot_forge_the_reports_markdown_or_html(tmp_path):
    forged = ["<script>alert(1)</script>", "x | **PASS** |\n## Verdicts", 7, None]
    line, page = environment_shape(tmp_path, "forged", {**SHAPE, "layer_types": forged, "quantization_config": "awq",
                                                        "sliding_window": "<img src=x onerror=alert(2)>",
                                                        "kv_lora_rank": [1]})
    assert "<script>alert" not in page and "<img src=x" not in page and "&lt;img src=x onerror=alert(2)&gt;" in page
    assert "&lt;script>alert(1)&lt;/script>" in line and "x \\| \\*\\*PASS\\*\\* \\| ## Verdicts" in line
    assert "1 &lt;script>alert(1)&lt;/script> : 1" in line and "&lt;img src=x onerror=alert(2)> tokens" in line


# The verdict's tier (issue 61 item 4): exact where the run proves invariance, statistical elsewhere, with the
# power its floor allows per canary class and whether a 1e-3 noise fault may hide under that floor.

def set_fault(run, config, fault):
    doc = json.loads((run / "run.json").read_text())
    next(s for s in doc["servers"] if s["config"] == config)["fault"] = fault
    (run / "run.json").write_text(json.dumps(doc))


def tier_doc(run, min_hits=1):
    """The tier as `kvscope report --json` gives it."""
    a = report.analyze(loaded.load(run), min_hits)
    return json.loads(report.as_json(a, 0))["tier"]


def test_an_exact_run_whose_control_is_bitwise_equal_to_golden_is_judged_in_the_exact_tier(tmp_path):
    run = make_run(tmp_path / "run", four(), mode="exact")
    assert report.write(run, min_hits=1) == 0
    assert json.loads((run / "run.json").read_text())["scorer"]["tier"] == "exact"
    md = (run / "report.md").read_text()
    assert ("- Verdict tier: **exact**: exact mode, and the control bitwise equal to golden on 2 of 2 answers; "
            "any difference from golden FAILs.") in md
    assert "may hide" not in md
    doc = tier_doc(run)
    assert doc["tier"] == "exact" and doc["tolerance_nats"] == 0.0 and "noise_1e-3" not in doc


@pytest.mark.parametrize("mode, control, why", [
    ("normal", {}, "normal mode: nothing proves a correct cache bitwise equal to golden"),
    ("exact", {"offset": 1e-7}, "exact mode, but 2 of the control's 2 answers are not bitwise equal to golden's"),
    ("exact", None, "exact mode, but no control answer was compared with golden's"),
])
def test_a_run_that_does_not_prove_invariance_is_judged_in_the_statistical_tier(tmp_path, mode, control, why):
    outputs, servers = four(), SERVERS
    if control is None:
        del outputs["control"]
        servers = [s for s in SERVERS if s[1] != "control"]
    run = make_run(tmp_path / "run", outputs, servers=servers, mode=mode, control=control or {})
    report.write(run, min_hits=1)
    assert json.loads((run / "run.json").read_text())["scorer"]["tier"] == "statistical"
    md = (run / "report.md").read_text()
    assert f"- Verdict tier: **statistical**: {why}; tolerance " in md
    assert tier_doc(run)["tier"] == "statistical" and tier_doc(run)["why"] == why


def test_the_statistical_tier_states_the_power_per_class_and_not_measured_where_a_class_broke_no_hit(tmp_path):
    servers = [*SERVERS, ("canary-partial", "canary")]
    run = make_run(tmp_path / "run", {**four(), "canary-partial": GOOD}, servers=servers)
    set_fault(run, "canary-shift", "shift")
    set_fault(run, "canary-partial", "partial")
    write_fault_log(run, "canary-partial", {0: 0, 1: 0})  # it left both hits correct: nothing measured
    report.write(run, min_hits=1)
    md = (run / "report.md").read_text()
    assert "  - `shift`: caught 2 of 2 broken hits (95 % lower bound 0.342)\n" in md
    assert "  - `partial`: not measured (it broke no hit)\n" in md
    power = tier_doc(run)["power"]
    assert power == [{"fault": "shift", "broken": 2, "caught": 2, "rate_low95": 0.3424},
                     {"fault": "partial", "broken": 0, "caught": 0, "rate_low95": None}]


def noise_run(tmp_path, canary, control_offset, canary_offset):
    servers = [("baseline", "golden"), ("control", "control"), ("apc", "candidate"), ("canary-noise", "canary")]
    run = make_run(tmp_path / "run", {"baseline": GOOD, "control": GOOD, "apc": GOOD, "canary-noise": canary},
                   servers=servers, control={"offset": control_offset}, canary_noise={"offset": canary_offset})
    set_fault(run, "canary-noise", "noise-1e-3")
    report.write(run, min_hits=1)
    return run, (run / "report.md").read_text()


def test_a_noise_fault_that_moved_logprobs_beyond_the_tolerance_shows_above_the_floor(tmp_path):
    run, md = noise_run(tmp_path, GOOD, 0.0, 1e-3)  # tolerance 1e-5 (fp32's least): 1e-3 stands out
    assert ("- A 1e-3 noise fault shows above this floor: the canary's `noise-1e-3` hits moved logprobs by at "
            "least 0.001 nat, above the tolerance 1e-05 nat; caught 2 of 2 (95 % lower bound 0.342).") in md
    assert tier_doc(run)["noise_1e-3"]["may_hide"] is False


def test_noise_hits_caught_by_a_logprob_that_is_not_a_number_are_named_so_not_called_a_split(tmp_path):
    # the fp8-e5m2 noise canary (before b03c252) streamed NaN: the report said the hits "split from golden's
    # tokens at their first token", though every one kept golden's tokens
    run, md = noise_run(tmp_path, GOOD, 0.0, float("nan"))
    assert ("- A 1e-3 noise fault shows above this floor: the canary's `noise-1e-3` hits carried a logprob that is "
            "not a number (2 of 2); caught 2 of 2 (95 % lower bound 0.342).") in md
    assert tier_doc(run)["noise_1e-3"]["may_hide"] is False


def test_noise_hits_that_split_at_their_first_token_say_so(tmp_path):
    run, md = noise_run(tmp_path, [[9, 2, 3], [8, 5, 6]], 0.0, 0.0)
    assert ("the canary's `noise-1e-3` hits split from golden's tokens at their first token (2 of 2: no "
            "logprob to compare); caught 2 of 2") in md


def test_the_noise_line_names_each_way_its_hits_were_caught_where_none_moved_a_compared_logprob():
    from kvscope.analyze.verdicts import noise_hides

    power = pd.DataFrame({"fault": ["noise-1e-3"], "config": ["c"], "affected_hits": [3], "detected": [3]})
    hits = pd.DataFrame({"max_dev": [None, None, None], "first_divergence": [None, 0, 2],
                         "reason": ["a logprob that is not a number (NaN or infinite) at token 4",
                                    "diverges at token 0, golden margin 1.6 nat", "degenerate answer (repetition 0.9)"]})
    hides, why = noise_hides(power, hits, 1e-4)
    assert not hides and why.startswith(
        "the canary's `noise-1e-3` hits carried a logprob that is not a number (1 of 3); split from golden's "
        "tokens at their first token (1 of 3: no logprob to compare); were caught otherwise (1 of 3: degenerate "
        "answer (repetition 0.9)); caught 3 of 3")


def test_a_noise_fault_within_the_tolerance_may_hide_even_where_a_token_split_caught_it(tmp_path):
    run, md = noise_run(tmp_path, BAD, 1e-3, 2e-3)  # tolerance 3e-3; caught only by the tokens splitting
    assert ("- **A 1e-3 noise fault may hide under this floor**: 1 of the canary's 2 `noise-1e-3` hits moved "
            "logprobs by no more than the tolerance 0.003 nat (as little as 0.002 nat)") in md
    assert tier_doc(run)["noise_1e-3"]["may_hide"] is True


def test_a_noise_fault_the_canary_missed_may_hide(tmp_path):
    run, md = noise_run(tmp_path, GOOD, 1e-3, 2e-3)  # within the tolerance 3e-3, tokens equal: missed
    assert ("- **A 1e-3 noise fault may hide under this floor**: the canary's `noise-1e-3` hits were caught on "
            "0 of 2") in md
    assert tier_doc(run)["noise_1e-3"]["may_hide"] is True


def test_a_run_without_a_noise_canary_says_a_noise_fault_may_hide(tmp_path):
    run = make_run(tmp_path / "run", four())
    report.write(run, min_hits=1)
    assert ("- **A 1e-3 noise fault may hide under this floor**: `noise-1e-3` was not measured (no canary "
            "treatment of that class ran); the tolerance is 1e-05 nat.") in (run / "report.md").read_text()
    assert tier_doc(run)["noise_1e-3"] == {
        "may_hide": True, "why": "`noise-1e-3` was not measured (no canary treatment of that class ran); the "
                                 "tolerance is 1e-05 nat"}


def test_a_fault_class_from_the_run_folder_is_escaped_in_the_tier_lines(tmp_path):
    run = make_run(tmp_path / "run", four())
    set_fault(run, "canary-shift", "<img src=x onerror=alert(1)>`|")
    report.write(run, min_hits=1)
    page = (run / "report.html").read_text()
    assert "<img src=x" not in page and "&lt;img src=x onerror=alert(1)&gt;`|</code>: caught 2 of 2" in page


def test_the_environment_names_the_topology_of_each_sharded_server(tmp_path):
    plain = make_run(tmp_path / "plain", four())
    report.write(plain, min_hits=1)
    assert "topology" not in (plain / "report.md").read_text()  # no sharded server: no line, no key
    run = make_run(tmp_path / "tp2", four())
    doc = json.loads((run / "run.json").read_text())
    doc["servers"] = [{**s, "topology": {"tensor_parallel": 2, "pipeline_parallel": 1}} if s["config"] == "apc"
                      else s for s in doc["servers"]]
    (run / "run.json").write_text(json.dumps(doc))
    report.write(run, min_hits=1)
    md = (run / "report.md").read_text()
    assert "- topology: `apc` TP2·PP1; the others one unsharded server each\n" in md.split("## Environment", 1)[1]


@pytest.mark.parametrize("topology", [{"tensor_parallel": 2}, {"tensor_parallel": 2, "pipeline_parallel": 1, "x": 1}])
def test_a_run_json_whose_topology_lacks_a_rank_is_refused_as_a_file_not_a_traceback(tmp_path, topology):
    # run.json is a file of the run folder: a topology that does not name both ranks is not a kvscope run
    run = make_run(tmp_path / "tp", four())
    doc = json.loads((run / "run.json").read_text())
    doc["servers"] = [{**s, "topology": topology} if s["config"] == "apc" else s for s in doc["servers"]]
    (run / "run.json").write_text(json.dumps(doc))
    with pytest.raises(ArtifactError, match="topology"):
        report.write(run, min_hits=1)


def test_a_canary_treatment_that_broke_no_hit_reads_not_measured_never_pass(tmp_path):
    # a per-rank class on a server whose other ranks never loaded, or a class with nothing to break: its
    # answers are right, so its fidelity alone would read PASS; it measured nothing
    servers = [*SERVERS, ("canary-rank0-only", "canary")]
    run = make_run(tmp_path / "run", {**four(), "canary-rank0-only": GOOD}, servers=servers)
    set_fault(run, "canary-rank0-only", "rank0-only")
    write_fault_log(run, "canary-rank0-only", {0: 0, 1: 0})
    report.write(run, min_hits=1)
    row = pd.read_csv(run / "verdicts.csv").set_index("config").loc["canary-rank0-only"]
    assert (row.verdict, row.as_expected) == ("UNVERIFIED", False)
    assert row.why == "not measured: its fault log says it broke no hit"
    power = pd.read_csv(run / "power.csv").set_index("fault").loc["rank0-only"]
    assert power.affected_hits == 0 and pd.isna(power.rate)


def test_the_ideal_lru_starts_from_what_the_prime_phase_left():
    # a restart, shared-store or store-fault scenario primes the cache, then measures without a reset; the
    # ideal started empty there and read 0.00 beside a measured 0.96: a tier that lost everything looked ideal
    from kvscope.analyze import hitrate

    def answer(rid, phase, t, hashes):
        return Record(config="kvscope-fs", scenario="restart", phase=phase, request_id=rid, session_id=rid, turn=0,
                      endpoint="chat", start_unix_s=t, ok=True, ttft_s=0.1, e2e_s=0.2, prompt_tokens=4 * 64 + 10,
                      cached_tokens=0, output_token_ids=[1], prompt_block_hashes=hashes)

    prompts = [[f"p{i}b{j}" for j in range(4)] for i in range(8)]
    prime = [answer(f"prime-r{i}", "prime", i, h) for i, h in enumerate(prompts)]
    measure = [answer(f"r{i}", "measure", 100 + i, h) for i, h in enumerate(prompts)]
    assert hitrate.theoretical(prime + measure, 10_000, 64) == pytest.approx(256 / 266)  # the measure phase's
    assert hitrate.theoretical(measure, 10_000, 64) == 0.0
