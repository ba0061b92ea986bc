"""Fake OpenAI-compatible servers in threads of the test process, for what does not depend on vLLM.

`Fake(routes)` serves the handler functions it is given (hostile answers: redirects, endless streams).
`FakeVLLM()` serves what kvscope reads off a vLLM server, as vLLM spells it: completions and chat streams
with token ids, top-5 logprobs (as token ids), `prompt_token_ids` and `cached_tokens`; `prompt_logprobs`;
`/metrics` (the counters, the TTFT histogram and `vllm:cache_config_info`); `/reset_prefix_cache`;
`/v1/models` and `/version`. Its "model" is a hash of the token ids so far: the same prompt always gets the
same answer, and golden's `prompt_logprobs` over prompt + answer give back the answer's own logprobs. Its
prefix cache counts the full blocks of a prompt it saw since the last reset; `wrong_cache` answers a request
that hit it with the second-best first token at a clear margin (wrong KV, as the canary's faults play it).
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

from tokenizers import Tokenizer

from kvscope.artifacts import Manifest
from kvscope.run.records import block_hashes

TOKENIZER = Path(__file__).resolve().parent.parent / "models" / "tiny-qwen3" / "tokenizer.json"
VOCAB = 1000
TOP_LOGPROBS = (-0.05, -3.0, -3.5, -4.0, -4.5)  # best first: any split from the best is at a clear margin


class Fake(ThreadingHTTPServer):
    """An OpenAI-style server in a thread: `routes` maps 'GET /path' or 'POST /path' to a handler function
    (BaseHTTPRequestHandler -> None); every request is noted in `seen` (method, path, Authorization)."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, routes: dict):
        self.routes, self.seen, self.stopping = routes, [], threading.Event()
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def port(self) -> int:
        return self.server_address[1]

    def stop(self) -> None:
        self.stopping.set()
        self.shutdown()
        self.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _any(self, method: str) -> None:
        path = self.path.split("?")[0]
        self.server.seen.append((method, path, self.headers.get("Authorization")))
        self.body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        route = self.server.routes.get(f"{method} {path}")
        try:
            if route is None:
                reply(self, 404, b"{}")
            else:
                route(self)
        except (BrokenPipeError, ConnectionResetError):  # the client stopped reading: as it should
            pass

    def do_GET(self):
        self._any("GET")

    def do_POST(self):
        self._any("POST")


def reply(h, status: int, body: bytes, **headers) -> None:
    h.send_response(status)
    for k, v in {"Content-Type": "application/json", "Content-Length": str(len(body)), **headers}.items():
        h.send_header(k, v)
    h.end_headers()
    h.wfile.write(body)


def _step(state: bytes, token: int) -> bytes:
    return hashlib.blake2b(state + token.to_bytes(4, "little"), digest_size=8).digest()


def _top(state: bytes) -> list[tuple[int, float]]:
    """The fake model's top 5 (token id, logprob) after the tokens that led to `state`, best first."""
    return list(zip(random.Random(state).sample(range(VOCAB), 5), TOP_LOGPROBS))


class FakeVLLM(Fake):
    """A vLLM-like server (see the module's docstring). `prefix_caching`: off for golden and the control.
    `wrong_cache`: a request with cached tokens answers otherwise. `resettable`: False for a server without
    vLLM's dev-mode `/reset_prefix_cache` (one kvscope did not deploy). `first_token_s`: its TTFT."""

    def __init__(self, name: str = "fake", prefix_caching: bool = True, wrong_cache: bool = False,
                 block_size: int = 16, resettable: bool = True, first_token_s: float = 0.0,
                 tokenizer: Path = TOKENIZER):
        self.name, self.prefix_caching, self.wrong_cache = name, prefix_caching, wrong_cache
        self.block_size, self.first_token_s = block_size, first_token_s
        self.tokenizer = Tokenizer.from_file(str(tokenizer))
        self.lock = threading.Lock()
        self.blocks: set[str] = set()
        self.counters = dict.fromkeys(("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens",
                                       "prompt_tokens_cached", "ttft_count"), 0)
        self.ttft_sum = 0.0
        routes = {"GET /v1/models": self._models, "GET /version": self._version, "GET /metrics": self._metrics,
                  "POST /v1/completions": self._complete, "POST /v1/chat/completions": self._complete}
        if resettable:
            routes["POST /reset_prefix_cache"] = self._reset
        super().__init__(routes)

    def manifest(self, role: str, model_dir: Path, config: str | None = None) -> Manifest:
        """What `make deploy` writes for this server into deployment.json."""
        return Manifest(config=config or self.name, role=role, port=self.port, platform="cpu",
                        served_model_name=self.name, server_args=[], store_reset="keep", vllm_version="fake",
                        kv_capacity_tokens=65536, block_size=self.block_size, prefix_caching=self.prefix_caching,
                        max_model_len=4096, model_path=str(model_dir), model_hash="fake-model")

    # --- the routes ---------------------------------------------------------------------------------------

    def _models(self, h) -> None:
        reply(h, 200, json.dumps({"object": "list", "data": [{"id": self.name, "max_model_len": 4096}]}).encode())

    def _version(self, h) -> None:
        reply(h, 200, b'{"version": "fake"}')

    def _reset(self, h) -> None:
        with self.lock:
            self.blocks.clear()
        reply(h, 200, b"")

    def _metrics(self, h) -> None:
        c = self.counters
        lines = []
        for name in ("prefix_cache_queries", "prefix_cache_hits", "prompt_tokens", "prompt_tokens_cached"):
            lines += [f"# TYPE vllm:{name}_total counter", f"vllm:{name}_total {c[name]}"]
        lines += ["# TYPE vllm:time_to_first_token_seconds histogram"]
        lines += [f'vllm:time_to_first_token_seconds_bucket{{le="{le}"}} {c["ttft_count"]}' for le in ("0.1", "+Inf")]
        lines += [f"vllm:time_to_first_token_seconds_count {c['ttft_count']}",
                  f"vllm:time_to_first_token_seconds_sum {self.ttft_sum}",
                  "# TYPE vllm:cache_config_info gauge",
                  f'vllm:cache_config_info{{block_size="{self.block_size}",enable_prefix_caching='
                  f'"{self.prefix_caching}",num_gpu_blocks="{65536 // self.block_size}"}} 1.0']
        reply(h, 200, ("\n".join(lines) + "\n").encode(), **{"Content-Type": "text/plain; version=0.0.4"})

    def _complete(self, h) -> None:
        received = time.monotonic()
        body = json.loads(h.body or b"{}")
        chat = h.path.startswith("/v1/chat")
        prompt = self._prompt_ids(body, chat)
        cached = self._lookup(prompt)
        answer = self._answer(prompt, int(body.get("max_tokens") or 16), wrong=self.wrong_cache and cached > 0)
        usage = {"prompt_tokens": len(prompt), "completion_tokens": len(answer),
                 "prompt_tokens_details": {"cached_tokens": cached}}
        time.sleep(max(0.0, self.first_token_s - (time.monotonic() - received)))
        with self.lock:
            self.counters["ttft_count"] += 1
            self.ttft_sum += time.monotonic() - received
        if not body.get("stream"):
            choice = {"index": 0, "text": "".join(f" t{t}" for t, _ in answer), "finish_reason": "length"}
            if body.get("prompt_logprobs"):
                choice["prompt_logprobs"] = self._prompt_logprobs(prompt)
            return reply(h, 200, json.dumps({"choices": [choice], "usage": usage}).encode())
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream")
        h.send_header("Connection", "close")
        h.end_headers()
        for i, (token, tops) in enumerate(answer):
            choice: dict = {"index": 0, "token_ids": [token], "finish_reason": "length" if i == len(answer) - 1
                            else None}
            if chat:
                choice["delta"] = {"content": f" t{token}"}
                choice["logprobs"] = {"content": [{"token": f"token_id:{token}", "logprob": dict(tops).get(token),
                                                   "top_logprobs": [{"token": f"token_id:{t}", "logprob": lp}
                                                                    for t, lp in tops]}]}
            else:
                choice["text"] = f" t{token}"
                choice["logprobs"] = {"tokens": [f"token_id:{token}"], "top_logprobs": [
                    {f"token_id:{t}": lp for t, lp in tops}]}
            chunk = {"choices": [choice]}
            if i == 0:  # vLLM sends the prompt's ids with the first chunk: on the choice, or on a chat chunk
                (chunk if chat else choice)["prompt_token_ids"] = prompt
            h.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
            h.wfile.flush()
        h.wfile.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
        h.close_connection = True

    # --- the model and its cache --------------------------------------------------------------------------

    def _prompt_ids(self, body: dict, chat: bool) -> list[int]:
        if chat:
            text = "".join(f"<{m['role']}>{m['content']}\n" for m in body.get("messages") or [])
            return self.tokenizer.encode(text).ids
        prompt = body.get("prompt", "")
        return list(prompt) if isinstance(prompt, list) else self.tokenizer.encode(prompt).ids

    def _lookup(self, prompt: list[int]) -> int:
        """Cached tokens of a prompt (its leading full blocks seen since the last reset, the last token always
        computed), counted as vLLM counts them; the prompt's blocks are then cached."""
        hashes = block_hashes(prompt, self.block_size)
        with self.lock:
            hit = next((i for i, b in enumerate(hashes) if b not in self.blocks), len(hashes))
            cached = min(hit * self.block_size, (len(prompt) - 1) // self.block_size * self.block_size)
            cached = cached if self.prefix_caching else 0
            if self.prefix_caching:
                self.blocks.update(hashes)
            for name, n in (("prefix_cache_queries", len(prompt)), ("prefix_cache_hits", cached),
                            ("prompt_tokens", len(prompt)), ("prompt_tokens_cached", cached)):
                self.counters[name] += n
        return cached

    def _answer(self, prompt: list[int], max_tokens: int, wrong: bool) -> list[tuple[int, list]]:
        """Greedy tokens and the top 5 at each; `wrong`: the second best first, as wrong KV would make it."""
        state, out = self._state(prompt), []
        for i in range(max_tokens):
            tops = _top(state)
            token = tops[1 if wrong and i == 0 else 0][0]
            out.append((token, tops))
            state = _step(state, token)
        return out

    def _prompt_logprobs(self, ids: list[int]) -> list:
        """vLLM's prompt_logprobs: None for the first token, then each position's top 5 and its own token."""
        out: list = [None]
        state = _step(b"", ids[0]) if ids else b""
        for token in ids[1:]:
            tops = dict(_top(state))
            tops.setdefault(token, -20.0)
            out.append({str(t): {"logprob": lp} for t, lp in tops.items()})
            state = _step(state, token)
        return out

    @staticmethod
    def _state(ids: list[int]) -> bytes:
        state = b""
        for token in ids:
            state = _step(state, token)
        return state
