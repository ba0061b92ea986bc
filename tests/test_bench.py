"""A real short bench through Locust against real servers: records, counters, fidelity, faults."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pandas as pd
import pytest
from conftest import REPO, SESSION_CONFIGS

from kvscope import artifacts
from kvscope.analyze import fidelity, loaded, report, storefaults, verdicts
from kvscope.artifacts import Manifest, Treatment
from kvscope.config.matrix import CANARY_FAULTS as FAULTS
from kvscope.run.records import read
from kvscope.run.treatments import reset

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


def test_a_run_folder_is_never_reused_and_resume_runs_only_what_is_missing(short_run, deployment, tmp_path):
    out = bench(deployment / "deployment.json", short_run[1].parent, "--configs", "baseline,apc",
                "--scenarios", "repeat-867", "--run-id", "e2e")
    assert out.returncode == 2 and "run folder" in out.stderr and "exists" in out.stderr
    first = bench(deployment / "deployment.json", tmp_path, "--configs", "baseline,apc", "--scenarios", "repeat-867",
                  "--run-id", "r")
    assert first.returncode == 0, first.stderr[-2000:]
    status = tmp_path / "r" / "status.jsonl"
    status.write_text(status.read_text().splitlines()[0] + "\n")  # as if the run stopped after baseline
    again = bench(deployment / "deployment.json", tmp_path, "--configs", "baseline,apc", "--scenarios", "repeat-867",
                  "--run-id", "r", "--resume")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "baseline x repeat-867: done earlier (--resume)" in again.stdout
    assert len(read(tmp_path / "r" / "records" / "apc__repeat-867.jsonl")) == 2  # run again, not appended
    assert len(status.read_text().splitlines()) == 2


def test_distributed_locust_merges_one_set_of_records(deployment, tmp_path):
    out = bench(deployment / "deployment.json", tmp_path, "--configs", "baseline,apc", "--scenarios", "rag-small",
                "--processes", "2", "--run-id", "dist")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for config in ("baseline", "apc"):
        recs = read(tmp_path / "dist" / "records" / f"{config}__rag-small.jsonl")
        assert sorted(r.request_id for r in recs) == [f"rag-small-{i:04d}-t0" for i in range(6)]
        assert {r.worker for r in recs} == {0, 1}


def test_a_dead_server_gives_failed_records_and_the_run_goes_on(deployment, tmp_path):
    doc = json.loads((deployment / "deployment.json").read_text())
    for server in doc["servers"]:
        if server["config"] == "apc":
            server["port"] = 8199  # nothing listens there
    broken = tmp_path / "deployment.json"
    broken.write_text(json.dumps(doc))
    out = bench(broken, tmp_path, "--configs", "baseline,apc", "--scenarios", "repeat-867", "--run-id", "dead")
    assert out.returncode == 3 and "no answer at all: apc x repeat-867" in out.stderr, out.stderr[-2000:]
    dead = read(tmp_path / "dead" / "records" / "apc__repeat-867.jsonl")
    assert len(dead) == 2 and not any(r.ok for r in dead)
    assert all("refused" in r.error.lower() or "HTTP 0" in r.error for r in dead), [r.error for r in dead]
    assert all(r.ok for r in read(tmp_path / "dead" / "records" / "baseline__repeat-867.jsonl"))


def stored(run_dir, stores, policy) -> Treatment:
    """A treatment with only what reset reads: a server on a closed port, its stores and their policy."""
    server = Manifest.model_construct(host="127.0.0.1", port=9, stores=stores, store_reset=policy)
    return Treatment.model_construct(manifest=server, run_dir=str(run_dir))


@pytest.mark.parametrize("policy,left", [("wipe", []), ("keep", ["gc-heartbeat"])])
def test_reset_keeps_the_stores_of_a_connector_that_owns_their_layout(tmp_path, policy, left):
    # UCM keeps GC heartbeats and shard dirs in its store; wiping them under the live server broke it (H200)
    store = tmp_path / "stores" / "ucm-nfs" / "ucm"
    store.mkdir(parents=True)
    (store / "gc-heartbeat").write_text("x")
    server = stored(tmp_path, {"ucm": str(store)}, policy)
    row = reset(server)
    assert sorted(p.name for p in store.iterdir()) == left
    assert row.stores_wiped == ([] if policy == "keep" else ["ucm"])


def test_reset_wipes_nothing_outside_the_deployments_stores_folder(tmp_path):
    outside = tmp_path / "home"
    outside.mkdir()
    (outside / "thesis.tex").write_text("x")
    (tmp_path / "run" / "stores").mkdir(parents=True)
    stores = {"abs": str(outside), "dots": str(tmp_path / "run" / "stores" / ".." / ".." / "home"),
              "root": str(tmp_path / "run" / "stores")}
    server = stored(tmp_path / "run", stores, "wipe")
    row = reset(server)
    assert (outside / "thesis.tex").exists()
    assert row.stores_wiped == [] and row.stores_refused == ["abs", "dots", "root"]


def locust_in(session: int) -> bool:
    """A Locust process runs in the process session `session`."""
    found = subprocess.run(["pgrep", "-s", str(session), "-f", "--", "-m locust"], capture_output=True, text=True)
    return bool(found.stdout.split())


def test_ctrl_c_leaves_a_folder_that_says_so_no_locust_behind_and_resume_finishes_it(deployment, tmp_path):
    scenarios = tmp_path / "scenarios.yaml"
    scenarios.write_text(SMALL)
    cmd = [sys.executable, "-m", "kvscope.cli", "bench", "--deployment", str(deployment / "deployment.json"),
           "--results", str(tmp_path), "--scenarios-file", str(scenarios), "--configs", "baseline,apc",
           "--scenarios", "repeat-867,rag-small", "--run-id", "cut", "--report", "--min-hits", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    status = tmp_path / "cut" / "status.jsonl"
    deadline = time.monotonic() + 300
    while not (status.exists() and status.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.2)
    # into the third treatment (golden's rag-small) once it has records, while its Locust still runs (a fixed
    # sleep let a fast machine finish the run first; an interrupt before golden's first record is
    # test_report.py's test_bench_report_interrupted_before_goldens_first_record_...)
    golden = tmp_path / "cut" / "records" / "baseline__rag-small.jsonl"
    while not (golden.exists() and golden.stat().st_size and locust_in(proc.pid)) and proc.poll() is None \
            and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None, "the bench finished before its third treatment's Locust was seen"
    os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in a terminal does: the whole foreground group
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-2000:] + err[-2000:]
    run = json.loads((tmp_path / "cut" / "run.json").read_text())
    assert run["interrupted"].startswith("KeyboardInterrupt during ") and "make bench RESUME=1 RUN_ID=cut" in err
    assert "incomplete" in (tmp_path / "cut" / "report.md").read_text()
    left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert left == [], "Locust processes were left behind"
    kept = [json.loads(line) for line in status.read_text().splitlines()]
    assert len(kept) >= 2 and all(r["phases"]["measure"]["locust_exit"] == 0 for r in kept)
    out = subprocess.run(cmd + ["--resume"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert "done earlier (--resume)" in out.stdout and out.returncode in (0, 3), out.stdout[-2000:] + out.stderr[-2000:]
    assert json.loads((tmp_path / "cut" / "run.json").read_text())["interrupted"] is None


def test_a_load_sweep_with_repeats_runs_every_treatment_at_each_load_and_reports_the_sweep(deployment, tmp_path):
    out = bench(deployment / "deployment.json", tmp_path, "--configs", "baseline,apc", "--scenarios", "repeat-867",
                "--users", "1,2", "--repeats", "2", "--run-id", "sweep", "--report", "--min-hits", "1")
    run = tmp_path / "sweep"
    assert "[8/8]" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    rows = [json.loads(line) for line in (run / "status.jsonl").read_text().splitlines()]
    assert sorted({r["scenario"] for r in rows}) == ["repeat-867@u1#1", "repeat-867@u1#2", "repeat-867@u2#1",
                                                     "repeat-867@u2#2"]
    assert sorted(pd.read_csv(run / "sweep.csv").query("config == 'apc'").users) == [1, 2]
    assert (run / "load_sweep.png").exists() and "over 2" in pd.read_csv(run / "overview.csv").speedup_repeats[1]


def test_reset_wipes_a_store_the_live_server_is_still_writing(tmp_path):
    # H200, 2026-12-01: kvscope-fs's save thread still wrote blocks from the treatment before while the reset
    # removed their folder ("Directory not empty"), which stopped the whole run
    store = tmp_path / "stores" / "kvscope-fs" / "blocks"
    (store / "fingerprint").mkdir(parents=True)

    def saver():  # a connector's save thread for half a second: new block files, one folder per key prefix
        i, end = 0, time.monotonic() + 0.5
        while time.monotonic() < end:
            folder = store / "fingerprint" / f"{i % 7:02x}"
            try:
                folder.mkdir(parents=True, exist_ok=True)
                (folder / f"{i}.safetensors").write_bytes(b"x" * 4096)
            except FileNotFoundError:
                pass  # removed under it; the connector counts such a write as a save error
            i += 1

    writer = threading.Thread(target=saver)
    writer.start()
    time.sleep(0.05)
    server = stored(tmp_path, {"blocks": str(store)}, "wipe")
    row = reset(server)
    writer.join()
    assert row.stores_wiped == ["blocks"] and "stores_refused" not in row.model_fields_set


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
