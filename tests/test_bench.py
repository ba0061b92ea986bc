"""A real short bench through Locust against real servers: what depends on vLLM and kvscope's connector (canary
power, hits from a connector's tiers, restarts, store faults). The bench chain itself (resume, Ctrl-C, a dead
server, distributed Locust, a load sweep, the report) runs against fake servers: test_bench_chain.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
from conftest import REPO, SESSION_CONFIGS

from kvscope import artifacts
from kvscope.analyze import fidelity, loaded, report, storefaults, verdicts
from kvscope.config.matrix import CANARY_FAULTS, RANK_FAULTS
from kvscope.run.records import read

FAULTS = tuple(f for f in CANARY_FAULTS if f not in RANK_FAULTS)  # the one-rank canary's classes

pytestmark = pytest.mark.server

SMALL = """scenarios:
  - name: rag-small
    kind: rag
    num_docs: 8
    doc_tokens_median: 120
    docs_per_query: 2
    num_queries: 6
    max_tokens: 12
  - name: repeat-867
    kind: repeat
    repeats: 2
    max_tokens: 24
"""


def bench(deployment_file, results, *args) -> subprocess.CompletedProcess:
    scenarios = results / "scenarios.yaml"
    scenarios.parent.mkdir(parents=True, exist_ok=True)
    scenarios.write_text(SMALL)
    cmd = [sys.executable, "-m", "kvscope.cli", "bench", "--deployment", str(deployment_file), "--results",
           str(results), "--scenarios-file", str(scenarios), *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def short_run(deployment, tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    out = bench(deployment / "deployment.json", results, "--scenarios", "rag-small,repeat-867", "--run-id", "e2e",
                "--report", "--min-hits", "3")
    return out, results / "e2e"


def test_bench_writes_records_for_every_config_and_scenario(short_run, deployment):
    out, run = short_run
    # example-fs matches whole prompts only: one verified hit here, so the gate is inconclusive (exit 3)
    assert out.returncode == 3, out.stdout[-3000:] + out.stderr[-3000:]
    unexpected = pd.read_csv(run / "verdicts.csv").query("not as_expected")
    assert list(unexpected.config) == ["example-fs"], unexpected.to_dict("records")
    treatments = 2 * (5 + len(FAULTS))  # 2 scenarios x (5 configs and one canary treatment per fault)
    assert f"[{treatments}/{treatments}]" in out.stdout  # visible progress, one line per treatment
    configs = [s["config"] for s in json.loads((run / "run.json").read_text())["servers"]]
    assert configs[:2] == ["baseline", "control"]  # the golden config runs first, then the control
    assert configs[-len(FAULTS):] == [f"canary-{f}" for f in FAULTS]  # one treatment per fault, on one server
    for config in configs:
        for scenario, n in (("rag-small", 6), ("repeat-867", 2)):
            recs = read(run / "records" / f"{config}__{scenario}.jsonl")
            assert len(recs) == n and all(r.ok for r in recs), (config, scenario)
            assert all(r.ttft_s and r.e2e_s >= r.ttft_s and r.prompt_tokens and r.output_token_ids for r in recs)
            assert all(r.cached_tokens is not None and r.prompt_block_hashes for r in recs)


def test_the_repeated_request_hits_every_cache_and_counters_agree(short_run):
    _, run = short_run
    for config in ("apc", "kvscope-fs", "canary-shift", "canary-noise-1e-3"):
        first, second = read(run / "records" / f"{config}__repeat-867.jsonl")
        assert first.cached_tokens == 0 and second.cached_tokens > 0, config
    base = read(run / "records" / "baseline__repeat-867.jsonl")
    assert [r.cached_tokens for r in base] == [0, 0]
    rows = {(r["config"], r["scenario"]): r for r in map(json.loads, (run / "status.jsonl").read_text().splitlines())}
    apc = rows["apc", "repeat-867"]["phases"]["measure"]["metrics_delta"]
    assert apc["vllm:prefix_cache_hits_total"] == second_hit(run, "apc")
    fs = rows["kvscope-fs", "repeat-867"]["phases"]["measure"]["metrics_delta"]
    assert fs["vllm:external_prefix_cache_hits_total"] == second_hit(run, "kvscope-fs")
    assert rows["kvscope-fs", "repeat-867"]["reset"]["stores_wiped"] == ["blocks", "log"]  # its load log too


def second_hit(run, config) -> int:
    return read(run / "records" / f"{config}__repeat-867.jsonl")[1].cached_tokens


def test_every_canary_fault_is_caught_and_every_other_config_passes(short_run):
    out, run = short_run
    verdicts = pd.read_csv(run / "verdicts.csv").set_index("config")
    for config in ("control", "apc", "example-fs", "kvscope-fs"):
        expected = "UNVERIFIED" if config == "example-fs" else "PASS"  # whole-prompt matches: one hit here
        assert verdicts.loc[config, "verdict"] == expected, (config, verdicts.loc[config, "why"])
    power = pd.read_csv(run / "power.csv").set_index("fault")
    assert list(power.index) == list(FAULTS)
    for fault, row in power.iterrows():
        assert verdicts.loc[f"canary-{fault}", "verdict"] == "FAIL", fault
        assert row.affected_hits > 0 and row.detected == row.affected_hits, (fault, row.to_dict())
        assert row.unaffected_fail == 0 and row.fault_log == "kept", fault
    scorer = json.loads((run / "run.json").read_text())["scorer"]
    assert scorer["direct_noise_nats"] is not None and scorer["tolerance_nats"] < 1e-3  # measured: fp32 on CPU
    assert "detection power" in out.stdout.lower()
    summary = pd.read_csv(run / "summary.csv")
    apc = summary[(summary.config == "apc")]
    assert (apc.fail_hit + apc.fail_miss).sum() == 0 and apc.identical_hit.sum() > 0
    scores = pd.read_csv(run / "scores.csv")
    shifted = scores[(scores.config == "canary-shift") & (scores.cls == "FAIL")]
    assert (shifted.cached_tokens > 0).all()  # the canary fails exactly where it served from cache
    assert (run / "continuations" / "baseline__rag-small.jsonl").stat().st_size > 0  # golden rescored


def test_every_file_of_the_run_folder_is_a_typed_artifact(short_run):
    _, run = short_run
    models = {"records": artifacts.Record, "workloads": artifacts.Request, "continuations": artifacts.Continuation,
              "faults": artifacts.FaultEvent}
    assert artifacts.read_json(run / "run.json", artifacts.RunInfo).scorer.version == fidelity.SCORER_VERSION
    treatments = (len(SESSION_CONFIGS.split(",")) - 1 + len(FAULTS)) * 2  # a canary's per fault; two scenarios
    assert len(artifacts.read_jsonl(run / "status.jsonl", artifacts.StatusRow)) == treatments
    for folder, model in models.items():
        files = sorted((run / folder).glob("*.jsonl"))
        assert files, folder
        for path in files:
            artifacts.read_jsonl(path, model)  # raises, naming the file and line, on anything else


TRACE_AND_RESTART = """scenarios:
  - name: trace-slice
    kind: trace
    trace: {trace}
    block_tokens: 64
    max_requests: 20
    time_scale: 0.5
    max_tokens: 8
    users: 8
  - name: restart-small
    kind: rag
    num_docs: 8
    doc_tokens_median: 120
    docs_per_query: 2
    num_queries: 6
    max_tokens: 12
    prime: replay
    restart: true
"""


def test_a_trace_slice_replays_open_loop_and_a_restart_keeps_the_disk_tiers_blocks(deployment, tmp_path):
    scenarios = tmp_path / "scenarios.yaml"
    scenarios.write_text(TRACE_AND_RESTART.format(trace=REPO / "loadtests" / "kvscope" / "traces" / "mooncake-conversation-300.jsonl"))
    restart = (f"{REPO}/.venv/bin/ansible-playbook -i {REPO}/ansible/inventories/local {REPO}/ansible/restart.yml "
               f"-e kvscope_run_dir={deployment} -e vllm_port_offset=100 -e vllm_configs={SESSION_CONFIGS} "
               "-e restart_configs={config}")
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg")}
    out = subprocess.run([sys.executable, "-m", "kvscope.cli", "bench", "--deployment", str(deployment / "deployment.json"),
                          "--results", str(tmp_path), "--scenarios-file", str(scenarios), "--configs",
                          "baseline,kvscope-fs", "--scenarios", "trace-slice,restart-small", "--run-id", "tr",
                          "--restart-cmd", restart, "--report", "--min-hits", "2"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    run = tmp_path / "tr"
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    trace = read(run / "records" / "kvscope-fs__trace-slice.jsonl")
    sent = sorted(r.start_unix_s for r in trace)
    arrivals = [r.arrival_s for r in artifacts.read_jsonl(run / "workloads" / "trace-slice.measure.jsonl",
                                                          artifacts.Request)]
    assert len(trace) == 20 and sent[-1] - sent[0] >= 0.8 * (max(arrivals) - min(arrivals))  # open loop
    assert sum(1 for r in trace if r.cached_tokens) >= 5  # the trace's shared prefix blocks hit
    status = [json.loads(line) for line in (run / "status.jsonl").read_text().splitlines()]
    phases = {(s["config"], s["scenario"]): s["phases"] for s in status}
    assert phases["kvscope-fs", "restart-small"]["restart"]["restart_exit"] == 0
    assert "restart" not in phases["baseline", "restart-small"]  # golden is not restarted
    after = read(run / "records" / "kvscope-fs__restart-small.jsonl")
    assert all(r.cached_tokens for r in after if r.phase == "measure")  # every load after the restart hit
    loads = [json.loads(line) for line in (run / "loads" / "kvscope-fs__restart-small.jsonl").read_text().splitlines()]
    assert sum(line.get("disk", 0) for line in loads) > 0  # from the files the prime phase wrote
    delta = phases["kvscope-fs", "restart-small"]["measure"]["metrics_delta"]  # vLLM's counters after the restart
    assert delta["vllm:prompt_tokens_cached_by_source_total{source=disk}"] > 0
    assert delta["kvscope:connector_fs_hits_total"] > 0 and delta["kvscope:connector_corrupt_total"] == 0
    scores = pd.read_csv(run / "scores.csv")
    hits = scores[(scores.config == "kvscope-fs") & (scores.scenario == "restart-small") & (scores.cached_tokens > 0)]
    assert len(hits) >= 6 and hits.cls.isin(["identical", "benign"]).all(), hits.to_dict("records")  # golden's answers
    v = pd.read_csv(run / "verdicts.csv").set_index("config")
    assert v.verdict["kvscope-fs"] == "PASS" and "by tier: disk" in v.why["kvscope-fs"]


def test_kvscope_fs_detects_every_store_fault_at_rest_and_real_resets_probe_clean(deployment, tmp_path):
    scenarios = REPO / "loadtests" / "kvscope" / "scenarios.yaml"
    names = "store-bitflip,store-truncate,store-swap,store-unreadable"
    out = bench(deployment / "deployment.json", tmp_path, "--scenarios-file", str(scenarios), "--configs",
                "baseline,kvscope-fs", "--scenarios", names, "--queries", "3", "--run-id", "rot")
    assert out.returncode == 0, out.stderr[-2000:]
    folder = tmp_path / "rot"
    analysis = report.analyze(loaded.load(folder))
    status = analysis.loaded.status
    assert len(status) == 8 and all(r.reset.probe is not None for r in status)
    blocks = {s.config: s.manifest.block_size for s in analysis.loaded.run.servers}
    for r in status:  # a real vLLM's reset, kvscope's connector's included, leaves nothing serving
        assert verdicts.reset_leak(r.reset.probe, blocks[r.config]) is None and verdicts.reset_unverified(r.reset.probe) is None, r
    said = storefaults.table(status, analysis.scores).set_index("fault")
    assert len(said) == 4 and (said.files > 0).all()
    assert said.outcome.str.startswith("detected and recomputed").all(), said.to_dict("records")
