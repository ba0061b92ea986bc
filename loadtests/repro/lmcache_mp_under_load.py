"""Look for lmcache-mp's wrong hits without kvscope: prompts whose KV LMCache's multi-process server already
holds, asked again by many clients at once, each answer compared with a server that recomputes it (kvscope
saw lmcache-mp serve wrong KV on some hits of its RAG workload). Only Python's standard library; run it
against live servers.

Start vLLM 0.26 with LMCache 0.5.6's multi-process connector (prefix caching off, so every hit comes from
LMCache), exact (greedy answers then depend on the KV alone, not on how requests were batched), e.g.:

    VLLM_BATCH_INVARIANT=1 python3 -m vllm.entrypoints.openai.api_server --model MODEL --port 8000 \
      --dtype bfloat16 --attention-backend TRITON_ATTN --max-num-batched-tokens 255 --max-num-seqs 32 \
      --kv-cache-memory-bytes 3221225472 --gpu-memory-utilization 0.05 \
      --no-enable-prefix-caching --enable-prompt-tokens-details --kv-transfer-config \
      '{"kv_connector": "LMCacheMPConnector",
        "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 8317,
          "lmcache.mp.autostart": true, "lmcache.mp.autostart.server_args": "--l1-size-gb 4 --http-port 8318"}}'

and the reference beside it on the same GPU: the same command on another port without `--kv-transfer-config`
(`lmcache_mp_servers.sh` starts both and the control). Then

    python3 lmcache_mp_under_load.py --url http://127.0.0.1:8000 --reference-url http://127.0.0.1:8001

Prompts: `distinct` ones (passages of their own) and `shared` ones (the same passages, then a question of
their own: every prompt's first LMCache chunks are the same, as in a RAG corpus). The reference answers each
prompt once. The server under test answers each prompt once, one at a time (LMCache stores it, and a
`shared` prompt already hits the passages stored before it), then ROUNDS more times from USERS concurrent
clients. An answer is its greedy tokens and each one's top-5 logprobs, compared exactly (exact servers give
bitwise-equal logprobs for equal KV; `--compare tokens` for servers that are not). One line per answer that
differs (cached prompt tokens, the first differing token) and a summary per phase (answers that differ,
answers vLLM reports cached tokens for). Exit 1: an answer differs; 2: a request failed; 3: none differs,
but no repeat was a hit, or the server does not report cached tokens (nothing known to be tested).
`--users 1` tells whether load matters. A reference run against a correct cache (vLLM's prefix cache: the
same flags with prefix caching on and no connector) must find every answer identical; otherwise the two
servers do not compute alike.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request
from concurrent.futures import ThreadPoolExecutor


def passage(topic: str, sentences: int) -> str:
    return " ".join(f"Fact {i} about {topic}: item {i * 7 % 101} follows item {i * 13 % 97}." for i in range(sentences))


def prompts(count: int, sentences: int) -> dict[str, str]:
    shared = passage("the archive", sentences)
    out = {f"distinct-{i}": f"{passage(f'collection {i}', sentences)}\nQuestion: which item follows item {i}?\nAnswer:"
           for i in range(count)}
    out |= {f"shared-{i}": f"{shared}\nQuestion: which item follows item {i * 11 % 97}?\nAnswer:" for i in range(count)}
    return out


def ask(url: str, model: str, prompt: str, max_tokens: int) -> tuple[list, int | None]:
    """The answer as [("token_id:N", {top-5 "token_id:N": logprob})] and the prompt tokens vLLM reports as
    cached (None where the server does not report them)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "seed": 0,
            "logprobs": 5, "return_tokens_as_token_ids": True}  # ids: two tokens may decode alike
    req = urllib.request.Request(f"{url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        doc = json.load(resp)
    details = doc.get("usage", {}).get("prompt_tokens_details") or {}
    lp = doc["choices"][0]["logprobs"]
    return list(zip(lp["tokens"], lp["top_logprobs"], strict=True)), details.get("cached_tokens")


def served_model(url: str) -> str:
    with urllib.request.urlopen(f"{url}/v1/models", timeout=60) as resp:
        return json.load(resp)["data"][0]["id"]


def differs_at(answer: list, reference: list, tokens_only: bool = False) -> int | None:
    """The first token whose text (or, unless tokens_only, top-5 logprobs) differ; None where they are equal."""
    if tokens_only:
        answer, reference = [t for t, _ in answer], [t for t, _ in reference]
    if answer == reference:
        return None
    return next((j for j, (a, b) in enumerate(zip(answer, reference)) if a != b), min(len(answer), len(reference)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server under test (LMCache)")
    ap.add_argument("--reference-url", default="http://127.0.0.1:8001", help="the same model and flags, no KV reuse")
    ap.add_argument("--prompts", type=int, default=8, help="prompts of each kind (distinct, shared)")
    ap.add_argument("--sentences", type=int, default=60, help="sentences per passage (~17 tokens each)")
    ap.add_argument("--users", type=int, default=16, help="concurrent clients in the repeat phase")
    ap.add_argument("--rounds", type=int, default=2, help="times each prompt is asked again in the repeat phase")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--compare", choices=("logprobs", "tokens"), default="logprobs",
                    help="tokens: the greedy tokens alone, for servers that are not batch-invariant")
    args = ap.parse_args()
    model = served_model(args.url)
    todo = prompts(args.prompts, args.sentences)
    reference_model = served_model(args.reference_url)
    reference = {name: ask(args.reference_url, reference_model, p, args.max_tokens)[0] for name, p in todo.items()}

    def judge(phase: str, name: str) -> tuple[bool, int | None]:  # (differs, cached tokens vLLM reported)
        answer, cached = ask(args.url, model, todo[name], args.max_tokens)
        at = differs_at(answer, reference[name], args.compare == "tokens")
        if at is not None:
            mine, theirs = (a[at] if at < len(a) else "(ended)" for a in (answer, reference[name]))
            print(f"{phase} {name}: cached {cached} tokens, DIFFERS from the reference at token {at}: "
                  f"{mine} vs {theirs}", flush=True)
        return at is not None, cached

    def summary(results: list[tuple[bool, int | None]]) -> str:
        return (f"{sum(d for d, _ in results)} of {len(results)} answers differ "
                f"({sum(bool(c) for _, c in results)} reported cached tokens)")

    first = [judge("first", name) for name in todo]
    print(f"first pass, one at a time: {summary(first)}", flush=True)
    repeats = [name for _ in range(args.rounds) for name in todo]
    pool = ThreadPoolExecutor(args.users)
    try:
        again = list(pool.map(lambda name: judge("repeat", name), repeats))
    finally:  # on a failed request or Ctrl-C, the queued repeats are not sent
        pool.shutdown(wait=False, cancel_futures=True)
    print(f"repeat pass, {args.users} concurrent clients: {summary(again)}", flush=True)
    wrong = sum(d for d, _ in first + again)
    if wrong:
        print(f"{wrong} answer(s) differ from the reference")
        return 1
    if any(c is None for _, c in first + again):
        print("no answer differs, but the server reports no cached tokens (start it with "
              "--enable-prompt-tokens-details): whether any answer was a hit is unknown")
        return 3
    if not any(c for _, c in again):
        print("no answer differs, but no repeat reported cached tokens: no hit, nothing tested")
        return 3
    print("every answer is identical to the reference")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception as exc:  # a server that refused, timed out, died mid-answer or answered otherwise
        print(f"a request failed: {type(exc).__name__}: {exc}", file=sys.stderr)  # than expected: no verdict
        sys.exit(2)
