"""loadtests/repro/lmcache_mp_under_load.py's outcomes against a scripted OpenAI-style server: which exit code
each kind of answer gets (the real servers' runs are in test_deploy.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from conftest import REPO

SCRIPT = REPO / "loadtests" / "repro" / "lmcache_mp_under_load.py"


def serve(answer):
    """A server whose completion for a prompt is answer(prompt): (token ids, cached tokens or None), or an int
    HTTP status, or bytes sent as the body."""

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def reply(self, status: int, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            self.reply(200, json.dumps({"data": [{"id": "m"}]}).encode())

        def do_POST(self):
            prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
            out = answer(prompt)
            if isinstance(out, int):
                return self.reply(out, b"{}")
            if isinstance(out, bytes):
                return self.reply(200, out)
            ids, cached = out
            tokens = [f"token_id:{i}" for i in ids]
            doc = {"choices": [{"text": "", "logprobs": {"tokens": tokens,
                                                          "top_logprobs": [{t: -0.5} for t in tokens]}}],
                   "usage": {} if cached is None else {"prompt_tokens_details": {"cached_tokens": cached}}}
            self.reply(200, json.dumps(doc).encode())

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def run(reference, candidate) -> subprocess.CompletedProcess:
    ref, cand = serve(reference), serve(candidate)
    try:
        return subprocess.run([sys.executable, str(SCRIPT), "--url", f"http://127.0.0.1:{cand.server_port}",
                               "--reference-url", f"http://127.0.0.1:{ref.server_port}", "--prompts", "2",
                               "--users", "2", "--rounds", "1", "--max-tokens", "3"],
                              capture_output=True, text=True, timeout=120)
    finally:
        ref.shutdown()
        cand.shutdown()


def golden(prompt):
    return [len(prompt) % 7, 1, 2], None


seen: set[str] = set()


def cache(ids_of):
    """A cache: its first answer to a prompt is a miss, every later one a hit of 64 tokens."""
    def answer(prompt):
        hit = prompt in seen
        seen.add(prompt)
        return ids_of(prompt, hit), 64 if hit else 0
    return answer


@pytest.fixture(autouse=True)
def fresh_cache():
    seen.clear()


def test_a_correct_cache_passes():
    out = run(golden, cache(lambda p, hit: golden(p)[0]))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "repeat pass, 2 concurrent clients: 0 of 4 answers differ (4 reported cached tokens)" in out.stdout


def test_a_hit_with_another_token_fails_and_names_it():
    out = run(golden, cache(lambda p, hit: [9, 1, 2] if hit else golden(p)[0]))
    assert out.returncode == 1, out.stdout + out.stderr
    assert "cached 64 tokens, DIFFERS from the reference at token 0: ('token_id:9'" in out.stdout


def test_no_hit_or_no_reported_count_is_no_verdict():
    no_hit = run(golden, lambda p: (golden(p)[0], 0))
    assert no_hit.returncode == 3 and "no repeat reported cached tokens" in no_hit.stdout
    unreported = run(golden, lambda p: (golden(p)[0], None))
    assert unreported.returncode == 3 and "--enable-prompt-tokens-details" in unreported.stdout


@pytest.mark.parametrize("failure", [500, b'{"choices": [{"logprobs": null}]}', b'{"choi'])
def test_a_failed_request_is_no_verdict_not_a_difference(failure):
    out = run(golden, lambda p: failure)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "a request failed" in out.stderr


def test_the_failed_load_repro_names_why_a_variant_did_not_start():
    """On the H200 (2026-12-07) every variant's engine failed to start and the repro printed only the last three
    lines of the traceback ("Engine core initialization failed. See root cause above."): the cause it names
    is the error above that line."""
    sys.path.insert(0, str(REPO / "loadtests" / "repro"))
    try:
        from vllm_failed_load import root_cause
    finally:
        sys.path.pop(0)
    err = "\n".join(["INFO starting", "Traceback (most recent call last):", '  File "x.py", line 1, in f',
                     "ValueError: Free memory on device (12.1/139.8 GiB) is less than desired (14.0 GiB).",
                     "Traceback (most recent call last):", '  File "utils.py", line 1272, in wait_for_engine_startup',
                     "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}"])
    assert root_cause(err) == "ValueError: Free memory on device (12.1/139.8 GiB) is less than desired (14.0 GiB)."
    assert root_cause("RuntimeError: boom") == "RuntimeError: boom"
    assert root_cause("") == "no error output"
