"""The reset probe: after a treatment's reset, the prompt the server answered just before it (the warm-up's) is
sent again, and every counter kvscope reads must say that nothing of it was reused.

A reset is otherwise judged by its HTTP status alone, and a server may answer 200 while a tier keeps serving
(vllm#57727: the CPU offload tier). analyze/verdicts.reset_leaks reads what the probe recorded.
"""

from __future__ import annotations

import json
import time
import urllib.error

from kvscope import bounded_http
from kvscope.artifacts import ResetProbe, Treatment
from kvscope.run import metrics

PROMPT = "kvscope warm-up " * 40  # the warm-up's prompt: the one the server held just before the reset
# the counters that say a prompt's tokens were reused (by family; their labels, such as a source, are kept)
HIT_COUNTERS = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total",
                "vllm:prompt_tokens_cached_total", "vllm:prompt_tokens_cached_by_source_total",
                "vllm:prompt_tokens_by_source_total{source=local_cache_hit}",
                "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}",
                "kvscope:connector_ram_hits_total", "kvscope:connector_fs_hits_total")
COUNTED = "vllm:prompt_tokens_total"  # the probe's prompt is in the counters once this rose by its length
SETTLE_S = 5.0


def complete(server: Treatment, timeout: float = 300) -> dict:
    """The warm-up request (greedy, 4 tokens), answered; its JSON body."""
    body = json.dumps({"model": server.manifest.served_model_name, "prompt": PROMPT, "max_tokens": 4,
                       "temperature": 0})
    return json.loads(bounded_http.fetch(f"{server.url}/v1/completions", body.encode(), timeout))


def _scrape(base: str) -> dict[str, float] | None:
    try:
        return metrics.scrape(base)
    except (urllib.error.URLError, OSError, ValueError):
        return None


def _hits(sample: dict[str, float]) -> dict[str, float]:
    return {k: v for k, v in sample.items() if k in HIT_COUNTERS or k.split("{")[0] in HIT_COUNTERS}


def reset_probe(server: Treatment) -> ResetProbe:
    """Send the warm-up's prompt again right after the reset; what the answer and /metrics say was reused."""
    before = _scrape(server.url)
    try:
        answer = complete(server)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        return ResetProbe(error=f"{type(exc).__name__}: {exc}"[:300])
    usage = answer.get("usage") or {}
    probe = ResetProbe(cached_tokens=(usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    if before is None:
        return probe
    deadline = time.monotonic() + SETTLE_S
    while (after := _scrape(server.url)) is not None and COUNTED in after and time.monotonic() < deadline and \
            after[COUNTED] - before.get(COUNTED, 0.0) < (usage.get("prompt_tokens") or 0):
        time.sleep(0.1)  # vLLM counts a request's tokens a moment after it answered
    if after is not None:
        probe.counters = _hits(metrics.delta(before, after))
    return probe
