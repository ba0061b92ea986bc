"""Workload generation: an offline document pool and the RAG, multi-turn and repeat-867 scenarios.

Everything is deterministic from the scenario's seed and written as JSONL, so every storage config replays
exactly the same requests. Document lengths are measured in tokens of the served model's tokenizer.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import yaml
from pydantic import ValidationError

from kvscope import artifacts
from kvscope.artifacts import Request, Scenario, append_jsonl
from kvscope.config import strict_yaml
from kvscope.config.matrix import ConfigError

SEED_SYSTEM = "你是一个简洁、专业的中文助手"
SEED_USER = (
    "你好Passage 1: 人工智能是计算机科学的一个分支。Passage 2: 机器学习是人工智能的核心技术。"
    "Passage 3: 深度学习是机器学习的一个分支。\n\nQuestion: 什么是人工智能？\nAnswer:"
)


@dataclass
class Document:
    doc_id: int
    text: str
    tokens: int
    needle: str


def load_scenarios(path: Path) -> dict[str, Scenario]:
    try:
        raw = strict_yaml.load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the scenarios: {exc}") from exc
    out = {}
    for item in raw.get("scenarios", []):
        try:
            sc = Scenario.model_validate(item)
        except ValidationError as exc:
            fields = "; ".join(f"field '{'.'.join(map(str, e['loc']))}': {e['msg']}" for e in exc.errors())
            raise ConfigError(f"scenario '{item.get('name', '?')}': {fields}") from exc
        if sc.trace is not None:  # a trace beside the scenarios file is found from anywhere
            sc.trace = str((Path(path).parent / sc.trace).resolve())
        out[sc.name] = sc
    return out


def _paragraphs() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    out = []
    for topic in sorted(topics):
        for para in re.split(r"\n\s*\n", topics[topic]):
            para = " ".join(para.split())
            if len(para) > 40:
                out.append((topic, para))
    return out


def _code(rng: np.random.Generator) -> str:
    letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"
    return "".join(letters[i] for i in rng.integers(0, len(letters), 2)) + "".join(
        str(d) for d in rng.integers(0, 10, 4)
    )


def build_pool(sc: Scenario, num_docs: int, tokenizer) -> list[Document]:
    """Documents with unique headers (none is a prefix of another) and one planted needle fact each."""
    rng = np.random.default_rng([sc.seed, 1])
    paras = _paragraphs()
    docs = []
    for doc_id in range(num_docs):
        target = int(np.clip(rng.lognormal(math.log(sc.doc_tokens_median), sc.doc_tokens_sigma),
                             sc.doc_tokens_median // 4, sc.doc_tokens_median * 4))
        start = int(rng.integers(0, len(paras)))
        topic = paras[start][0]
        code = _code(rng)
        needle = f"The audit code for doc {doc_id:04d} is {code}."
        body: list[str] = []
        i = start
        while len(tokenizer.encode(" ".join(body)).ids) < target:
            body.append(paras[i % len(paras)][1])
            i += 1
        words = " ".join(body).split()
        # trim to the target length in tokens, then plant the needle at a seeded position
        lo, hi = 1, len(words)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if len(tokenizer.encode(" ".join(words[:mid])).ids) <= target else (lo, mid - 1)
        words = words[:lo]
        at = int(rng.integers(0, len(words) + 1))
        text = f"[doc {doc_id:04d} | {topic}]\n" + " ".join(words[:at] + [needle] + words[at:])
        docs.append(Document(doc_id, text, len(tokenizer.encode(text).ids), code))
    return docs


def system_prompts(sc: Scenario, tokenizer) -> list[str]:
    paras = [p for _, p in _paragraphs()]
    out = []
    for tenant in range(sc.tenants):
        text = f"You are the assistant of tenant {tenant}. Answer from the documents only."
        i = tenant * 7
        while len(tokenizer.encode(text).ids) < sc.system_prompt_tokens:
            text += " " + paras[i % len(paras)]
            i += 1
        words = text.split()
        while len(tokenizer.encode(" ".join(words)).ids) > sc.system_prompt_tokens and len(words) > 12:
            words.pop()
        out.append(" ".join(words))
    return out


def zipf_weights(n: int, s: float) -> np.ndarray:
    w = 1.0 / np.arange(1, n + 1) ** s
    return w / w.sum()


def _question(doc: Document) -> str:
    return f"Question: What is the audit code for doc {doc.doc_id:04d}?\nAnswer:"


def _rag_request(sc, rid, session, turn, system, docs, target) -> Request:
    context = "\n\n".join(d.text for d in docs)
    question = _question(target)
    if sc.endpoint == "chat":
        messages = [{"role": "system", "content": system}, {"role": "user", "content": f"{context}\n\n{question}"}]
        return _request(rid, sc, session, turn, "chat", messages=messages, doc_ids=[d.doc_id for d in docs],
                        needle=target.needle)
    return _request(rid, sc, session, turn, "completions", prompt=f"{system}\n\n{context}\n\n{question}",
                    doc_ids=[d.doc_id for d in docs], needle=target.needle)


def _request(rid: str, sc: Scenario, session: str, turn: int, endpoint: Literal["chat", "completions"],
             **fields) -> Request:
    return Request(request_id=rid, scenario=sc.name, phase="measure", session_id=session, turn=turn,
                   endpoint=endpoint, max_tokens=sc.max_tokens, **fields)


def generate(sc: Scenario, tokenizer, kv_capacity_tokens: int | None = None,
             max_model_len: int | None = None) -> list[Request]:
    """The scenario's requests, in session order; the same seed gives the same requests."""
    if sc.kind == "repeat":
        return _repeat(sc)
    if sc.kind == "trace":
        return replay_trace(sc, tokenizer.get_vocab_size(), max_model_len)
    if sc.kind == "reuse":
        return _reuse(sc, tokenizer.get_vocab_size())
    num_docs = sc.num_docs
    if sc.working_set is not None:
        if not kv_capacity_tokens:
            raise ConfigError(f"scenario '{sc.name}': field 'working_set' needs the servers' KV capacity")
        num_docs = max(sc.docs_per_query, math.ceil(sc.working_set * kv_capacity_tokens / sc.doc_tokens_median))
    if sc.docs_per_query > num_docs:
        raise ConfigError(f"scenario '{sc.name}': field 'docs_per_query' exceeds the pool of {num_docs} documents")
    pool = build_pool(sc, num_docs, tokenizer)
    systems = system_prompts(sc, tokenizer)
    rng = np.random.default_rng([sc.seed, 2])
    popularity = rng.permutation(num_docs)  # popularity rank -> doc id
    weights = zipf_weights(num_docs, sc.zipf_s)
    requests: list[Request] = []
    for q in range(sc.num_queries):
        picked = [int(popularity[r]) for r in rng.choice(num_docs, sc.docs_per_query, replace=False, p=weights)]
        docs = [pool[i] for i in (sorted(picked) if sc.order == "canonical" else rng.permutation(picked))]
        system = systems[int(rng.integers(0, len(systems)))]
        session = f"{sc.name}-{q:04d}"
        target = docs[int(rng.integers(0, len(docs)))]
        requests.append(_rag_request(sc, f"{session}-t0", session, 0, system, docs, target))
        if sc.kind == "multiturn":
            for turn in range(1, sc.turns):
                follow = pool[int(popularity[rng.choice(num_docs, p=weights)])]
                requests.append(_request(
                    f"{session}-t{turn}", sc, session, turn, "chat",
                    messages=[{"role": "user", "content": f"{follow.text}\n\n{_question(follow)}"}],
                    doc_ids=[follow.doc_id], needle=follow.needle, with_history=True))
    return _primed(sc, requests)


def _repeat(sc: Scenario) -> list[Request]:
    """The upstream bug's scenario: the same greedy chat request sent `repeats` times in a row."""
    messages = [{"role": "system", "content": SEED_SYSTEM}, {"role": "user", "content": SEED_USER}]
    return [
        _request(f"{sc.name}-r{i}", sc, sc.name, i, sc.endpoint, messages=messages if sc.endpoint == "chat" else None,
                 prompt=None if sc.endpoint == "chat" else f"{SEED_SYSTEM}\n{SEED_USER}")
        for i in range(sc.repeats)
    ]


TRACE_FIRST_TOKEN = 256  # replayed blocks use token ids from here on (below: bytes and special tokens)


def token_block(key: tuple[int, ...], n: int, vocab: int) -> list[int]:
    """n tokens drawn from the key (non-negative integers): the same key always gives the same tokens."""
    rng = np.random.default_rng(list(key))
    return [int(t) for t in rng.integers(TRACE_FIRST_TOKEN, vocab, n)]


def trace_block(seed: int, hash_id: int, n: int, vocab: int) -> list[int]:
    """The tokens of one trace block: the same hash id always gives the same tokens."""
    return token_block((seed, 3, hash_id), n, vocab)


def read_trace(sc: Scenario) -> list[dict]:
    """The replayed rows of a Mooncake-format trace: its first max_requests within duration_s (scaled) of its
    first row. Every row is checked, the ones past those too: a bad row, or one out of time order, is an error
    naming its line (an out-of-order row would end the slice early)."""
    assert sc.trace is not None
    where = f"scenario '{sc.name}': field 'trace': {sc.trace}"
    rows: list[dict] = []
    try:
        lines = open(sc.trace)
    except OSError as exc:
        raise ConfigError(f"scenario '{sc.name}': field 'trace': cannot read {sc.trace}: {exc}") from exc
    first = last = None
    with lines:
        for n, line in enumerate(lines, 1):
            row = _trace_row(line)
            if row is None:
                raise ConfigError(f"{where}:{n}: not a Mooncake trace row (timestamp, input_length, output_length: "
                                  "non-negative integers; hash_ids: a list of them)")
            if last is not None and row["timestamp"] < last[1]:
                raise ConfigError(f"{where}:{n}: timestamp {row['timestamp']} is before line {last[0]}'s {last[1]}: a "
                                  "trace's rows go in time order")
            last = n, row["timestamp"]
            first = row["timestamp"] if first is None else first
            if len(rows) < sc.max_requests and (row["timestamp"] - first) * sc.time_scale / 1000 <= sc.duration_s:
                rows.append(row)
    if not rows:
        raise ConfigError(f"{where}: no rows")
    return rows


def _count(value) -> bool:
    """A non-negative integer (JSON's true and false are not)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _trace_row(line: str) -> dict | None:
    try:
        row = json.loads(line)
    except ValueError:
        return None
    ok = isinstance(row, dict) and isinstance(row.get("hash_ids"), list) and all(map(_count, row["hash_ids"])) and all(
        _count(row.get(k)) for k in ("timestamp", "input_length", "output_length"))
    return row if ok else None


def replay_trace(sc: Scenario, vocab: int, max_model_len: int | None) -> list[Request]:
    """A trace's requests, one session each: a token block per hash id (block_tokens long: the length scale
    is block_tokens / trace_block_tokens), the last block cut to the scaled input length, the prompt capped
    so prompt and answer fit max_model_len, the answer at most max_tokens; arrivals at the trace's times."""
    scale = sc.block_tokens / sc.trace_block_tokens
    room = (max_model_len or 1 << 30) - sc.max_tokens
    rows = read_trace(sc)
    start = rows[0]["timestamp"] if rows else 0
    out = []
    for i, row in enumerate(rows):
        length = min(max(1, round(row["input_length"] * scale)), room)
        prompt: list[int] = []
        for hash_id in row["hash_ids"]:
            if len(prompt) >= length:
                break
            prompt += trace_block(sc.seed, hash_id, sc.block_tokens, vocab)
        prompt = (prompt or token_block((sc.seed, 5, i), length, vocab))[:length]
        session = f"{sc.name}-{i:05d}"
        out.append(Request(request_id=f"{session}-t0", scenario=sc.name, phase="measure", session_id=session, turn=0,
                           endpoint="completions", max_tokens=max(1, min(sc.max_tokens, row["output_length"])),
                           prompt=prompt, arrival_s=(row["timestamp"] - start) * sc.time_scale / 1000))
    return out


def _reuse(sc: Scenario, vocab: int) -> list[Request]:
    """Prompts whose first `reuse` share is one of `prefixes` shared prefixes, taken in turn, and whose rest
    no other prompt has: once each prefix was seen, a cache can serve that share and no more."""
    shared = round(sc.reuse * sc.prompt_tokens)
    out = []
    for q in range(sc.num_queries):
        prompt = (token_block((sc.seed, 6, q % sc.prefixes), shared, vocab) +
                  token_block((sc.seed, 7, q), sc.prompt_tokens - shared, vocab))
        session = f"{sc.name}-{q:04d}"
        out.append(_request(f"{session}-t0", sc, session, 0, "completions", prompt=prompt))
    return _primed(sc, out)


def _primed(sc: Scenario, requests: list[Request]) -> list[Request]:
    """With prime: replay, every request once first (phase prime), then again (measure)."""
    if sc.prime != "replay":
        return requests
    return [r.model_copy(update={"request_id": "prime-" + r.request_id, "phase": "prime",
                                 "session_id": "prime-" + r.session_id}) for r in requests] + requests


def write_jsonl(requests: list[Request], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    append_jsonl(path, requests)


def read_jsonl(path: Path) -> list[Request]:
    return artifacts.read_jsonl(path, Request)


def sessions(requests: list[Request]) -> list[list[Request]]:
    """Group requests into sessions, keeping first-appearance order; prime sessions come first."""
    grouped: dict[str, list[Request]] = {}
    for r in requests:
        grouped.setdefault(r.session_id, []).append(r)
    return list(grouped.values())
