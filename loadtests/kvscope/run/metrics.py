"""Server counters around a phase: /metrics snapshots parsed with prometheus_client, and their deltas.

vLLM's counters are cumulative, so a phase's hit rate is the ratio of deltas taken around it.
"""

from __future__ import annotations

import math

from prometheus_client.parser import text_string_to_metric_families

from kvscope import bounded_http

# Families kept from /metrics (the rest of vLLM's ~60 series stay out of the results).
COUNTERS = (
    "vllm:prefix_cache_queries", "vllm:prefix_cache_hits",
    "vllm:external_prefix_cache_queries", "vllm:external_prefix_cache_hits",
    "vllm:prompt_tokens", "vllm:prompt_tokens_cached",
    "vllm:prompt_tokens_by_source", "vllm:prompt_tokens_cached_by_source", "vllm:num_preemptions",
    "vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens",  # speculative decoding at work
)
HISTOGRAMS = ("vllm:time_to_first_token_seconds",)
GAUGES = ("vllm:kv_cache_usage_perc",)
CONNECTOR_PREFIX = "kvscope:connector_"  # kvscope's connector: hits per tier, corruption, I/O errors, bytes


def _key(name: str, labels: dict[str, str]) -> str:
    kept = {k: v for k, v in labels.items() if k not in ("engine", "model_name")}
    return name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(kept.items())) + "}" if kept else "")


def parse(text: str) -> dict[str, float]:
    """The kept samples of one /metrics page, keyed like `vllm:prefix_cache_hits_total`."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if (family.name in COUNTERS or family.name in HISTOGRAMS or family.name in GAUGES
                or family.name.startswith(CONNECTOR_PREFIX)):
            for s in family.samples:
                if not s.name.endswith("_created"):
                    key = _key(s.name, s.labels)
                    out[key] = out.get(key, 0.0) + s.value
    return out


def scrape(base: str) -> dict[str, float]:
    """The kept samples of `base`/metrics, read now."""
    return parse(bounded_http.fetch(f"{base}/metrics", timeout=30).decode())


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counter and histogram increases over a phase; gauges keep their value at the end."""
    return {k: v if k.split("{")[0] in GAUGES else v - before.get(k, 0.0) for k, v in after.items()}


def hit_rates(d: dict[str, float]) -> dict[str, float | None]:
    """Hit rates of a phase from counter deltas: local prefix cache, connector, and overall cached/prompt."""

    def ratio(num: str, den: str) -> float | None:
        return d.get(num, 0.0) / d[den] if d.get(den) else None

    return {
        "local": ratio("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
        "external": ratio("vllm:external_prefix_cache_hits_total", "vllm:external_prefix_cache_queries_total"),
        "overall": ratio("vllm:prompt_tokens_cached_total", "vllm:prompt_tokens_total"),
    }


def histogram_quantile(d: dict[str, float], name: str, q: float) -> float | None:
    """Prometheus-style quantile (linear within a bucket) from bucket deltas; None with no observations."""
    buckets = sorted(
        ((float(k.split("le=")[1].rstrip("}")), v) for k, v in d.items() if k.startswith(name + "_bucket{")),
        key=lambda b: b[0],
    )
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank, prev_le, prev_count = q * buckets[-1][1], 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return prev_le
            return prev_le + (le - prev_le) * ((rank - prev_count) / (count - prev_count) if count > prev_count else 0)
        prev_le, prev_count = le, count
    return None
