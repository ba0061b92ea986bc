"""The reset probe against a fake server whose reset answers 200: one that really empties its tiers, one whose
host tier keeps serving (vllm#57727's shape), one that exposes no counter. What is under test is kvscope's
reading of a server's counters, not vLLM, so no vLLM is started; test_connector_e2e checks a real reset."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pandas as pd
import pytest
from test_report import four, make_run

from kvscope.analyze import report, verdicts
from kvscope.artifacts import Manifest, StatusRow, Treatment
from kvscope.run import serverstate

PROMPT_TOKENS = 160


class Fake:
    """A server with a GPU prefix cache and a host tier; `leaky`: its reset leaves the host tier serving;
    `silent`: no usage details and no /metrics."""

    def __init__(self, leaky: bool = False, silent: bool = False, no_reset: bool = False):
        self.leaky, self.silent, self.no_reset = leaky, silent, no_reset
        self.gpu: set[str] = set()
        self.host: set[str] = set()
        self.counters = {"vllm:prompt_tokens_total": 0, "vllm:prefix_cache_hits_total": 0,
                         'vllm:prompt_tokens_cached_by_source_total{source="host"}': 0}

    def complete(self, prompt: str) -> dict:
        tokens = PROMPT_TOKENS
        source = "gpu" if prompt in self.gpu else "host" if prompt in self.host else None
        self.counters["vllm:prompt_tokens_total"] += tokens
        if source == "gpu":
            self.counters["vllm:prefix_cache_hits_total"] += tokens
        elif source == "host":
            self.counters['vllm:prompt_tokens_cached_by_source_total{source="host"}'] += tokens
        self.gpu.add(prompt)
        self.host.add(prompt)
        usage: dict = {"prompt_tokens": tokens, "completion_tokens": 4}
        if not self.silent:
            usage["prompt_tokens_details"] = {"cached_tokens": tokens if source else 0}
        return {"choices": [{"text": " a b c d"}], "usage": usage}

    def reset(self) -> None:
        self.gpu.clear()
        if not self.leaky:
            self.host.clear()

    def metrics(self) -> str:
        lines = []
        for key, value in self.counters.items():
            lines += [f"# TYPE {key.split('{')[0]} counter", f"{key} {value}"]  # as prometheus_client writes
        return "\n".join(lines) + "\n"


@pytest.fixture
def serve():
    started = []

    def start(fake: Fake) -> Treatment:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, code: int, body: str, kind: str = "application/json") -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body.encode())

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.path.startswith("/reset_prefix_cache") and not fake.no_reset:
                    fake.reset()
                    self._send(200, "")
                elif self.path == "/v1/completions":
                    self._send(200, json.dumps(fake.complete(json.loads(body)["prompt"])))
                else:
                    self._send(404, "{}")

            def do_GET(self):
                if self.path == "/metrics" and not fake.silent:
                    self._send(200, fake.metrics(), "text/plain")
                else:
                    self._send(404, "{}")

        server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        started.append(server)
        manifest = Manifest.model_construct(config="apc", role="candidate", host="127.0.0.1",
                                            port=server.server_address[1], block_size=64, served_model_name="tiny",
                                            stores={}, store_reset="wipe")
        return Treatment.model_construct(config="apc", manifest=manifest, run_dir=None, scheme="http")

    yield start
    for server in started:
        server.shutdown()


def treatment_reset(server: Treatment):
    """What a treatment does before its first phase: warm up, reset, probe."""
    serverstate.warm_up(server)
    return serverstate.reset_and_probe(server)


def test_a_reset_that_empties_every_tier_probes_clean(serve):
    cleared = treatment_reset(serve(Fake()))
    assert cleared.reset_prefix_cache_http == 200 and cleared.probe.cached_tokens == 0
    assert cleared.probe.counters == {"vllm:prefix_cache_hits_total": 0.0,
                                      "vllm:prompt_tokens_cached_by_source_total{source=host}": 0.0}
    assert verdicts.reset_leak(cleared.probe, 64) is None and verdicts.reset_unverified(cleared.probe) is None


def test_a_reset_that_leaves_a_tier_serving_is_caught_by_every_counter(serve):
    cleared = treatment_reset(serve(Fake(leaky=True)))
    assert cleared.reset_prefix_cache_http == 200  # the status alone says all is well
    assert verdicts.reset_leak(cleared.probe, 64) == (
        "reset did not reset: 160 tokens from the answer's usage (cached_tokens), 160 tokens from the host tier "
        "(vLLM's cached tokens by source)")


def test_a_server_without_counters_leaves_the_reset_unverified(serve):
    cleared = treatment_reset(serve(Fake(silent=True)))
    assert verdicts.reset_leak(cleared.probe, 64) is None
    assert "exposes none of the counters" in verdicts.reset_unverified(cleared.probe)


def test_a_server_kvscope_cannot_reset_is_not_probed(serve):
    # a server kvscope did not deploy (no /reset_prefix_cache): its cache was never emptied, so a hit there
    # is no reset that failed to reset; the report says its cache state is not controlled instead
    cleared = treatment_reset(serve(Fake(no_reset=True)))
    assert cleared.reset_prefix_cache_http == 404 and cleared.probe is None
    assert verdicts.reset_leak(cleared.probe, 64) is None


def test_a_leaky_reset_makes_the_treatment_invalid_and_withholds_its_speed(serve, tmp_path):
    leaky, clean = treatment_reset(serve(Fake(leaky=True))), treatment_reset(serve(Fake()))
    run = make_run(tmp_path / "run", four(), status=False)
    rows = [StatusRow(config=c, scenario="s", reset=leaky if c == "apc" else clean) for c in four()]
    (run / "status.jsonl").write_text("".join(r.model_dump_json() + "\n" for r in rows))
    assert report.write(run, min_hits=1) == 3  # inconclusive: the cache may be right, its measurement is not
    v = pd.read_csv(run / "verdicts.csv").set_index("config")
    assert v.verdict["apc"] == "INVALID" and v.verdict["control"] == "PASS" and v.verdict["canary-shift"] == "FAIL"
    assert v.why["apc"].startswith("s: reset did not reset: 160 tokens from the answer's usage")
    overview = pd.read_csv(run / "overview.csv").set_index("config")
    assert overview.loc["apc", ["hit_ttft_p50_ms", "speedup_hits", "requests_per_s"]].isna().all()
    assert pd.read_csv(run / "summary.csv").set_index("config").speedup_hits.isna()["apc"]
    md = (run / "report.md").read_text()
    assert "- `apc` x `s`: **reset did not reset: 160 tokens from the answer's usage (cached_tokens), 160 tokens " \
           "from the host tier (vLLM's cached tokens by source)**; its speed figures are withheld" in md
    assert "every counter read 0 on 3 of 4 treatments" in md
