"""A tier that served nothing is never evidence, for connectors without a load log (vLLM's offloading, LMCache,
UCM): their tiers are read off vLLM's per-source counter (prompt_tokens_cached_by_source) over the measure
phases. A tier it names with 0 tokens was not exercised; hits filed as external_unspecified, or no such counter,
are not observable, and the config cannot PASS on that tier's behalf."""

from __future__ import annotations

import json

import pytest
from test_report import certify, four, make_run, verdicts

from kvscope.analyze import report

SOURCE = "vllm:prompt_tokens_cached_by_source_total{source=%s}"


def with_counters(run, config: str, delta: dict[str, float] | None):
    """Each config's status row; `config`'s measure phase with these counter deltas."""
    measure = {"locust_exit": 0, "seconds": 1.0, "metrics_delta": delta}
    (run / "status.jsonl").write_text("".join(json.dumps(
        {"config": c, "scenario": "s", "phases": {"measure": measure} if c == config else {}}) + "\n" for c in four()))


def judged(tmp_path, tiers: list[str], delta: dict[str, float], args: list[str] | None = None):
    """A run whose `apc` certifies `tiers`, keeps no load log, has `args` beside its server arguments and these
    counter deltas over its measure phase."""
    run = make_run(tmp_path / "run", four(), status=False)
    certify(run, "apc", tiers)
    doc = json.loads((run / "run.json").read_text())
    next(s for s in doc["servers"] if s["config"] == "apc")["server_args"] += args or []
    (run / "run.json").write_text(json.dumps(doc))
    with_counters(run, "apc", delta)
    return run


@pytest.mark.parametrize("delta,gate,why", [
    ({SOURCE % "host": 256.0, SOURCE % "device": 0.0}, 0,
     "2 verified cache hits (by tier, vLLM's per-source counter: host 256 tokens)"),
    ({SOURCE % "external_unspecified": 256.0}, 3,
     "host hits not observable (its connector reports 256 cached tokens as external_unspecified)"),
    ({SOURCE % "device": 256.0}, 3, "host not exercised (0 cached tokens from it by vLLM's per-source counter)"),
    ({"vllm:prompt_tokens_total": 400.0}, 3,
     "its tiers (host) cannot be observed: no load log kept, and no per-source counter "
     "(vllm:prompt_tokens_cached_by_source)"),
])
def test_a_tier_without_a_load_log_is_judged_by_its_per_source_counter(tmp_path, delta, gate, why):
    run = judged(tmp_path, ["host"], delta)
    assert report.write(run, min_hits=1) == gate
    assert verdicts(run).why["apc"] == why
    if gate == 0:
        assert "- `apc`: cached tokens each tier served, by vLLM's per-source counter (over its measure phases, " \
               "not per request): host 256, device 0" in (run / "report.md").read_text()


CONNECTOR = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"
OFFLOAD = ["--kv-offloading-size=8", "--kv-offloading-backend=native"]


@pytest.mark.parametrize("tiers,args,delta,gate,why", [
    (["host"], OFFLOAD, {CONNECTOR: 256.0}, 0,
     "2 verified cache hits (by tier, vLLM's external_kv_transfer counter of its CPU offload: host 256 tokens)"),
    (["host"], ["--kv_offloading_size", "8"], {CONNECTOR: 0.0}, 3,
     "host not exercised (0 cached tokens from it by vLLM's external_kv_transfer counter of its CPU offload)"),
    # a connector of one certified tier may still hold another in front of it (ucm-pipeline: a RAM cache
    # before its disk store): without vLLM's CPU offload its tokens speak for no tier
    (["disk"], [], {CONNECTOR: 256.0}, 3,
     "its tiers (disk) cannot be observed: no load log kept, and no per-source counter "
     "(vllm:prompt_tokens_cached_by_source)"),
])
def test_without_a_per_source_counter_vllms_cpu_offload_is_judged_by_its_connector_tokens(tmp_path, tiers, args,
                                                                                          delta, gate, why):
    # vLLM 0.28 has no prompt_tokens_cached_by_source: offload-cpu-tier (vLLM's CPU offload, one tier: host)
    # was UNVERIFIED on 78 bitwise hits (H100, 2026-12-07), though every token it gave came from host memory
    run = judged(tmp_path, tiers, delta, args)
    assert report.write(run, min_hits=1) == gate
    assert verdicts(run).why["apc"] == why
    if gate == 0:
        assert "- `apc`: cached tokens each tier served, by vLLM's external_kv_transfer counter of its CPU offload " \
               "(over its measure phases, not per request): host 256" in (run / "report.md").read_text()
