"""The gate: one verdict per config from its scores, its coverage and its role; the canaries' detection power.

Verdicts:
- PASS:       every expected answer is there and scored, none FAILs, and at least `min_hits` of them were
              cache hits that scored identical or benign (verified hits).
- FAIL:       an answer FAILs (fidelity.py).
- INCOMPLETE: answers missing, failed beyond `max_failed` of those expected, a scenario that never ran,
              answers without token ids, without logprobs to compare, or without a golden answer.
- UNVERIFIED: too few verified hits (the cache was never really tested), near ties that golden could not
              score, answers to another prompt than golden's (input-differs), or a golden or control server
              that was not cache-off.
- GOLDEN / INVALID: the reference itself, cache-off (its manifest and every record) or not; any config whose
              reset did not reset (its reset probe found a tier still serving: its figures are withheld).
- CRASHED:    the config did not start.
Expected: candidates and the control PASS; a canary FAILs, and on at least POWER_GOAL of the cache hits it
really broke (its fault log says which). Exit code of the gate: 0 when every verdict is as expected; 1 when
the gate fails (a FAIL where PASS was expected, a canary kvscope misses too often, a crash); 3 when nothing
failed but some verdict is INCOMPLETE, UNVERIFIED or INVALID (inconclusive); 2 is bad input (cli.py).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import pandas as pd

from kvscope.analyze import fidelity
from kvscope.artifacts import Answer, ResetProbe, Treatment, Verdict, VerdictTier
from kvscope.config.matrix import arg_pairs, option_read

MIN_VERIFIED_HITS = 20
MAX_FAILED_SHARE = 0.02
POWER_GOAL = 0.99
GATE_OK, GATE_FAIL, GATE_INCONCLUSIVE = 0, 1, 3
CACHE_ARGS = ("--kv-transfer-config", "--kv-offloading-size", "--enable-prefix-caching")


def cache_off_problems(server: Treatment, cached_tokens: list[int | None]) -> list[str]:
    """Why a golden or control server was not cache-off, from its manifest and its answers ([] if it was)."""
    args = server.manifest.server_args
    problems = []
    if server.manifest.prefix_caching:
        problems.append("its manifest says prefix caching was on")
    problems += [f"it ran with {flag}" for flag in CACHE_ARGS
                 if any(a == flag or a.startswith(flag + "=") for a in args)]  # `--flag V` or `--flag=V`
    hits = sum(1 for c in cached_tokens if c)
    if hits:
        problems.append(f"{hits} of its answers report cached prompt tokens")
    if server.manifest.prefix_caching is None and all(c is None for c in cached_tokens):
        problems.append("nothing shows it cache-off: its /metrics has no vllm:cache_config_info and no answer "
                        "reports cached prompt tokens (vLLM: --enable-prompt-tokens-details)")
    return problems


def wilson_low(k: int, n: int, z: float = 1.96) -> float | None:
    """Lower bound of the 95 % Wilson interval of a rate k/n."""
    if n == 0:
        return None
    p = k / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return (centre - spread) / (1 + z * z / n)


def power(canaries: list[Treatment], scores: pd.DataFrame, changed: dict[str, dict[str, int] | None]) -> pd.DataFrame:
    """Detection power per canary treatment: of the scored cache hits the canary broke, how many FAILed.
    `changed[config]`: request_key -> blocks the canary changed, from its fault log (None: no log, so every
    hit counts as affected). Hits it left correct ("changed" 0) are counted apart: they must not FAIL."""
    rows = []
    for server in canaries:
        config = server.config
        log = changed.get(config)
        affected, unaffected = broken_hits(config, scores, log)
        detected = int((affected.cls == Answer.FAIL).sum())
        n = len(affected)
        rows.append({"fault": server.fault or config, "config": config, "affected_hits": n,
                     "detected": detected, "rate": round(detected / n, 4) if n else None,
                     "rate_low95": round(wilson_low(detected, n) or 0.0, 4) if n else None,
                     "unaffected_hits": len(unaffected), "unaffected_fail": int((unaffected.cls == Answer.FAIL).sum()),
                     "fault_log": "kept" if log is not None else "missing: every hit counted as affected"})
    return pd.DataFrame(rows, columns=["fault", "config", "affected_hits", "detected", "rate", "rate_low95",
                                       "unaffected_hits", "unaffected_fail", "fault_log"])


def request_key(scenario: str, key: str) -> str:
    """A request's key in a connector's logs within its run: the scenario (a repetition's own label: every
    repetition sends the same request ids) and the request key ('<request id>@<phase>')."""
    return f"{scenario}/{key}"


def request_keys(sc: pd.DataFrame) -> pd.Series:
    """request_key of each scored answer."""
    return pd.Series([request_key(s, f"{r}@{p}") for s, r, p in zip(sc.scenario, sc.request_id, sc.phase)],
                     index=sc.index, dtype=object)


def broken_hits(config: str, scores: pd.DataFrame, log: dict[str, int] | None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """A canary treatment's scored cache hits (measure phase): those its fault log says it broke, and those it
    left correct (`log` None: every hit counts as broken)."""
    sc = scores[(scores.config == config) & (scores.phase == "measure") & scores.cls.isin(fidelity.SCORED)
                & (scores.cached_tokens.fillna(0) > 0)]
    keys = request_keys(sc)
    hit = keys.map({k: n > 0 for k, n in log.items()}).fillna(False) if log is not None \
        else pd.Series(True, index=sc.index)
    return sc[hit.astype(bool)], sc[~hit.astype(bool)]


def _verified(sc: pd.DataFrame) -> pd.Series:
    """Which answers are verified hits: cache hits that scored identical or benign."""
    return sc.cls.isin([Answer.IDENTICAL, Answer.BENIGN]) & (sc.cached_tokens.fillna(0) > 0)


def verified_hits(sc: pd.DataFrame) -> int:
    return int(_verified(sc).sum())


def power_shortfall(row) -> str | None:
    """Why a canary treatment's detection rate (a power.csv row) misses POWER_GOAL; None when it does not."""
    if row.affected_hits and row.rate >= POWER_GOAL:
        return None
    return f"detected on {row.detected} of {row.affected_hits} hits it broke (goal {POWER_GOAL:.0%})"


def pooled(power_table: pd.DataFrame) -> str:
    """Every canary treatment together: detected of affected, with the 95 % lower bound."""
    k, n = int(power_table.detected.sum()), int(power_table.affected_hits.sum())
    return f"{k} of {n} broken hits caught" + (f", 95 % lower bound {wilson_low(k, n):.3f}" if n else "")


EXACT: VerdictTier = "exact"
STATISTICAL: VerdictTier = "statistical"
NOISE_PROBE = "noise-1e-3"  # the canary class whose hits say whether a small noise shows above the floor


def tier(mode: str, compared: int, differing: int) -> tuple[VerdictTier, str]:
    """The verdict's tier and why. Exact where the run proves invariance: exact mode, and the control bitwise
    equal to golden on every answer compared (then any difference FAILs). Statistical elsewhere: a correct
    cache is judged within a tolerance, which lets through a wrong hit that moves logprobs less."""
    if mode != "exact":
        return STATISTICAL, "normal mode: nothing proves a correct cache bitwise equal to golden"
    if not compared:
        return STATISTICAL, "exact mode, but no control answer was compared with golden's"
    if differing:
        return STATISTICAL, (f"exact mode, but {differing} of the control's {compared} answers are not bitwise "
                             "equal to golden's")
    return EXACT, f"exact mode, and the control bitwise equal to golden on {compared} of {compared} answers"


def class_power(power_table: pd.DataFrame) -> list[dict]:
    """Per canary fault class (power.csv's rows summed by class): the hits it broke, how many FAILed and the
    95 % lower bound; rate_low95 None where it broke none (not measured, never a power of 1)."""
    out = []
    for fault, rows in power_table.groupby("fault", sort=False):
        k, n = int(rows.detected.sum()), int(rows.affected_hits.sum())
        low = round(wilson_low(k, n) or 0.0, 4) if n else None
        out.append({"fault": fault, "broken": n, "caught": k, "rate_low95": low})
    return out


def noise_hides(power_table: pd.DataFrame, hits: pd.DataFrame, tolerance: float) -> tuple[bool, str]:
    """Whether a 1e-3 noise fault may hide under the floor, and why, from what the canary's NOISE_PROBE hits
    did: not measured, missed, or moving logprobs no more than the tolerance (caught by other signs, if at
    all) says it may. `hits`: the broken NOISE_PROBE hits' scores (max_dev, reason)."""
    power = next((p for p in class_power(power_table) if p["fault"] == NOISE_PROBE), None)
    if power is None or not power["broken"]:
        ran = "no canary treatment of that class ran" if power is None else "its canary broke no hit"
        return True, f"`{NOISE_PROBE}` was not measured ({ran}); the tolerance is {tolerance:.3g} nat"
    k, n, low = power["caught"], power["broken"], power["rate_low95"]
    if k < n:
        return True, (f"the canary's `{NOISE_PROBE}` hits were caught on {k} of {n} (95 % lower bound {low:.3g}); "
                      f"the tolerance is {tolerance:.3g} nat")
    moved = [float(d) for d in hits.max_dev if not pd.isna(d)]
    if within := [d for d in moved if d <= tolerance]:
        return True, (f"{len(within)} of the canary's {n} `{NOISE_PROBE}` hits moved logprobs by no more than the "
                      f"tolerance {tolerance:.3g} nat (as little as {min(within):.3g} nat): caught here by other "
                      "signs (a token split), not by their logprobs")
    moves = (f"moved logprobs by at least {min(moved):.3g} nat, above the tolerance {tolerance:.3g} nat" if moved
             else caught_without_logprobs(hits))
    return False, f"the canary's `{NOISE_PROBE}` hits {moves}; caught {k} of {n} (95 % lower bound {low:.3g})"


def caught_without_logprobs(hits: pd.DataFrame) -> str:
    """How broken hits that moved no compared logprob were caught, each way with its count."""
    nan = hits.reason.fillna("").str.startswith(fidelity.NOT_A_NUMBER)
    split = ~nan & (hits.first_divergence == 0)
    other = hits[~nan & ~split]
    n = len(hits)
    ways = []
    if nan.any():
        ways.append(f"carried a logprob that is not a number ({int(nan.sum())} of {n})")
    if split.any():
        ways.append(f"split from golden's tokens at their first token ({int(split.sum())} of {n}: no logprob to "
                    "compare)")
    if len(other):
        ways.append(f"were caught otherwise ({len(other)} of {n}: {other.reason.iloc[0]})")
    return "; ".join(ways)


# a hit counter of the reset probe -> the tier it speaks for (kvscope's connector counts blocks, the rest tokens)
PROBE_TIERS = {"usage": "the answer's usage (cached_tokens)",
               "vllm:prefix_cache_hits_total": "vLLM's prefix cache",
               "vllm:external_prefix_cache_hits_total": "the KV connector (vLLM's external hits)",
               "vllm:prompt_tokens_cached_total": "vLLM's cached prompt tokens",
               "vllm:prompt_tokens_by_source_total{source=local_cache_hit}": "vLLM's prefix cache (by source)",
               "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}": "the KV connector (by source)",
               "kvscope:connector_ram_hits_total": "kvscope's ram tier",
               "kvscope:connector_fs_hits_total": "kvscope's disk tier"}
BLOCK_COUNTERS = ("kvscope:connector_ram_hits_total", "kvscope:connector_fs_hits_total")


def probe_tier(counter: str) -> str:
    if counter.startswith("vllm:prompt_tokens_cached_by_source_total{source="):
        return f"the {counter.split('=', 1)[1].rstrip('}')} tier (vLLM's cached tokens by source)"
    return PROBE_TIERS.get(counter, counter)


def reset_leak(probe: ResetProbe | None, block_size: int) -> str | None:
    """Why a reset did not reset, from its probe ("reset did not reset: N tokens from <tier>, ..."); None when
    every counter read 0, or nothing could tell (reset_unverified says which)."""
    if probe is None:
        return None
    hits = {"usage": float(probe.cached_tokens or 0)} | {
        k: v * (block_size if k in BLOCK_COUNTERS else 1) for k, v in (probe.counters or {}).items()}
    said = [f"{int(v)} tokens from {probe_tier(k)}" for k, v in hits.items() if v > 0]
    return "reset did not reset: " + ", ".join(said) if said else None


def reset_unverified(probe: ResetProbe | None) -> str | None:
    """Why a reset probe cannot vouch for a reset: no probe, no answer, or no counter at all; else None."""
    if probe is None:
        return "no reset probe (the reset itself failed, or a run recorded before probes)"
    if probe.error:
        return f"the probe got no answer ({probe.error})"
    if probe.cached_tokens is None and not probe.counters:
        return "the server exposes none of the counters the probe reads (no cached_tokens, no /metrics hit counter)"
    return None


def tier_hits(sc: pd.DataFrame, served: dict[str, dict[str, int]] | None) -> dict[str, int] | None:
    """Verified hits per tier: the verified hits that loaded at least one block from it. `served`: request_key
    -> tier -> blocks, from the connector's load log (None: the run kept none)."""
    if served is None:
        return None
    ok = sc[_verified(sc)]
    out: dict[str, int] = {}
    for key in request_keys(ok):
        for tier, blocks in served.get(key, {}).items():
            if blocks > 0 and tier != "missed":
                out[tier] = out.get(tier, 0) + 1
    return out


def tier_shortfall(declared: list[str], hits: dict[str, int] | None, min_hits: int) -> str | None:
    """Why a config cannot PASS on behalf of the tiers it certifies; None when each served min_hits verified
    hits (a tier that served fewer was not exercised: its PASS would claim what nothing tested)."""
    if not declared:
        return None
    if hits is None:
        return f"its tiers ({', '.join(declared)}) cannot be observed: no load log kept"
    short = [t for t in declared if hits.get(t, 0) < min_hits]
    if not short:
        return None
    passed = [t for t in declared if t not in short]
    return (f"{Verdict.PASS} for {', '.join(passed)}; " if passed else "") + "; ".join(
        f"{t} not exercised ({hits.get(t, 0)} verified hits, {min_hits} needed)" for t in short)


SOURCE = "vllm:prompt_tokens_cached_by_source_total{source="  # vLLM's CacheHitSource: device, host, disk, p2p
UNSPECIFIED = "external_unspecified"  # a connector that does not say which of its tiers served
CONNECTOR = "vllm:prompt_tokens_by_source_total{source=external_kv_transfer}"  # every token a connector gave
BY_SOURCE, BY_OFFLOAD = "vLLM's per-source counter", "vLLM's external_kv_transfer counter of its CPU offload"


class TierTokens(NamedTuple):
    """Cached prompt tokens per tier over a config's measure phases, and what counted them."""
    tokens: dict[str, int]
    by: str


def offload_tier(server: Treatment) -> str | None:
    """The one tier vLLM's CPU offload (`--kv-offloading-size`, the OffloadingConnector) serves from, host
    memory, where a config certifies only that tier; None for any other connector (one may hold a tier in front
    of the one it certifies: ucm-pipeline's RAM cache before its disk)."""
    offloads = any(option_read(flag, {"--kv-offloading-size"}) for flag, _ in arg_pairs(server.manifest.server_args)[0])
    return "host" if offloads and server.manifest.tiers == ["host"] else None


def source_tokens(deltas: list[dict[str, float] | None], offload: str | None = None) -> TierTokens | None:
    """Cached prompt tokens per source over a config's measure phases (vLLM's prompt_tokens_cached_by_source):
    empty where its counters were read and have no such counter, None where none were read. Where vLLM has no
    per-source counter (0.26, 0.28), every token vLLM's CPU offload gave (`offload`: offload_tier) is host's."""
    read = [delta for delta in deltas if delta is not None]
    if not read:
        return None
    out: dict[str, int] = {}
    for delta in read:
        for key, value in delta.items():
            if key.startswith(SOURCE):
                source = key[len(SOURCE):].rstrip("}")
                out[source] = out.get(source, 0) + int(value)
    if not out and offload and any(CONNECTOR in delta for delta in read):
        return TierTokens({offload: sum(int(delta.get(CONNECTOR, 0)) for delta in read)}, BY_OFFLOAD)
    return TierTokens(out, BY_SOURCE)


def counter_shortfall(declared: list[str], sources: TierTokens) -> str | None:
    """Without a load log: why a config cannot PASS on behalf of its tiers from vLLM's counters (source_tokens:
    a tier that served 0 tokens was not exercised; hits the connector files as external_unspecified, or no
    counter at all, are not observable); None when each served some. Per phase, not per request: a tier's
    tokens are not tied to the verified hits."""
    if not declared:
        return None
    tokens = sources.tokens
    if not tokens:
        return (f"its tiers ({', '.join(declared)}) cannot be observed: no load log kept, and no per-source "
                "counter (vllm:prompt_tokens_cached_by_source)")
    unspecified = tokens.get(UNSPECIFIED, 0)
    short = [f"{t} hits not observable (its connector reports {unspecified} cached tokens as {UNSPECIFIED})"
             if unspecified else f"{t} not exercised (0 cached tokens from it by {sources.by})"
             for t in declared if tokens.get(t, 0) <= 0]
    if not short:
        return None
    passed = [t for t in declared if tokens.get(t, 0) > 0]
    return (f"{Verdict.PASS} for {', '.join(passed)}; " if passed else "") + "; ".join(short)


def config_verdict(server: Treatment, scores: pd.DataFrame, expected: dict[str, int], ran: set[str],
                   reference_problems: list[str], min_hits: int = MIN_VERIFIED_HITS,
                   max_failed: float = MAX_FAILED_SHARE,
                   served: dict[str, dict[str, int]] | None = None,
                   leaks: list[str] | None = None,
                   sources: TierTokens | None = None) -> tuple[str, str]:
    """(verdict, why) of one config from its measure-phase scores; `expected`: answers per scenario;
    `ran`: the scenarios with a status row; `reference_problems`: why golden or control was not cache-off;
    `served`: which tier served each request's blocks (its connector's load log), for the tiers it certifies;
    `leaks`: its treatments whose reset probe found a tier still serving (reset_leak, with the scenario);
    `sources`: cached tokens per source (source_tokens), for its tiers where no load log was kept."""
    config, role = server.config, server.role
    sc = scores[(scores.config == config) & (scores.phase == "measure")]
    counts = sc.cls.value_counts().to_dict()
    if role == "golden":
        failed = counts.get(Answer.FAILED, 0)
        problems = reference_problems + [f"{failed} failed answers"] * bool(failed) + (leaks or [])
        return (Verdict.INVALID, "; ".join(problems)) if problems else (Verdict.GOLDEN, "cache-off reference")
    if counts.get(Answer.FAIL):
        fails = sc[sc.cls == Answer.FAIL]
        scored = int(sc.cls.isin(fidelity.SCORED).sum())
        why = f"{counts[Answer.FAIL]} of {scored} scored answers; first: {fails.iloc[0].reason}"
        misses = int((fails.cached_tokens.fillna(0) == 0).sum())
        if misses and role in ("candidate", "canary"):
            why += f"; {misses} of them cache misses, which differ from golden without any cached KV"
        return Verdict.FAIL, why
    if leaks:  # a cold phase that was warm: its hit rate, speed-up and misses say nothing
        return Verdict.INVALID, "; ".join(leaks)
    present = sc.groupby("scenario").size().to_dict()
    incomplete = []
    for s, n in expected.items():
        got = present.get(s, 0)
        if s not in ran:  # no status row: stopped before the treatment's end, or never begun
            incomplete.append(f"scenario {s} did not finish: {got} of {n} answers recorded" if got
                              else f"scenario {s} did not run")
        elif got < n:
            incomplete.append(f"{s}: {got} of {n} answers recorded")
    total = sum(expected.values())
    if counts.get(Answer.FAILED, 0) > max_failed * total:
        incomplete.append(f"{counts[Answer.FAILED]} of {total} requests failed (allowed: {max_failed:.0%})")
    incomplete += [f"{counts[c]} answers {c}" for c in (Answer.NO_TOKEN_IDS, Answer.NO_LOGPROBS, Answer.NO_GOLDEN)
                   if counts.get(c)]
    if incomplete:
        return Verdict.INCOMPLETE, "; ".join(incomplete)
    verified = verified_hits(sc)
    hits = tier_hits(sc, served)
    unverified = []
    if role != "control" and verified < min_hits:
        unverified.append(f"{verified} verified cache hits (at least {min_hits} needed)")
    elif short := (tier_shortfall(server.manifest.tiers, hits, min_hits) if hits is not None or sources is None
                   else counter_shortfall(server.manifest.tiers, sources)):
        unverified.append(short)
    if counts.get(Answer.UNVERIFIED):
        unverified.append(f"{counts[Answer.UNVERIFIED]} near ties golden could not score")
    if counts.get(Answer.INPUT_DIFFERS):
        unverified.append(f"{counts[Answer.INPUT_DIFFERS]} answers input-differs (another prompt than golden's: "
                          "a turn after a split)")
    unverified += reference_problems
    if unverified:
        return Verdict.UNVERIFIED, "; ".join(unverified)
    if role == "control":
        return Verdict.PASS, "within the noise floor"
    if hits is None and sources is not None and server.manifest.tiers:
        per_tier = ", ".join(f"{t} {sources.tokens.get(t, 0)} tokens" for t in server.manifest.tiers)
        return Verdict.PASS, f"{verified} verified cache hits (by tier, {sources.by}: {per_tier})"
    per_tier = ", ".join(f"{t} {(hits or {}).get(t, 0)}" for t in server.manifest.tiers)
    return Verdict.PASS, f"{verified} verified cache hits" + (f" (by tier: {per_tier})" if per_tier else "")


def expected_verdict(role: str) -> Verdict:
    return {"golden": Verdict.GOLDEN, "canary": Verdict.FAIL}.get(role, Verdict.PASS)


def gate(verdicts: pd.DataFrame) -> int:
    """The exit code of a run's verdicts (see the module docstring)."""
    bad = verdicts[~verdicts.as_expected]
    if bad.verdict.isin([Verdict.FAIL, Verdict.PASS, Verdict.CRASHED]).any():
        return GATE_FAIL
    return GATE_INCONCLUSIVE if len(bad) else GATE_OK
