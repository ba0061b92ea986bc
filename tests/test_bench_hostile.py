"""The bench against hostile or broken servers and against itself: redirects, endless and slow answers,
a resume of a changed plan, a bench killed with kill -9. Fake servers in threads of this process (fake_vllm.py); no
vLLM."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from conftest import REPO
from fake_vllm import Fake, reply

from kvscope.artifacts import Manifest, Request, Treatment
from kvscope.config.matrix import ConfigError

KEY = "sk-kvscope-test-key-4711"


MODELS = json.dumps({"data": [{"id": "m", "max_model_len": 4096}]}).encode()


def models(h):
    reply(h, 200, MODELS)


def sse(token_s: float = 0.0, tokens: int = 3):
    """A completions stream of `tokens` tokens, one every `token_s`; a plain JSON answer to a request that
    asked for no stream (the warm-up)."""
    def route(h):
        if not json.loads(h.body or b"{}").get("stream"):
            return reply(h, 200, json.dumps({"choices": [{"text": " x"}]}).encode())
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Connection", "close")
        h.end_headers()
        chat = h.path.startswith("/v1/chat")
        for i in range(tokens):
            if h.server.stopping.is_set():
                return
            choice = {"index": 0, "token_ids": [7 + i], "finish_reason": "length" if i == tokens - 1 else None,
                      **({"delta": {"content": " x"}} if chat else {"text": " x"})}
            h.wfile.write(b"data: " + json.dumps({"choices": [choice], "prompt_token_ids": [1, 2, 3]}).encode()
                          + b"\n\n")
            h.wfile.flush()
            time.sleep(token_s)
        usage = {"prompt_tokens": 3, "completion_tokens": tokens, "prompt_tokens_details": {"cached_tokens": 0}}
        h.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
        h.close_connection = True
    return route


def treatment(url: str, config: str = "golden", role: str = "golden") -> Treatment:
    port = int(url.rsplit(":", 1)[1])
    return Treatment(config=config, manifest=Manifest(
        config=config, role=role, port=port, platform="endpoint", served_model_name="m", server_args=[],
        vllm_version=None, kv_capacity_tokens=None, block_size=16, prefix_caching=False, model_path="/nowhere",
        model_hash="served:m", store_reset="keep"))


def finishes(fn, seconds: float):
    """fn()'s result or exception, if it came within `seconds`; fails the test otherwise (the thread is left
    behind, a daemon)."""
    out: dict = {}

    def call():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001  (handed to the test)
            out["error"] = exc

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still running after {seconds} s"
    return out


# --- redirects: the key goes to the address given, nowhere else ---------------------------------------------

def test_no_probe_and_no_locust_request_follows_a_redirect_to_another_address(tmp_path, monkeypatch):
    from kvscope.deploy import servers
    from kvscope.run import continuations, endpoints, metrics, serverstate, treatments
    from kvscope.run.workload import write_jsonl

    monkeypatch.setenv("KVSCOPE_API_KEY", KEY)
    elsewhere = Fake({"GET /v1/models": models, "GET /metrics": models, "POST /v1/completions": sse(),
                      "POST /reset_prefix_cache": lambda h: reply(h, 200, b"{}")})

    def redirect(h):
        reply(h, 302, b"", Location=elsewhere.url + h.path)

    named = Fake({f"{m} {p}": redirect for m in ("GET", "POST")
                  for p in ("/v1/models", "/metrics", "/version", "/v1/completions", "/reset_prefix_cache")})
    server = treatment(named.url)
    try:
        with pytest.raises(OSError, match="redirect"):
            servers.http_get(f"{named.url}/v1/models")
        with pytest.raises(ConfigError, match="/v1/models.*redirect"):
            endpoints.treatment(endpoints.parse(named.url, "e"), "candidate", tmp_path)
        with pytest.raises(OSError, match="redirect"):
            metrics.scrape(named.url)
        with pytest.raises(OSError, match="redirect"):
            continuations.golden_logprobs(server, [1, 2], [3], 0)
        serverstate.warm_up(server)
        assert serverstate.reset(server).reset_prefix_cache_http == 302  # what the reset got: not a 200
        request = Request(request_id="q-t0", scenario="s", phase="measure", session_id="q", turn=0,
                          endpoint="completions", max_tokens=2, prompt="hello")
        write_jsonl([request], tmp_path / "w.jsonl")
        phase = treatments.run_locust(server, tmp_path / "w.jsonl", tmp_path / "r.jsonl", 1, 1, 0.0, 60)
        assert phase.locust_exit in (0, 1), phase
        record = json.loads((tmp_path / "r.jsonl").read_text())
        assert record["http_status"] == 302 and "redirect" in record["error"], record
        assert elsewhere.seen == [], "a request (with the API key) reached the address it was redirected to"
        assert {auth for _, _, auth in named.seen} == {f"Bearer {KEY}"}
    finally:
        named.stop()
        elsewhere.stop()


# --- answers without end: bounded in size and in total time -------------------------------------------------

def forever(h, kind: str, block: bytes, pause_s: float):
    """A 200 whose body never ends (no length, no chunking: it lasts until the connection closes): `block`
    again and again, `pause_s` apart, until the fake server stops."""
    h.send_response(200)
    h.send_header("Content-Type", kind)
    h.send_header("Connection", "close")
    h.end_headers()
    while not h.server.stopping.is_set():
        h.wfile.write(block)
        time.sleep(pause_s)


def endless(h):
    """A JSON body that never ends, ~30 MB/s: enough to pass any sane size limit in a second."""
    forever(h, "application/json", b'{"choices": [{"text": "' + b"x" * 65536 + b'"}]}\n', 0.002)


def slowloris(h):
    """A 200 that announces a small body and sends it a byte at a time, each in time for any socket timeout."""
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", "100000")
    h.end_headers()
    while not h.server.stopping.is_set():
        h.wfile.write(b" ")
        h.wfile.flush()
        time.sleep(0.1)


def huge(h):
    """A valid /v1/models answer of 64 MiB."""
    reply(h, 200, MODELS[:-1] + b', "pad": "' + b"x" * (64 << 20) + b'"}')


def test_an_endless_warm_up_answer_or_metrics_page_is_cut_off(monkeypatch):
    from kvscope.run import metrics, serverstate

    fake = Fake({"POST /v1/completions": endless, "GET /metrics": endless})
    try:
        assert finishes(lambda: serverstate.warm_up(treatment(fake.url)), 15) == {"value": None}
        out = finishes(lambda: metrics.scrape(fake.url), 15)
        assert "larger than" in str(out.get("error")), out
    finally:
        fake.stop()


def test_a_warm_up_answer_that_trickles_ends_at_the_warm_ups_deadline():
    from kvscope.run import serverstate

    fake = Fake({"POST /v1/completions": slowloris})
    try:
        started = time.monotonic()
        assert finishes(lambda: serverstate.warm_up(treatment(fake.url), timeout_s=1.5), 10) == {"value": None}
        assert time.monotonic() - started < 5
    finally:
        fake.stop()


# the huge answer's limit must be met before the deadline, also on a loaded machine (beside make test's servers)
@pytest.mark.parametrize("route, why, probe_s", [(slowloris, "no full answer within 1", 1.0),
                                                 (huge, "larger than", 10.0)])
def test_an_endpoint_whose_models_trickle_or_never_end_is_refused_in_seconds(tmp_path, monkeypatch, route, why,
                                                                             probe_s):
    from kvscope.run import endpoints

    monkeypatch.setattr(endpoints, "PROBE_S", probe_s, raising=False)
    fake = Fake({"GET /v1/models": route})
    try:
        out = finishes(lambda: endpoints.treatment(endpoints.parse(fake.url, "e"), "candidate", tmp_path), 15)
        assert isinstance(out.get("error"), ConfigError), out
        assert "/v1/models did not answer" in str(out["error"]) and why in str(out["error"])
    finally:
        fake.stop()


# --- a resume continues the same plan, written by nobody else -----------------------------------------------

SCENARIOS = "scenarios:\n  - {name: rep, kind: repeat, endpoint: completions, repeats: 2, max_tokens: %d}\n"


def bench_args(tmp_path, model_dir, url: str, *extra: str, golden: str | None = None,
               endpoint: str = "theirs") -> list[str]:
    return ["bench", "--endpoint", f"{endpoint}={url}", "--golden", golden or url, "--model-dir", str(model_dir),
            "--results", str(tmp_path), "--scenarios-file", str(tmp_path / "s.yaml"), "--scenarios", "rep",
            "--run-id", "r", *extra]


def test_a_resume_whose_plan_changed_is_refused_saying_what_changed(tmp_path, monkeypatch, capsys, model_dir):
    from kvscope import cli
    from kvscope.artifacts import StatusRow, append_jsonl
    from kvscope.run import continuations, treatments
    from kvscope.runfolder import RunFolder

    def run_treatment(plan, server, label, progress):
        append_jsonl(RunFolder(plan.folder).status, [StatusRow(config=server.config, scenario=label)])

    monkeypatch.setattr(treatments, "_treatment", run_treatment)  # the plan is under test, not Locust
    monkeypatch.setattr(continuations, "collect", lambda *args, **kw: {})
    fake = Fake({"GET /v1/models": models})
    (tmp_path / "s.yaml").write_text(SCENARIOS % 4)
    workload = tmp_path / "r" / "workloads" / "rep.measure.jsonl"
    try:
        assert cli.main(bench_args(tmp_path, model_dir, fake.url)) == 3  # no records: inconclusive
        written = workload.read_text()
        (tmp_path / "s.yaml").write_text(SCENARIOS % 8)
        assert cli.main(bench_args(tmp_path, model_dir, fake.url, "--resume")) == 2
        err = capsys.readouterr().err
        assert "--resume: the plan differs from run.json's" in err, err
        assert "scenarios: rep (max_tokens: 4 in run.json, 8 now)" in err, err
        assert workload.read_text() == written  # nothing rewritten
        (tmp_path / "s.yaml").write_text(SCENARIOS % 4)
        elsewhere = Fake({"GET /v1/models": models})
        try:
            for argv, why in ((bench_args(tmp_path, model_dir, fake.url, "--resume", "--exact"),
                               "mode: normal in run.json, exact now"),
                              (bench_args(tmp_path, model_dir, fake.url, "--resume", endpoint="other"),
                               "servers: other (not in run.json), theirs (not now)"),
                              (bench_args(tmp_path, model_dir, fake.url, "--resume", golden=elsewhere.url),
                               "servers: golden (port)")):
                assert cli.main(argv) == 2, argv
                err = capsys.readouterr().err
                assert why in err, err
        finally:
            elsewhere.stop()
        upgraded = Fake({"GET /v1/models": models, "GET /version": lambda h: reply(h, 200, b'{"version": "0.34.0"}')})
        try:  # the same address, another vLLM (a STACK change): its answers would mix with the first one's
            assert cli.main(bench_args(tmp_path, model_dir, upgraded.url, "--resume", golden=fake.url)) == 2
            assert "servers: theirs (port, vllm_version)" in capsys.readouterr().err
        finally:
            upgraded.stop()
        workload.write_text(written.splitlines()[0] + "\n")  # a workload generated otherwise (another version)
        assert cli.main(bench_args(tmp_path, model_dir, fake.url, "--resume")) == 2
        assert "workloads: rep.measure" in capsys.readouterr().err
        workload.write_text(written)
        assert cli.main(bench_args(tmp_path, model_dir, fake.url, "--resume")) == 3  # the same plan: resumed
        assert "done earlier (--resume)" in capsys.readouterr().out
    finally:
        fake.stop()


def locusts(session: int) -> list[str]:
    found = subprocess.run(["pgrep", "-s", str(session), "-f", "--", "-m locust"], capture_output=True, text=True)
    return found.stdout.split()


def test_a_bench_killed_with_kill_9_takes_its_locust_along_and_no_resume_mixes_in_a_live_writers_records(
        tmp_path, model_dir):
    pace = {"first_s": 20.0}
    stream = sse(tokens=4)

    def completions(h):
        if json.loads(h.body or b"{}").get("stream"):
            time.sleep(pace["first_s"])  # a slow server: the Locust phase lasts while the test acts
        stream(h)

    fake = Fake({"GET /v1/models": models, "POST /v1/completions": completions,
                 "POST /reset_prefix_cache": lambda h: reply(h, 200, b"{}")})
    (tmp_path / "s.yaml").write_text(SCENARIOS % 4)
    cmd = [sys.executable, "-m", "kvscope.cli", *bench_args(tmp_path, model_dir, fake.url, "--timeout-s", "60")]
    bench = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not locusts(bench.pid) and bench.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert locusts(bench.pid), bench.communicate()
        resume = subprocess.run(cmd + ["--resume"], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert resume.returncode == 2 and "still writes into" in resume.stderr, resume.stdout + resume.stderr
        os.kill(bench.pid, signal.SIGKILL)  # the bench alone, as the OOM killer or kill -9 does
        deadline = time.monotonic() + 5
        while locusts(bench.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert locusts(bench.pid) == [], "Locust outlived the bench killed with kill -9"
        pace["first_s"] = 0
        resume = subprocess.run(cmd + ["--resume"], cwd=REPO, capture_output=True, text=True, timeout=120)
        assert resume.returncode == 0, resume.stdout[-2000:] + resume.stderr[-2000:]
        for config in ("golden", "theirs"):  # each request once: nothing of the killed run's Locust
            lines = (tmp_path / "r" / "records" / f"{config}__rep.jsonl").read_text().splitlines()
            assert sorted(json.loads(x)["request_id"] for x in lines) == ["rep-r0", "rep-r1"], config
    finally:
        try:
            os.killpg(bench.pid, signal.SIGKILL)  # whatever this test started and is left
        except ProcessLookupError:
            pass
        bench.communicate()
        fake.stop()


def endless_stream(h):
    """A completions stream of tokens that never ends."""
    chunk = b"data: " + json.dumps({"choices": [{"index": 0, "text": " x", "token_ids": [7]}]}).encode() + b"\n\n"
    forever(h, "text/event-stream", chunk * 100, 0.01)


def test_a_locust_stream_longer_than_its_max_tokens_allow_is_cut_off(tmp_path):
    from kvscope.run import treatments
    from kvscope.run.workload import write_jsonl

    fake = Fake({"POST /v1/completions": endless_stream})
    try:
        request = Request(request_id="q-t0", scenario="s", phase="measure", session_id="q", turn=0,
                          endpoint="completions", max_tokens=2, prompt="hello")
        write_jsonl([request], tmp_path / "w.jsonl")
        phase = treatments.run_locust(treatment(fake.url), tmp_path / "w.jsonl", tmp_path / "r.jsonl", 1, 1, 0.0, 40)
        record = json.loads((tmp_path / "r.jsonl").read_text())
        assert "longer than max_tokens allow" in record["error"] and phase.seconds < 20, (record["error"], phase)
    finally:
        fake.stop()
