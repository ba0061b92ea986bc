"""Golden's view of answers: the golden server scores prompt + answer, token by token.

Two uses, both while the golden server is still up at the end of a bench:
- an answer that splits from golden's: is the rest what golden itself would say after that token? A
  correct cache that flips a near tie continues as golden would from there; wrong KV does not.
- golden's own answers, scored again: how far golden's prompt_logprobs path is from its decode path (part
  of the run's noise floor; fidelity.noise).
prompt_logprobs bypass the prefix cache, which is harmless on a cache-off server (and only there).
Files: continuations/<config>__<scenario>.jsonl, one line per answer: request_id, phase, start (the first
position scored) and logprobs ([[token id, logprob], ...] per position from start to the answer's end).
"""

from __future__ import annotations

import json
import urllib.error
from pathlib import Path

from kvscope import bounded_http
from kvscope.artifacts import Continuation, Record, Treatment, append_jsonl, read_jsonl
from kvscope.run.records import finite_logprob, read, request_key
from kvscope.runfolder import RunFolder

TOP = 5
ANSWER_BYTES_PER_POSITION = 4096  # a position's top-5 prompt_logprobs take ~500 bytes of JSON


def golden_logprobs(golden: Treatment, prompt_ids: list[int], answer_ids: list[int], start: int
                    ) -> list[list[tuple[int, float]]]:
    """Golden's top-5 (and the answer's own token) at each answer position from `start` on; a logprob that is not
    a finite number is left out (a NaN here would make every near-tie check pass)."""
    base = golden.url
    body = {"model": golden.manifest.served_model_name, "prompt": prompt_ids + answer_ids, "max_tokens": 1,
            "temperature": 0, "prompt_logprobs": TOP}
    size = bounded_http.MAX_BYTES + ANSWER_BYTES_PER_POSITION * (len(prompt_ids) + len(answer_ids))
    answer = bounded_http.fetch(f"{base}/v1/completions", json.dumps(body).encode(), timeout=300, limit=size)
    positions = json.loads(answer)["choices"][0]["prompt_logprobs"]
    return [sorted(((int(tok), alt["logprob"]) for tok, alt in positions[len(prompt_ids) + j].items()
                    if finite_logprob(alt["logprob"]) is not None), key=lambda x: -x[1])
            for j in range(start, len(answer_ids))]


def collect(folder: Path, golden: Treatment, configs: list[str], scenarios: list[str],
            splits: bool = True) -> dict[str, int]:
    """Score every answer that splits from golden's (not with `splits` False: in exact mode a split is a
    failure already), and golden's own answers, with the golden server; returns how many answers each
    config had scored. An answer golden could not score is left out (the fidelity class is then
    `unverified`, never identical)."""
    if not splits:
        configs = [golden.config]
    rf = RunFolder(folder)
    counts: dict[str, int] = {}
    for scenario in scenarios:
        gold = {request_key(r.request_id, r.phase): r for r in _records(folder, golden.config, scenario)
                if r.ok and r.prompt_token_ids and r.output_token_ids}
        for config in configs:
            lines = []
            for rec in _records(folder, config, scenario):
                g = gold.get(request_key(rec.request_id, rec.phase))
                if g is None or not rec.ok or rec.prompt_sha != g.prompt_sha or not rec.output_token_ids:
                    continue
                start = 0 if config == golden.config else first_divergence(
                    g.output_token_ids, rec.output_token_ids)
                if start is None or start >= len(rec.output_token_ids):
                    continue
                try:
                    tops = golden_logprobs(golden, g.prompt_token_ids or [], rec.output_token_ids, start)
                except (urllib.error.URLError, OSError, ValueError, KeyError, IndexError, TypeError):
                    continue
                lines.append(Continuation(request_id=rec.request_id, phase=rec.phase, start=start, logprobs=tops))
            path = rf.continuations(config, scenario)
            path.parent.mkdir(exist_ok=True)
            path.unlink(missing_ok=True)
            append_jsonl(path, lines)
            counts[config] = counts.get(config, 0) + len(lines)
    return counts


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """The first position where two answers' tokens differ; None when they are the same."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _records(folder: Path, config: str, scenario: str) -> list[Record]:
    path = RunFolder(folder).records(config, scenario)
    return read(path) if path.exists() else []


def load(folder: Path, config: str, scenario: str) -> dict[str, tuple[int, list[dict]]]:
    """request key -> (start, golden's alternatives per position from start), as collect() wrote them."""
    path = RunFolder(folder).continuations(config, scenario)
    if not path.exists():
        return {}
    return {request_key(c.request_id, c.phase): (c.start, [{t: lp for t, lp in pos} for pos in c.logprobs])
            for c in read_jsonl(path, Continuation)}
