"""The report's first screen: for each config, is it safe, how much faster, and how sure — in ms, with n and
95 % confidence intervals, and one sentence of advice.

Speed-ups are paired: the same requests' golden TTFT over the config's, on the config's cache hits; the
interval is a percentile bootstrap over those requests (seeded, so a report is reproducible).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from kvscope.artifacts import Record, RunInfo, Verdict

BOOTSTRAP = 2000


def ratio_ci(pairs: list[tuple[float, float]], seed: int = 0) -> tuple[float, float, float] | None:
    """(median golden / median config, 2.5 %, 97.5 %) over resampled request pairs; None without pairs."""
    if not pairs:
        return None
    gold, conf = np.array(pairs).T
    point = float(np.median(gold) / np.median(conf))
    idx = np.random.default_rng(seed).integers(0, len(pairs), size=(BOOTSTRAP, len(pairs)))
    boot = np.median(gold[idx], axis=1) / np.median(conf[idx], axis=1)
    return point, float(np.percentile(boot, 2.5)), float(np.percentile(boot, 97.5))


def throughput(columns: list[list[Record]]) -> tuple[float | None, float | None]:
    """(requests/s, output tokens/s) of answered measure-phase requests, over the span each scenario column (a
    repetition, a load level) ran: between two of them, other servers' treatments ran."""
    done = [[r for r in rs if r.ok and r.phase == "measure" and r.e2e_s is not None] for rs in columns]
    done = [rs for rs in done if rs]
    span = sum(max(r.start_unix_s + (r.e2e_s or 0) for r in rs) - min(r.start_unix_s for r in rs) for rs in done)
    if span <= 0:
        return None, None
    return sum(map(len, done)) / span, sum(len(r.output_token_ids) for rs in done for r in rs) / span


def parse_slo(text: str) -> dict[str, float]:
    """'ttft=500,tpot=50' (ms) -> {"ttft": 0.5, "tpot": 0.05}; only TTFT and TPOT are known."""
    slo = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, _, value = part.partition("=")
        if name not in ("ttft", "tpot") or not value.replace(".", "", 1).isdigit():
            raise ValueError(f"--slo {text!r}: expected ttft=MS,tpot=MS (either or both)")
        slo[name] = float(value) / 1000
    return slo


def columns(recs: dict, config: str) -> list[list[Record]]:
    """A config's records, one list per scenario column."""
    return [rs for (c, _), rs in recs.items() if c == config]


def answered(recs: dict, config: str) -> list[Record]:
    """A config's answered measure-phase requests, over every scenario."""
    return [r for rs in columns(recs, config) for r in rs if r.ok and r.phase == "measure"]


def tpot(r: Record) -> float | None:
    """Time per output token after the first: the mean of a request's inter-token latencies."""
    return float(np.mean(r.itl_s)) if r.itl_s else None


def goodput(records: list[Record], slo: dict[str, float]) -> float | None:
    """Share of answered measure-phase requests that met every objective of `slo`."""
    done = [r for r in records if r.ok and r.phase == "measure"]
    if not done or not slo:
        return None
    met = [r for r in done if (r.ttft_s or 0) <= slo.get("ttft", float("inf"))
           and (tpot(r) or 0) <= slo.get("tpot", float("inf"))]
    return len(met) / len(done)


def _pairs(run: RunInfo, recs: dict, config: str, repeat: int | None = None
           ) -> tuple[list[tuple[float, float]], list[float]]:
    """(golden, config) TTFT pairs on the config's measured cache hits, and those hits' TTFTs (of one repeat,
    or of all)."""
    golden = run.golden().config
    pairs, hits = [], []
    for (c, scenario), records in recs.items():
        if c != config or (repeat is not None and run.scenarios[scenario].repeat != repeat):
            continue
        gold = {r.request_id: r.ttft_s for r in recs.get((golden, scenario), []) if r.ok and r.ttft_s}
        for r in records:
            if r.ok and r.phase == "measure" and r.cached_tokens and r.ttft_s:
                hits.append(r.ttft_s)
                if r.request_id in gold:
                    pairs.append((gold[r.request_id], r.ttft_s))
    return pairs, hits


def advice(v, speed: tuple[float, float, float] | None, detected: str, exact: bool = False) -> str:
    """One sentence a team can act on, from a verdict row and its speed-up on hits (none in exact mode)."""
    if v.verdict == Verdict.PASS and v.role == "candidate":
        if exact:
            return f"safe on {v.verified_hits} verified hits, each bitwise equal to golden's"
        if speed is None:
            return f"safe on {v.verified_hits} verified hits"
        point, low, high = speed
        faster = (f"{point:.1f}x faster on hits" if low > 1 else f"{point:.2f}x on hits, not measurably faster"
                  if high >= 1 else f"{1 / point:.1f}x slower on hits")
        return f"safe on {v.verified_hits} verified hits, {faster}"
    if v.verdict == Verdict.PASS:
        return "within the noise floor, as a second cache-off server should be"
    if v.verdict == Verdict.FAIL and v.role == "canary":
        return f"wrong KV caught: {detected}" if v.as_expected else f"wrong KV missed: {v.why}"
    if v.verdict == Verdict.FAIL:
        return f"unsafe: {v.fail_requests} of {v.scored} scored answers differ from golden's"
    return {Verdict.GOLDEN: "the cache-off reference", Verdict.UNVERIFIED: f"not verified: {v.why}",
            Verdict.INCOMPLETE: f"incomplete: {v.why}",
            Verdict.INVALID: f"invalid reference: {v.why}" if v.role == "golden" else
            f"invalid, speed figures withheld: {v.why}",
            Verdict.CRASHED: f"did not start: {v.why}"}.get(v.verdict, v.why)


def table(run: RunInfo, recs: dict, verdicts: pd.DataFrame, summary: pd.DataFrame, power: pd.DataFrame,
          slo: dict[str, float] | None = None) -> pd.DataFrame:
    """One row per config: verdict, advice, hit TTFT against golden with n and CI, hit rates, throughput,
    TPOT, and with an SLO the share of requests that met it. In exact mode no speed: batch-invariant serving
    is slower than what a team runs (the report says to measure speed in normal mode)."""
    exact = run.mode == "exact"
    rows = []
    for v in verdicts.itertuples():
        pairs, hits = _pairs(run, recs, v.config)
        withheld = exact or (v.verdict == Verdict.INVALID and v.role != "golden")  # a reset that did not reset
        if withheld:
            pairs = []
        speed = ratio_ci(pairs)
        part = summary[summary.config == v.config] if len(summary) else summary
        caught = power[power.config == v.config] if len(power) else power
        detected = (f"{int(caught.detected.iloc[0])} of {int(caught.affected_hits.iloc[0])} hits it broke"
                    if len(caught) else "")
        mine = answered(recs, v.config)
        req_s, tok_s = throughput(columns(recs, v.config)) if not withheld else (None, None)
        tpots = [t for r in mine if (t := tpot(r)) is not None and not withheld]
        met = goodput(mine, slo or {})
        repeats = run.load.repeats
        each: list[float] = []  # the speed-up of each repeat alone
        for r in range(1, repeats + 1) if repeats > 1 else ():
            if (ci := ratio_ci(_pairs(run, recs, v.config, r)[0])) is not None:
                each.append(ci[0])
        rows.append({
            "config": v.config, "role": v.role, "verdict": v.verdict, "advice": advice(v, speed, detected, exact),
            "hits": len(hits),
            "hit_ttft_p50_ms": round(float(np.median(hits)) * 1000, 2) if hits and not withheld else None,
            "golden_ttft_p50_ms": round(float(np.median([g for g, _ in pairs])) * 1000, 2) if pairs else None,
            "speedup_hits": round(speed[0], 2) if speed else None,
            "speedup_ci95": f"{speed[1]:.2f}–{speed[2]:.2f}" if speed else None,
            "hit_rate": _weighted(part, "hit_rate_per_request"),
            "hit_rate_theoretical": _weighted(part, "hit_rate_theoretical"),
            "requests_per_s": round(req_s, 2) if req_s else None,
            "output_tokens_per_s": round(tok_s, 1) if tok_s else None,
            "tpot_p50_ms": round(float(np.median(tpots)) * 1000, 2) if tpots else None,
            **({"speedup_repeats": f"{min(each):.2f}–{max(each):.2f} over {len(each)}" if each else None}
               if repeats > 1 else {}),
            **({"slo_met": round(met, 3) if met is not None else None,
                "goodput_per_s": round(met * req_s, 2) if met is not None and req_s else None} if slo else {}),
        })
    return pd.DataFrame(rows)


def _weighted(part: pd.DataFrame, col: str) -> float | None:
    """A hit rate over every scenario, each weighted by its requests."""
    if not len(part) or col not in part or part[col].isna().all():
        return None
    ok = part[part[col].notna()]
    return round(float((ok[col] * ok.requests).sum() / ok.requests.sum()), 3)


TIER_COLUMNS = {  # counter (summed over a config's measure phases) -> column
    "vllm:prompt_tokens_by_source_total{source=local_compute}": "tokens_computed",
    "vllm:prompt_tokens_by_source_total{source=local_cache_hit}": "tokens_from_prefix_cache",
    "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}": "tokens_from_connector",
    "vllm:prompt_tokens_cached_by_source_total{source=host}": "cached_from_host",
    "vllm:prompt_tokens_cached_by_source_total{source=disk}": "cached_from_disk",
    "vllm:prompt_tokens_cached_by_source_total{source=p2p}": "cached_from_p2p",
    "kvscope:connector_ram_hits_total": "ram_block_hits",
    "kvscope:connector_fs_hits_total": "disk_block_hits",
    "kvscope:connector_misses_total": "block_misses",
    "kvscope:connector_corrupt_total": "corrupt_blocks",
    "kvscope:connector_io_errors_total": "io_errors",
    "kvscope:connector_evictions_total": "evictions",
    "kvscope:connector_save_errors_total": "save_errors",
    "kvscope:connector_saves_skipped_total": "saves_skipped",
    "vllm:num_preemptions_total": "preemptions",
    "vllm:spec_decode_num_draft_tokens_total": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "accepted_draft_tokens",
}


def tiers(status) -> pd.DataFrame:
    """Where each config's prompt tokens came from, and its connector's counters, over its measure phases;
    only the columns some config has a non-zero value in."""
    totals: dict[str, dict[str, float]] = {}
    for row in status:
        delta = row.metrics_delta() or {}
        into = totals.setdefault(row.config, {})
        for key, column in TIER_COLUMNS.items():
            into[column] = into.get(column, 0.0) + delta.get(key, 0.0)
        into["load_s"] = into.get("load_s", 0.0) + delta.get("kvscope:connector_load_seconds_total", 0.0)
        into["load_blocks"] = into.get("load_blocks", 0.0) + sum(
            delta.get(f"kvscope:connector_{k}_total", 0.0) for k in ("ram_hits", "fs_hits"))
    rows = []
    for config, t in totals.items():
        blocks = t.pop("load_blocks")
        load_s = t.pop("load_s")
        rows.append({"config": config, **{k: int(v) for k, v in t.items()},
                     "load_ms_per_block": round(load_s / blocks * 1000, 3) if blocks else None})
    frame = pd.DataFrame(rows)
    if not len(frame):
        return frame
    keep = ["config"] + [c for c in frame.columns[1:] if frame[c].fillna(0).astype(float).any()]
    return frame[keep]


def sweep(run: RunInfo, recs: dict) -> pd.DataFrame:
    """Under a load sweep, each config at each load: throughput and TTFT (all answers, and cache hits)."""
    ran = {label: sc.locust_users or sc.users for label, sc in run.scenarios.items()}  # a scenario's own users win
    levels = sorted({users for users in ran.values() if users})
    if len(levels) < 2:
        return pd.DataFrame()
    rows = []
    for server in run.servers:
        for users in levels:
            level = [rs for (c, label), rs in recs.items() if c == server.config and ran[label] == users]
            done = [r for rs in level for r in rs if r.ok and r.phase == "measure" and r.ttft_s]
            hits = [r.ttft_s for r in done if r.cached_tokens]
            req_s, tok_s = throughput(level)
            rows.append({"config": server.config, "role": server.role, "users": users, "answers": len(done),
                         "requests_per_s": round(req_s, 2) if req_s else None,
                         "output_tokens_per_s": round(tok_s, 1) if tok_s else None,
                         "ttft_p50_ms": round(float(np.median([r.ttft_s for r in done])) * 1000, 2) if done else None,
                         "hit_ttft_p50_ms": round(float(np.median(hits)) * 1000, 2) if hits else None})
    return pd.DataFrame(rows)
