"""The single place that turns a streamed OpenAI response into a Record (artifacts.py), and a workload
request into an HTTP body.

No Locust here: `parse_stream` takes (arrival time, line) pairs, so tests feed it recorded SSE bytes.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable
from pathlib import Path

from kvscope.artifacts import Record, Request, append_jsonl, read_jsonl


def block_hashes(token_ids: list[int], block_size: int) -> list[str]:
    """Chained per-block hashes of full blocks, like vLLM's prefix-cache keys (not byte-equal to them)."""
    out, prev = [], b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = ",".join(map(str, token_ids[start:start + block_size])).encode()
        prev = hashlib.sha256(prev + b"|" + block).digest()
        out.append(prev[:8].hex())
    return out


def _set_prompt(rec: Record, ids: list[int], block_size: int, keep: bool) -> None:
    rec.prompt_sha = hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]
    rec.prompt_block_hashes = block_hashes(ids, block_size)
    rec.prompt_token_ids = list(ids) if keep else None


def token_id(token: str) -> int | str:
    """'token_id:42' (return_tokens_as_token_ids) -> 42; any other token string stays as it is."""
    return int(token[9:]) if token.startswith("token_id:") else token


def finite_logprob(logprob) -> float | None:
    """A logprob as the record keeps it: None where it is not a finite number (vLLM streams NaN for wrong KV)."""
    number = isinstance(logprob, (int, float)) and not isinstance(logprob, bool)
    return logprob if number and math.isfinite(logprob) else None


def _top(entry: dict | None, endpoint: str) -> list[tuple[int | str, float | None]]:
    """Alternatives at one position, best first, from a chat or a completions logprobs entry."""
    if not entry:
        return []
    if endpoint == "chat":
        return [(token_id(alt["token"]), finite_logprob(alt["logprob"])) for alt in entry.get("top_logprobs", [])]
    return sorted(((token_id(tok), finite_logprob(lp)) for tok, lp in entry.items()),
                  key=lambda x: -x[1] if x[1] is not None else math.inf)


def parse_stream(lines: Iterable[tuple[float, bytes]], t_start: float, rec: Record, block_size: int,
                 keep_prompt: bool = False) -> Record:
    """Fill `rec` from an SSE stream of (perf_counter time, raw line) pairs.

    TTFT is the time to the first chunk that carries a generated token: non-empty `content`/`text`, or,
    for a token that decodes to no text yet (a partial UTF-8 byte), non-empty `token_ids`. vLLM's first
    chat chunk carries only the role, so "first chunk" would under-report TTFT.
    """
    last_token_t, done = None, False
    for t, raw in lines:
        line = raw.strip()
        if not line or line.startswith(b":"):
            continue
        if not line.startswith(b"data:"):
            rec.error = f"malformed SSE line: {line[:80]!r}"
            break
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            rec.e2e_s = t - t_start
            break
        try:
            chunk = json.loads(payload)
        except json.JSONDecodeError:
            rec.error = f"malformed SSE JSON: {payload[:80]!r}"
            break
        if "error" in chunk:
            rec.error = f"server error in stream: {json.dumps(chunk['error'])[:200]}"
            break
        if chunk.get("usage"):
            usage = chunk["usage"]
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.completion_tokens = usage.get("completion_tokens")
            rec.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        for choice in chunk.get("choices") or []:
            if choice.get("prompt_token_ids"):  # completions put them on the choice
                _set_prompt(rec, choice["prompt_token_ids"], block_size, keep_prompt)
            text = (choice.get("delta") or {}).get("content") if rec.endpoint == "chat" else choice.get("text")
            ids = choice.get("token_ids") or []
            if text or ids:
                if last_token_t is None:
                    rec.ttft_s = t - t_start
                else:
                    rec.itl_s.append(t - last_token_t)
                last_token_t = t
            rec.output_text += text or ""
            rec.output_token_ids += ids
            lp = choice.get("logprobs")
            if lp:
                if rec.endpoint == "chat":
                    rec.top_logprobs += [_top(e, "chat") for e in lp.get("content") or []]
                else:
                    rec.top_logprobs += [_top(e, "completions") for e in lp.get("top_logprobs") or []]
            if choice.get("finish_reason"):
                rec.finish_reason = choice["finish_reason"]
        if chunk.get("prompt_token_ids"):  # chat puts them on the chunk
            _set_prompt(rec, chunk["prompt_token_ids"], block_size, keep_prompt)
    if rec.error is None and not done:
        rec.error = "truncated stream: ended without [DONE]"
    if rec.error is None and rec.ttft_s is None:
        rec.error = "no token in stream"
    rec.ok = rec.error is None
    return rec


def request_body(req: Request, history: list[dict], model: str, logprobs: int = 5, fault: str | None = None
                 ) -> tuple[str, dict]:
    """The HTTP path and JSON body of a workload request; `history` holds a session's earlier turns.
    Top-5 logprobs, as token ids (token strings are ambiguous: many byte tokens render as ''): at a bf16 tie
    the other side's token can rank third (H200 run), and fidelity needs it. `fault`: a canary treatment's
    fault class, passed to the canary connector in kv_transfer_params."""
    body = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
    }
    if fault:
        body["kv_transfer_params"] = {"kvscope_fault": fault}
    if req.endpoint == "chat":
        body.update(messages=history + (req.messages or []), logprobs=True, top_logprobs=logprobs)
        return "/v1/chat/completions", body
    body.update(prompt=req.prompt, logprobs=logprobs)
    return "/v1/completions", body


def request_key(request_id: str, phase: str) -> str:
    """The X-Request-Id kvscope sends with a request. vLLM names the request '<prefix>-<key>-<8 chars>'
    ('chatcmpl-' or 'cmpl-'), the id a canary's fault log carries (key_from_server_id)."""
    return f"{request_id}@{phase}"


_SERVER_ID = re.compile(r"^[a-z]+-(?P<key>.+@(?:prime|measure))(?:-\d+)?-[^-]+$")


def key_from_server_id(server_id: str) -> str:
    """The request key inside vLLM's request id: 'chatcmpl-<key>-<8 chars>', or for completions
    'cmpl-<key>-<prompt index>-<8 chars>'."""
    found = _SERVER_ID.match(server_id)
    return found.group("key") if found else server_id.split("-", 1)[-1].rsplit("-", 1)[0]


def new_record(req: Request, config: str, start_unix_s: float, worker: int = 0) -> Record:
    return Record(config=config, scenario=req.scenario, phase=req.phase, request_id=req.request_id,
                  session_id=req.session_id, turn=req.turn, endpoint=req.endpoint, start_unix_s=start_unix_s,
                  needle=req.needle, worker=worker)


SESSION_LOST = "kvscope: session lost"  # Locust's log line for a session whose records could not be written


def write(records: Iterable[Record | dict], path: Path) -> None:
    append_jsonl(path, records)


def read(path: Path) -> list[Record]:
    """All records of a JSONL file; a truncated or foreign line is an error naming the file and line."""
    return read_jsonl(path, Record)
