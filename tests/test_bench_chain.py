"""The bench chain against fake vLLM servers in threads of this process (fake_vllm.py): records, the report,
resume, Ctrl-C, a dead server, distributed Locust, a load sweep, `--endpoint`. What is tested here is what
kvscope does with answers, not what vLLM answers; what depends on vLLM (canary power, a connector's hits,
restarts, store faults) runs against real servers in test_bench.py. No vLLM starts here."""

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
from conftest import REPO
from fake_vllm import FakeVLLM
from test_bench import SMALL, bench

from kvscope import artifacts
from kvscope.artifacts import Deployment, Manifest, Treatment, write_json
from kvscope.deploy import servers
from kvscope.run.records import read
from kvscope.run.serverstate import reset

ROLES = {"baseline": "golden", "control": "control", "apc": "candidate", "wrong-cache": "candidate"}


@pytest.fixture(scope="module")
def fakes(model_dir, tmp_path_factory):
    """Four fake servers, as `make deploy` would list them: golden and the control cache-off, a correct cache
    and one that answers a cached prompt otherwise; their deployment.json."""
    found = {"baseline": FakeVLLM("tiny", prefix_caching=False), "control": FakeVLLM("tiny", prefix_caching=False),
             "apc": FakeVLLM("tiny"), "wrong-cache": FakeVLLM("tiny", wrong_cache=True)}
    path = tmp_path_factory.mktemp("deployment") / "deployment.json"
    write_json(path, Deployment(servers=[f.manifest(ROLES[c], model_dir, config=c) for c, f in found.items()]))
    yield found, path
    for fake in found.values():
        fake.stop()


@pytest.fixture(scope="module")
def short_run(fakes, tmp_path_factory):
    results = tmp_path_factory.mktemp("results")
    out = bench(fakes[1], results, "--scenarios", "rag-small,repeat-867", "--run-id", "e2e", "--report",
                "--min-hits", "3")
    return out, results / "e2e"


def test_bench_writes_typed_records_for_every_config_and_scenario(short_run):
    out, run = short_run
    assert "[8/8]" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]  # one progress line per treatment
    configs = [s["config"] for s in json.loads((run / "run.json").read_text())["servers"]]
    assert configs == ["baseline", "control", "apc", "wrong-cache"]  # golden first, then the control
    for config in configs:
        for scenario, n in (("rag-small", 6), ("repeat-867", 2)):
            recs = read(run / "records" / f"{config}__{scenario}.jsonl")
            assert len(recs) == n and all(r.ok for r in recs), (config, scenario)
            assert all(r.ttft_s and r.e2e_s >= r.ttft_s and r.prompt_tokens and r.output_token_ids for r in recs)
            assert all(r.cached_tokens is not None and r.prompt_block_hashes and len(r.top_logprobs) == 12
                       for r in recs if scenario == "rag-small")
    models = {"records": artifacts.Record, "workloads": artifacts.Request, "continuations": artifacts.Continuation}
    assert len(artifacts.read_jsonl(run / "status.jsonl", artifacts.StatusRow)) == 8
    for folder, model in models.items():
        assert sorted((run / folder).glob("*.jsonl")), folder
        for path in sorted((run / folder).glob("*.jsonl")):
            artifacts.read_jsonl(path, model)  # raises, naming the file and line, on anything else


def test_the_repeated_request_hits_the_caches_and_counters_and_reset_probes_agree(short_run):
    _, run = short_run
    for config in ("apc", "wrong-cache"):
        first, second = read(run / "records" / f"{config}__repeat-867.jsonl")
        assert first.cached_tokens == 0 and second.cached_tokens > 0, config
    assert [r.cached_tokens for r in read(run / "records" / "baseline__repeat-867.jsonl")] == [0, 0]
    rows = {(r.config, r.scenario): r for r in artifacts.read_jsonl(run / "status.jsonl", artifacts.StatusRow)}
    delta = rows["apc", "repeat-867"].phases["measure"].metrics_delta
    second = read(run / "records" / "apc__repeat-867.jsonl")[1].cached_tokens
    assert delta["vllm:prefix_cache_hits_total"] == delta["vllm:prompt_tokens_cached_total"] == second
    assert delta["vllm:time_to_first_token_seconds_count"] == 2
    for row in rows.values():  # every server was reset and probed empty
        assert row.reset.reset_prefix_cache_http == 200 and row.reset.probe.cached_tokens == 0, row


def test_the_report_passes_the_correct_cache_and_fails_the_wrong_one(short_run):
    out, run = short_run
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]  # a candidate FAILs: the gate fails
    verdicts = pd.read_csv(run / "verdicts.csv").set_index("config")
    assert dict(verdicts.verdict) == {"baseline": "GOLDEN", "control": "PASS", "apc": "PASS", "wrong-cache": "FAIL"}
    assert verdicts.verified_hits["apc"] >= 3
    assert verdicts.why["wrong-cache"].startswith("6 of 8 scored answers; first: diverges at token 0")
    scores = pd.read_csv(run / "scores.csv")
    wrong = scores[(scores.config == "wrong-cache") & (scores.cls == "FAIL")]
    assert len(wrong) == 6 and (wrong.cached_tokens > 0).all()  # it fails exactly where it served from cache
    assert (run / "continuations" / "wrong-cache__rag-small.jsonl").stat().st_size > 0  # golden scored the splits
    report = (run / "report.md").read_text()
    assert "| wrong-cache | candidate | **FAIL** (unexpected) |" in report and (run / "report.html").is_file()
    assert "gate: FAILED" in out.stdout


def test_a_run_folder_is_never_reused_and_resume_runs_only_what_is_missing(fakes, short_run, tmp_path):
    deployment = fakes[1]
    out = bench(deployment, short_run[1].parent, "--configs", "baseline,apc", "--scenarios", "repeat-867",
                "--run-id", "e2e")
    assert out.returncode == 2 and "run folder" in out.stderr and "exists" in out.stderr
    first = bench(deployment, tmp_path, "--configs", "baseline,apc", "--scenarios", "repeat-867", "--run-id", "r")
    assert first.returncode == 0, first.stderr[-2000:]
    status = tmp_path / "r" / "status.jsonl"
    status.write_text(status.read_text().splitlines()[0] + "\n")  # as if the run stopped after baseline
    again = bench(deployment, tmp_path, "--configs", "baseline,apc", "--scenarios", "repeat-867", "--run-id", "r",
                  "--resume")
    assert again.returncode == 0, again.stderr[-2000:]
    assert "baseline x repeat-867: done earlier (--resume)" in again.stdout
    assert "apc x repeat-867: warm-up" in again.stdout
    assert len(read(tmp_path / "r" / "records" / "apc__repeat-867.jsonl")) == 2  # run again, not appended
    assert len(status.read_text().splitlines()) == 2


def test_distributed_locust_merges_one_set_of_records(fakes, tmp_path):
    out = bench(fakes[1], tmp_path, "--configs", "baseline,apc", "--scenarios", "rag-small", "--processes", "2",
                "--run-id", "dist")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for config in ("baseline", "apc"):
        recs = read(tmp_path / "dist" / "records" / f"{config}__rag-small.jsonl")
        assert sorted(r.request_id for r in recs) == [f"rag-small-{i:04d}-t0" for i in range(6)]
        assert {r.worker for r in recs} == {0, 1}


def test_a_dead_server_gives_failed_records_and_the_run_goes_on(fakes, tmp_path):
    doc = json.loads(fakes[1].read_text())
    for server in doc["servers"]:
        if server["config"] == "apc":
            server["port"] = 9  # nothing listens there (discard)
    broken = tmp_path / "deployment.json"
    broken.write_text(json.dumps(doc))
    out = bench(broken, tmp_path, "--configs", "baseline,apc", "--scenarios", "repeat-867", "--run-id", "dead")
    assert out.returncode == 3 and "no answer at all: apc x repeat-867" in out.stderr, out.stderr[-2000:]
    dead = read(tmp_path / "dead" / "records" / "apc__repeat-867.jsonl")
    assert len(dead) == 2 and not any(r.ok for r in dead)
    assert all("refused" in r.error.lower() or "HTTP 0" in r.error for r in dead), [r.error for r in dead]
    assert all(r.ok for r in read(tmp_path / "dead" / "records" / "baseline__repeat-867.jsonl"))


def locust_in(session: int) -> bool:
    """A Locust process runs in the process session `session`."""
    found = subprocess.run(["pgrep", "-s", str(session), "-f", "--", "-m locust"], capture_output=True, text=True)
    return bool(found.stdout.split())


@pytest.fixture
def slow_fakes(fakes):
    """The fake servers, each answer's first token 0.5 s after its request (a Locust phase lasts seconds)."""
    for fake in fakes[0].values():
        fake.first_token_s = 0.5
    yield fakes
    for fake in fakes[0].values():
        fake.first_token_s = 0.0


def test_ctrl_c_leaves_a_folder_that_says_so_no_locust_behind_and_resume_finishes_it(slow_fakes, tmp_path):
    scenarios = tmp_path / "scenarios.yaml"
    scenarios.write_text(SMALL)
    cmd = [sys.executable, "-m", "kvscope.cli", "bench", "--deployment", str(slow_fakes[1]), "--results",
           str(tmp_path), "--scenarios-file", str(scenarios), "--configs", "baseline,apc", "--scenarios",
           "repeat-867,rag-small", "--run-id", "cut", "--report", "--min-hits", "1"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    status = tmp_path / "cut" / "status.jsonl"
    deadline = time.monotonic() + 120
    while not (status.exists() and status.read_text().count("\n") >= 2) and time.monotonic() < deadline:
        time.sleep(0.1)
    # into the third treatment (golden's rag-small) once it has records, while its Locust still runs
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
    assert len(kept) == 2 and all(r["phases"]["measure"]["locust_exit"] == 0 for r in kept)
    out = subprocess.run(cmd + ["--resume"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.count("done earlier (--resume)") == 2 and "[4/4] apc x rag-small: warm-up" in out.stdout
    assert json.loads((tmp_path / "cut" / "run.json").read_text())["interrupted"] is None
    assert len(read(golden)) == 6  # the cut treatment ran again whole, not appended to


def test_a_load_sweep_with_repeats_runs_every_treatment_at_each_load_and_reports_the_sweep(fakes, tmp_path):
    out = bench(fakes[1], tmp_path, "--configs", "baseline,apc", "--scenarios", "repeat-867", "--users", "1,2",
                "--repeats", "2", "--run-id", "sweep", "--report", "--min-hits", "1")
    run = tmp_path / "sweep"
    assert "[8/8]" in out.stdout and out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    verdicts = pd.read_csv(run / "verdicts.csv").set_index("config")  # each column's answers scored as its own
    assert verdicts.verdict["apc"] == "PASS" and verdicts.verified_hits["apc"] == 4, verdicts.why["apc"]
    rows = [json.loads(line) for line in (run / "status.jsonl").read_text().splitlines()]
    assert sorted({r["scenario"] for r in rows}) == ["repeat-867@u1#1", "repeat-867@u1#2", "repeat-867@u2#1",
                                                     "repeat-867@u2#2"]
    assert sorted(pd.read_csv(run / "sweep.csv").query("config == 'apc'").users) == [1, 2]
    assert (run / "load_sweep.png").exists() and "over 2" in pd.read_csv(run / "overview.csv").speedup_repeats[1]


ENDPOINT_SCENARIO = ("scenarios:\n  - {name: rag-small, kind: rag, num_docs: 6, doc_tokens_median: 120, "
                     "docs_per_query: 2, num_queries: 8}\n")


def test_servers_kvscope_did_not_deploy_are_benched_scored_and_their_uncontrolled_cache_said(tmp_path, model_dir):
    # as a team runs vLLM by hand: the model's path as its name, no dev-mode reset route, block size 64
    golden = FakeVLLM(str(model_dir), prefix_caching=False, resettable=False, block_size=64)
    theirs = FakeVLLM(str(model_dir), resettable=False, block_size=64)
    try:
        (tmp_path / "small.yaml").write_text(ENDPOINT_SCENARIO)
        out = subprocess.run([sys.executable, "-m", "kvscope.cli", "bench", "--endpoint", f"their-apc={theirs.url}",
                              "--golden", golden.url, "--model-dir", str(model_dir), "--results", str(tmp_path),
                              "--scenarios-file", str(tmp_path / "small.yaml"), "--scenarios", "rag-small",
                              "--run-id", "ext", "--report", "--min-hits", "3"], cwd=REPO, capture_output=True,
                             text=True, timeout=300)
        run = tmp_path / "ext"
        verdicts = pd.read_csv(run / "verdicts.csv").set_index("config")
        assert verdicts.verdict["golden"] == "GOLDEN", out.stdout[-3000:] + out.stderr[-3000:]
        assert verdicts.verdict["their-apc"] == "PASS" and verdicts.verified_hits["their-apc"] >= 3
        servers_ = {s["config"]: s["manifest"] for s in json.loads((run / "run.json").read_text())["servers"]}
        assert servers_["their-apc"]["served_model_name"] == str(model_dir)  # as the server names it (/v1/models)
        assert servers_["their-apc"]["block_size"] == 64  # from its /metrics
        assert "`their-apc`: **cache state not controlled**" in (run / "report.md").read_text()
        assert ("POST", "/reset_prefix_cache", None) in theirs.seen  # asked, refused (404), not probed
    finally:
        golden.stop()
        theirs.stop()


# --- the reset, on its own ----------------------------------------------------------------------------------

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


def test_first_error_line_of_a_server_log():
    # what the bench records of a server that died mid-run (and deploy of one that did not start)
    log = ("INFO starting\n(EngineCore) ERROR 11-29 [core.py] EngineCore failed to start.\n"
           "Traceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
           "    raise ValueError(msg)\nValueError: 1 validation error for ModelConfig\n"
           "  Value error, max_model_len too large\n    For further information visit https://errors.pydantic.dev\n")
    assert servers.first_error(log) == "ValueError: 1 validation error for ModelConfig Value error, max_model_len too large"
    assert servers.first_error("INFO a\nWARNING b\n(APIServer) ERROR 11-29 [factory.py] Connector X refused\n") \
        == "(APIServer) ERROR 11-29 [factory.py] Connector X refused"
    assert servers.first_error("INFO fine\n") == "no error line in the log"
