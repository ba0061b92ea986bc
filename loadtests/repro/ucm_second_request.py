"""Reproduce UCM #867's symptom without kvscope: the second identical greedy request, served from a KV
store, answers differently from the first. Only Python's standard library; run it against a live server.

Start vLLM 0.26 with UCM 0.8.1's NFS store (prefix caching off, so every hit comes from UCM), e.g.:

    ENABLE_UCM_PATCH=1 python3 -m vllm.entrypoints.openai.api_server --model MODEL --port 8000 \
      --no-enable-prefix-caching --enable-prompt-tokens-details --kv-transfer-config \
      '{"kv_connector": "UCMConnector", "kv_connector_module_path": "ucm.integration.vllm.ucm_connector",
        "kv_role": "kv_both", "kv_connector_extra_config": {"enable_event_sync": false,
        "ucm_connectors": [{"ucm_connector_name": "UcmNfsStore",
                            "ucm_connector_config": {"storage_backends": "/path/to/store"}}]}}'
    python3 ucm_second_request.py --url http://127.0.0.1:8000

Each case sends its requests in order (temperature 0) and compares every repeat with the first answer to
the same prompt, which was computed without a hit. Cases: `seed` (UCM #867's bilingual chat request twice),
`long` (a prompt of many KV blocks twice), `interleaved` (long prompts A, B, A, B: does storing B disturb A?).
Prints one line per request (cached prompt tokens, identical or where it diverged) and exits 1 when any
repeat differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.request

SEED = [{"role": "system", "content": "你是一个简洁、专业的中文助手"},
        {"role": "user", "content": "你好Passage 1: 人工智能是计算机科学的一个分支。"
                                    "Passage 2: 机器学习是人工智能的核心技术。"
                                    "Passage 3: 深度学习是机器学习的一个分支。\n\nQuestion: 什么是人工智能？\nAnswer:"}]


def long_prompt(topic: str, sentences: int = 120) -> list[dict]:
    text = " ".join(f"Fact {i} about {topic}: item {i * 7 % 101} follows item {i * 13 % 97}." for i in range(sentences))
    return [{"role": "user", "content": f"{text}\n\nQuestion: which item follows item 42 for {topic}?"}]


CASES = {"seed": [("seed", SEED)] * 2,
         "long": [("A", long_prompt("rivers"))] * 2,
         "interleaved": [("A", long_prompt("mountains")), ("B", long_prompt("glaciers")),
                         ("A", long_prompt("mountains")), ("B", long_prompt("glaciers"))]}


def ask(url: str, model: str, messages: list[dict], max_tokens: int) -> tuple[str, int | None]:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "seed": 0}
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        doc = json.load(resp)
    details = doc.get("usage", {}).get("prompt_tokens_details") or {}
    return doc["choices"][0]["message"]["content"], details.get("cached_tokens")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", help="served model name (default: the server's first)")
    ap.add_argument("--max-tokens", type=int, default=50)
    ap.add_argument("--cases", default=",".join(CASES), help=f"some of {', '.join(CASES)}")
    args = ap.parse_args()
    model = args.model or json.load(urllib.request.urlopen(f"{args.url}/v1/models"))["data"][0]["id"]
    wrong = 0
    for case in args.cases.split(","):
        first: dict[str, str] = {}
        for i, (name, messages) in enumerate(CASES[case]):
            answer, cached = ask(args.url, model, messages, args.max_tokens)
            if name not in first:
                first[name] = answer
                verdict = "first answer"
            elif answer == first[name]:
                verdict = "identical to the first"
            else:
                wrong += 1
                at = next((j for j, (a, b) in enumerate(zip(answer, first[name])) if a != b),
                          min(len(answer), len(first[name])))
                verdict = f"DIFFERS from the first at character {at}"
            print(f"{case} #{i} prompt {name}: cached {cached} tokens, {verdict}: {answer[:70]!r}", flush=True)
    print(f"{wrong} repeated answer(s) differ from the first" if wrong else "every repeat is identical")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
