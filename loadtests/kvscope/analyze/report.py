"""Reports are functions of a run folder's raw records: report.md, CSV tables and PNG plots.

`make report RUN=...` re-runs this with no server. Every number comes from records/*.jsonl, run.json and
status.jsonl; nothing is carried over from the live run. write() reads the folder once (loaded.load), scores
it (analyze, one typed Analysis) and renders that; neither scoring nor rendering reads a file.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import fields
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pandas as pd

from kvscope import files
from kvscope.analyze import fidelity, hitrate, html, overview, plots, provenance, storefaults, verdicts
from kvscope.analyze.escape import Md, md
from kvscope.analyze.loaded import LoadedRun, load
from kvscope.artifacts import (
    Answer,
    Difference,
    LocustPhase,
    RestartPhase,
    RunInfo,
    Scorer,
    StatusRow,
    Treatment,
    Verdict,
    flag_value,
    write_json,
)
from kvscope.config.matrix import ROLE_ORDER
from kvscope.run import metrics
from kvscope.run.records import key_from_server_id
from kvscope.runfolder import RunFolder

SHARED_SHOWN = 12  # requests listed where candidates' hits differ in exact mode
LINK = re.compile(r"https?://[^\s<>`|\\]+")  # an upstream report's address, written as a link


def golden_missing(run: RunInfo, unrecorded: frozenset[tuple[str, str]]) -> list[str]:
    """Why a scenario's answers could not be scored: golden recorded none (an absent or empty file)."""
    why = "the run was interrupted before golden's first answer" if run.interrupted else "golden recorded no answer"
    golden = run.golden().config
    return [f"golden records missing for scenario {scenario}: {why}; fidelity of its treatments not scored"
            for scenario in run.scenarios if (golden, scenario) in unrecorded]


# A percentile needs enough samples to mean something: p90 from 10, p99 from 100 (else it is the maximum).
MIN_SAMPLES = {50: 1, 90: 10, 99: 100}


def _pct(values, q) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if len(values) >= MIN_SAMPLES.get(q, 1) else None


def scorer(loaded: LoadedRun, min_hits: int, max_failed: float) -> Scorer:
    """The scorer, its gate thresholds, and the run's tolerances and what they rest on: the control against
    golden (the direct floor), golden's own answers scored again by golden (the continuation floor), and the
    largest differences behind each."""
    run, recs = loaded.run, loaded.recs
    golden = run.golden().config
    # per scenario column: a repetition or load level sends the same request ids again, in other batches
    columns = [({f"{r.request_id}@{r.phase}": r for r in recs.get((golden, sc), [])},
                [r for s in run.servers if s.role == "control" for r in recs.get((s.config, sc), [])],
                loaded.continuations[golden, sc]) for sc in run.scenarios]
    direct = [d for by_key, control, _ in columns for d in fidelity.direct_noise(by_key, control)]
    cont = [d for by_key, _, calibration in columns for d in fidelity.continuation_noise(by_key, calibration)]
    compared = sum(fidelity.compared(by_key, control) for by_key, control, _ in columns)
    differing = sum(fidelity.differing(by_key, control) for by_key, control, _ in columns)
    tol, source = fidelity.tolerance(fidelity.floor(direct), fidelity.floor(cont), run.golden().manifest.dtype,
                                     exact=run.mode == "exact")
    nonzero = sorted((d for d in direct + cont if d.nats > 0), key=lambda d: -d.nats)
    tier, tier_why = verdicts.tier(run.mode, compared, differing)
    return Scorer(version=fidelity.SCORER_VERSION, min_verified_hits=min_hits, max_failed_share=max_failed,
                  mode=run.mode, direct_noise_nats=fidelity.floor(direct), continuation_noise_nats=fidelity.floor(cont),
                  tolerance_nats=tol.direct, continuation_tolerance_nats=tol.continuation, tie_band_nats=tol.band,
                  source=source, control_answers=sum(len(control) for _, control, _ in columns),
                  control_differing=differing, golden_rescored=sum(len(c) for _, _, c in columns),
                  largest_differences=[Difference(**d._asdict()) for d in nonzero[:5]], tier=tier, tier_why=tier_why)


def tolerance_of(s: Scorer) -> fidelity.Tolerance:
    return fidelity.Tolerance(s.tolerance_nats, s.continuation_tolerance_nats, exact=s.mode == "exact")


def score_run(loaded: LoadedRun, tol: fidelity.Tolerance) -> pd.DataFrame:
    golden, recs = loaded.run.golden().config, loaded.recs
    rows = []
    for (config, scenario), records in recs.items():  # a load sweep's or repeat's column, not the records' name
        rows += [{**row, "scenario": scenario} for row in fidelity.score_all(
            recs[golden, scenario], records, tol, loaded.continuations[config, scenario])]
    return pd.DataFrame(rows, columns=[f.name for f in fields(fidelity.Score)])


def summarize(run: RunInfo, status: list[StatusRow], recs: dict, scores: pd.DataFrame) -> pd.DataFrame:
    servers = {s.config: s for s in run.servers}
    golden = run.golden().config
    deltas = {(row.config, row.scenario): row.metrics_delta() for row in status}
    leaked = {(row.config, row.scenario) for row in status if row.config in servers and row.reset is not None
              and verdicts.reset_leak(row.reset.probe, servers[row.config].manifest.block_size)}
    rows = []
    for (config, scenario), records in recs.items():
        server = servers[config]
        measure = [r for r in records if r.phase == "measure"]
        ok = [r for r in measure if r.ok]
        hit = [r for r in ok if r.cached_tokens]
        miss = [r for r in ok if not r.cached_tokens]
        gold = {r.request_id: r for r in recs[golden, scenario] if r.ok}
        paired = [(gold[r.request_id].ttft_s, r.ttft_s) for r in ok if r.request_id in gold]
        paired_hits = [(gold[r.request_id].ttft_s, r.ttft_s) for r in hit if r.request_id in gold]
        sc = scores[(scores.config == config) & (scores.scenario == scenario) & (scores.phase == "measure")]
        cls = lambda frame, name: int((frame.cls == name).sum()) if len(frame) else 0  # noqa: E731
        hit_sc = sc[sc.cached_tokens.fillna(0) > 0] if len(sc) else sc
        miss_sc = sc[sc.cached_tokens.fillna(0) == 0] if len(sc) else sc
        delta = deltas.get((config, scenario))
        rates = metrics.hit_rates(delta) if delta else {"local": None, "external": None, "overall": None}
        rows.append({
            "config": config, "role": server.role, "scenario": scenario,
            "requests": len(measure), "failed": len(measure) - len(ok),
            "hit_requests": len(hit),
            "n_miss": len(miss), "n_hit": len(hit),
            "ttft_p50_ms_all": _ms(_pct([r.ttft_s for r in ok], 50)),
            "ttft_p50_ms_miss": _ms(_pct([r.ttft_s for r in miss], 50)),
            "ttft_p90_ms_miss": _ms(_pct([r.ttft_s for r in miss], 90)),
            "ttft_p99_ms_miss": _ms(_pct([r.ttft_s for r in miss], 99)),
            "ttft_p50_ms_hit": _ms(_pct([r.ttft_s for r in hit], 50)),
            "ttft_p90_ms_hit": _ms(_pct([r.ttft_s for r in hit], 90)),
            "ttft_p99_ms_hit": _ms(_pct([r.ttft_s for r in hit], 99)),
            "itl_p50_ms": _ms(_pct([x for r in ok for x in r.itl_s], 50)),
            "e2e_p50_ms": _ms(_pct([r.e2e_s for r in ok], 50)),
            "speedup_all": _ratio(paired) if (config, scenario) not in leaked else None,  # a warm "cold" phase
            "speedup_hits": _ratio(paired_hits) if (config, scenario) not in leaked else None,
            "hit_rate_per_request": hitrate.per_request(measure),
            "hit_rate_counters": rates["overall"],
            "hit_rate_counters_local": rates["local"],
            "hit_rate_counters_external": rates["external"],
            "hit_rate_theoretical": hitrate.theoretical(records, server.manifest.kv_capacity_tokens,
                                                        server.manifest.block_size),
            "identical_hit": cls(hit_sc, Answer.IDENTICAL), "benign_hit": cls(hit_sc, Answer.BENIGN),
            "fail_hit": cls(hit_sc, Answer.FAIL),
            "identical_miss": cls(miss_sc, Answer.IDENTICAL), "benign_miss": cls(miss_sc, Answer.BENIGN),
            "fail_miss": cls(miss_sc, Answer.FAIL),
            "unscored": int((~sc.cls.isin(fidelity.SCORED)).sum()) if len(sc) else 0,
            "unverified": cls(sc, Answer.UNVERIFIED),
            "max_dev": sc.max_dev.max() if len(sc) and sc.max_dev.notna().any() else None,
            "degenerate": int(sc.degenerate.sum()) if len(sc) else 0,
            "needle_golden": _share(sc.needle_golden) if len(sc) else None,
            "needle_candidate": _share(sc.needle_candidate) if len(sc) else None,
            "fidelity": _cell_fidelity(sc) if recs[golden, scenario] else "golden missing",
        })
    return pd.DataFrame(rows)


def _cell_fidelity(sc: pd.DataFrame) -> str:
    """One config x scenario at a glance: FAIL, ok (everything scored passed) or what kept it from scoring."""
    if (sc.cls == Answer.FAIL).any():
        return Answer.FAIL
    if not sc.cls.isin(fidelity.SCORED).any():
        return "no data"
    return "ok" if sc.cls.isin(fidelity.SCORED).all() else "partly unscored"


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 2)


def _ratio(pairs) -> float | None:
    """Median golden TTFT over median candidate TTFT on the same requests (>1: the candidate is faster)."""
    pairs = [(g, c) for g, c in pairs if g is not None and c]
    if not pairs:
        return None
    return round(float(np.median([g for g, _ in pairs]) / np.median([c for _, c in pairs])), 2)


def _share(col: pd.Series) -> float | None:
    col = col.dropna()
    return round(float(col.astype(bool).mean()), 3) if len(col) else None


def tiers_served(loaded: LoadedRun, config: str) -> dict[str, dict[str, int]] | None:
    """Request key (verdicts.request_key) -> tier -> blocks it served, from the connector's load logs; None when
    the run kept none."""
    logs = {s: loaded.loads[config, s] for s in loaded.run.scenarios if (config, s) in loaded.loads}
    if not logs:
        return None
    out: dict[str, dict[str, int]] = {}
    for scenario, event in ((s, e) for s, log in logs.items() for e in log):
        tiers = out.setdefault(verdicts.request_key(scenario, key_from_server_id(event.request)), {})
        for tier in ("ram", "disk", "missed"):
            tiers[tier] = tiers.get(tier, 0) + getattr(event, tier)
    return out


def fault_changes(loaded: LoadedRun, config: str) -> dict[str, int] | None:
    """Request key (verdicts.request_key) -> blocks the canary changed, from its fault logs; None when the run
    kept no log."""
    logs = {s: loaded.faults[config, s] for s in loaded.run.scenarios if (config, s) in loaded.faults}
    if not logs:
        return None
    out: dict[str, int] = {}
    for scenario, event in ((s, e) for s, log in logs.items() for e in log):
        key = verdicts.request_key(scenario, key_from_server_id(event.request))
        out[key] = out.get(key, 0) + event.changed + event.inherited
    return out


def served_sources(loaded: LoadedRun, server: Treatment) -> verdicts.TierTokens | None:
    """A config's cached tokens per source over its measure phases, from vLLM's counters."""
    return verdicts.source_tokens([r.metrics_delta() for r in loaded.status if r.config == server.config],
                                  verdicts.offload_tier(server))


def config_verdicts(loaded: LoadedRun, scores: pd.DataFrame, summary: pd.DataFrame, power: pd.DataFrame,
                    min_hits: int, max_failed: float) -> pd.DataFrame:
    """One line per config: its verdict, whether that is what its role expects, why, and its speed-up."""
    run, status, recs = loaded.run, loaded.status, loaded.recs
    reference = {s.config: verdicts.cache_off_problems(s, [r.cached_tokens for sc in run.scenarios
                                                           for r in recs.get((s.config, sc), [])])
                 for s in run.servers if s.role in ("golden", "control")}
    broken = [f"{config} is not cache-off" for config, problems in reference.items() if problems]
    out = []
    for server in run.servers:
        config, role = server.config, server.role
        ran = {row.scenario for row in status if row.config == config} if status else set(run.scenarios)
        verdict, why = verdicts.config_verdict(server, scores, loaded.expected, ran,
                                               reference.get(config, []) if role == "golden" else broken,
                                               min_hits, max_failed,
                                               tiers_served(loaded, config), reset_leaks(server, status),
                                               served_sources(loaded, server))
        as_expected = verdict == verdicts.expected_verdict(role)
        if role == "canary" and verdict == Verdict.FAIL and (
                short := verdicts.power_shortfall(power[power.config == config].iloc[0])):
            as_expected, why = False, short
        if role == "canary" and verdict == Verdict.PASS and not power[power.config == config].affected_hits.sum():
            verdict, as_expected, why = Verdict.UNVERIFIED, False, "not measured: its fault log says it broke no hit"
        part = summary[summary.config == config]
        sc = scores[(scores.config == config) & (scores.phase == "measure")]
        out.append({
            "config": config, "role": role, "verdict": verdict, "as_expected": as_expected, "why": why,
            "fail_requests": int((sc.cls == Answer.FAIL).sum()), "scored": int(sc.cls.isin(fidelity.SCORED).sum()),
            "verified_hits": verdicts.verified_hits(sc),
            "hit_requests": int(part.hit_requests.sum()), "failed_requests": int(part.failed.sum()),
            "max_dev": sc.max_dev.max() if sc.max_dev.notna().any() else None,
        })
    return pd.DataFrame(out)


def reset_leaks(server: Treatment, status: list[StatusRow]) -> list[str]:
    """Each treatment of a config whose reset probe found a tier still serving, as `<scenario>: why`."""
    return [f"{row.scenario}: {leak}" for row in status if row.config == server.config and row.reset is not None
            and (leak := verdicts.reset_leak(row.reset.probe, server.manifest.block_size))]


def probe_lines(run: RunInfo, status: list[StatusRow]) -> list[str]:
    """The reset probe of every treatment: clean, a tier still serving, or why it could not tell."""
    blocks = {s.config: s.manifest.block_size for s in run.servers}
    rows = [r for r in status if r.reset is not None and r.config in blocks]
    if not any(r.reset.probe for r in rows):  # type: ignore[union-attr]
        return []  # a run recorded before reset probes
    clean, out = 0, []
    for r in rows:
        probe = r.reset.probe  # type: ignore[union-attr]
        if leak := verdicts.reset_leak(probe, blocks[r.config]):
            out.append(f"- {md(r.config, True)} x {md(r.scenario, True)}: **{md(leak)}**; its speed figures are "
                       "withheld")
        elif why := verdicts.reset_unverified(probe):
            out.append(f"- {md(r.config, True)} x {md(r.scenario, True)}: reset unverified: {md(why)}")
        else:
            clean += 1
    read = sorted({verdicts.probe_tier(k) for r in rows if r.reset and r.reset.probe
                   for k in (r.reset.probe.counters or {})}
                  | ({verdicts.PROBE_TIERS["usage"]} if any(r.reset and r.reset.probe and r.reset.probe.cached_tokens
                                                             is not None for r in rows) else set()))
    head = (f"Reset probe: after each treatment's reset the warm-up's prompt was sent again; every counter read 0 "
            f"on {clean} of {len(rows)} treatments" + (f" (read: {', '.join(read)})" if read else "") + ".")
    return ["", head, "", *out] if out else ["", head]


def crashed_verdicts(run: RunInfo) -> pd.DataFrame:
    """A row for each config that did not start: it has no answers, and that is a result too."""
    return pd.DataFrame([{"config": c.config, "role": c.role, "verdict": Verdict.CRASHED, "as_expected": False,
                          "why": c.why, "fail_requests": 0, "scored": 0, "verified_hits": 0, "hit_requests": 0,
                          "failed_requests": 0, "max_dev": None} for c in run.crashed])


def _md_table(frame: pd.DataFrame) -> str:
    cols = list(frame.columns)
    lines = ["| " + " | ".join(map(md, cols)) + " |", "|" + "---|" * len(cols)]
    for row in frame.itertuples(index=False):
        lines.append("| " + " | ".join(_cell(v) for v in row) + " |")
    return "\n".join(lines)


def _cell(v) -> str:
    if v is None or (isinstance(v, float) and np.isnan(v)):
        return "–"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return md(v)  # a string from the run folder, or markup the report made (Md)


class Analysis(NamedTuple):
    """Everything a report shows: the run as loaded and what scoring made of it."""

    loaded: LoadedRun
    scorer: Scorer
    scores: pd.DataFrame
    summary: pd.DataFrame
    power: pd.DataFrame
    verdicts: pd.DataFrame
    overview: pd.DataFrame
    slo: dict[str, float] | None = None
    min_hits: int = verdicts.MIN_VERIFIED_HITS


def analyze(loaded: LoadedRun, min_hits: int = verdicts.MIN_VERIFIED_HITS,
            max_failed: float = verdicts.MAX_FAILED_SHARE, slo: dict[str, float] | None = None) -> Analysis:
    """Everything a report shows, from the loaded run alone (no file is read)."""
    run, status, recs = loaded.run, loaded.status, loaded.recs
    scoring = scorer(loaded, min_hits, max_failed)
    scores = score_run(loaded, tolerance_of(scoring))
    summary = summarize(run, status, recs, scores)
    canaries = [s for s in run.servers if s.role == "canary"]
    power = verdicts.power(canaries, scores, {s.config: fault_changes(loaded, s.config) for s in canaries})
    table = config_verdicts(loaded, scores, summary, power, min_hits, max_failed)
    crashed = crashed_verdicts(run)
    if len(crashed):
        table = pd.concat([table, crashed], ignore_index=True)
    return Analysis(loaded, scoring, scores, summary, power, table,
                    overview.table(run, recs, table, summary, power, slo), slo, min_hits)


def write(folder: Path, min_hits: int = verdicts.MIN_VERIFIED_HITS,
          max_failed: float = verdicts.MAX_FAILED_SHARE, slo: dict[str, float] | None = None) -> int:
    """Read the run once, score it and write its report (write_report); the gate's exit code (verdicts.gate)."""
    return write_report(analyze(load(folder), min_hits, max_failed, slo))


def write_report(a: Analysis, out: Path | None = None) -> int:
    """Render an analysis into OUT (by default the folder its run was loaded from): report.md, report.html, the
    CSV tables and the plots, and run.json with the scorer; reads none of the run's files. The report names the
    run's folder wherever it is written. The gate's exit code."""
    run, recs = a.loaded.run, a.loaded.recs
    out = Path(out) if out is not None else a.loaded.folder
    out.mkdir(parents=True, exist_ok=True)
    rf = RunFolder(out)
    tier = overview.tiers(a.loaded.status)
    sweep = overview.sweep(run, recs)
    tables = {"scores": a.scores, "summary": a.summary, "verdicts": a.verdicts, "overview": a.overview,
              "power": a.power, **({"tiers": tier} if len(tier.columns) > 1 else {}),
              **({"sweep": sweep} if len(sweep) else {})}
    for name, frame in tables.items():
        files.replace(rf.table(name), frame.to_csv(index=False))
    present = set(a.summary.config) if len(a.summary) else set()
    pngs = plots.draw(out, {s.config: s.role for s in run.servers if s.config in present}, a.summary, recs, sweep)
    text = markdown(a, pngs, tier)
    files.replace(rf.report_md, text)
    drawn = {name: rf.plot(name.removesuffix(".png")) for name, _ in pngs}
    images = {name: files.read_bytes(path) for name, path in drawn.items()}
    files.replace(rf.report_html, html.render(text, f"kvscope report: run {run.run_id}", images))
    write_json(rf.run_json, run.model_copy(update={"scorer": a.scorer}))
    written = {rf.report_md, rf.run_json, *(rf.table(t) for t in tables), *drawn.values()}
    for stale in set(rf.derived()) - written:  # a table or plot this rendering no longer makes
        stale.unlink()
    return verdicts.gate(a.verdicts)


def rendered_differently(a: Analysis, folder: Path) -> list[str]:
    """The files of FOLDER that rendering the analysis there would change, add or remove (report.md, run.json,
    the tables and plots): a published report that disagrees with the code. Plots are compared as drawn, not
    byte for byte, since one plot renders a pixel apart on different CPUs."""
    with tempfile.TemporaryDirectory() as tmp:
        write_report(a, Path(tmp))
        fresh = {f.name: f.read_bytes() for f in RunFolder(Path(tmp)).derived()}
    held = {f.name: files.read_bytes(f, files.MAX_READ_BYTES) for f in RunFolder(folder).derived()}
    return sorted(name for name in fresh.keys() | held.keys() if not _alike(name, fresh.get(name), held.get(name)))


def _alike(name: str, fresh: bytes | None, held: bytes | None) -> bool:
    """A file as rendered and as held: equal, or for a plot drawn alike (plots.drawn_alike)."""
    if fresh is None or held is None or fresh == held:
        return fresh == held
    return name.endswith(".png") and plots.drawn_alike(fresh, held)


def verdict_tier(a: Analysis) -> dict:
    """The verdict's tier (run.json's scorer) and what it rests on: the tolerance, the canaries' power per fault
    class, and in the statistical tier whether a 1e-3 noise fault may hide under the floor."""
    s = a.scorer
    doc: dict[str, object] = {"tier": s.tier, "why": s.tier_why, "tolerance_nats": s.tolerance_nats,
           "power": verdicts.class_power(a.power)}
    if s.tier == verdicts.STATISTICAL and s.tolerance_nats > 0:  # at 0 (exact mode) nothing hides under it
        hits = pd.concat([verdicts.broken_hits(server.config, a.scores, fault_changes(a.loaded, server.config))[0]
                          for server in a.loaded.run.servers
                          if server.role == "canary" and server.fault == verdicts.NOISE_PROBE]
                         or [a.scores.iloc[:0]])
        hides, why = verdicts.noise_hides(a.power, hits, s.tolerance_nats)
        doc["noise_1e-3"] = {"may_hide": hides, "why": why}
    return doc


def _verdict_tier_lines(a: Analysis) -> list[str]:
    """The verdict's tier; in the statistical tier the power its floor allows per fault class, and whether a
    1e-3 noise fault may hide under it."""
    t, s = verdict_tier(a), a.scorer
    if t["tier"] == verdicts.EXACT:
        return [f"- Verdict tier: **{t['tier']}**: {t['why']}; any difference from golden FAILs."]
    head = (f"- Verdict tier: **{t['tier']}**: {t['why']}; tolerance {s.tolerance_nats:.3g} nat ({s.source})"
            + (": a wrong hit that moves logprobs less passes." if s.tolerance_nats > 0 else "."))
    lines = [head + (" The power this floor allows, per canary fault class (the hits each broke, by its fault log, "
                     "and how many FAILed):" if t["power"] else " No canary ran: the power this floor allows is "
                                                                "not measured.")]
    lines += [f"  - {md(p['fault'], code=True)}: " + (
        f"caught {p['caught']} of {p['broken']} broken hits (95 % lower bound {p['rate_low95']:.3g})" if p["broken"]
        else "not measured (it broke no hit)") for p in t["power"]]
    if noise := t.get("noise_1e-3"):
        lines.append(f"- **A 1e-3 noise fault may hide under this floor**: {noise['why']}." if noise["may_hide"]
                     else f"- A 1e-3 noise fault shows above this floor: {noise['why']}.")
    return lines


def console(a: Analysis) -> str:
    """The verdicts and the detection power, as plain text for the terminal."""
    run, power = a.loaded.run, a.power
    lines = [f"{Verdict.INCOMPLETE} RUN: stopped early ({run.interrupted})"] if run.interrupted else []
    lines += golden_missing(run, a.loaded.unrecorded)
    lines += [f"{r.config:<20} {r.role:<9} {r.verdict + ('' if r.as_expected else ' (unexpected)'):<24} {r.why}"
              for r in a.verdicts.itertuples()]
    lines.append(f"verdict tier: {a.scorer.tier} ({a.scorer.tier_why})")
    if len(power):
        lines += ["", "detection power (wrong KV served by each canary treatment, caught):"]
        lines += [f"  {r.fault:<12} {r.detected:>4} of {r.affected_hits:<4} hits it broke  rate {r.rate:.3f} "
                  f"(95 % lower bound {r.rate_low95:.3f})" for r in power.itertuples() if r.affected_hits]
        lines += [f"  {r.fault:<12} broke no hit" for r in power.itertuples() if not r.affected_hits]
        lines.append(f"  all faults: {verdicts.pooled(power)}")
    return "\n".join(lines)


def as_json(a: Analysis, code: int) -> str:
    """The verdicts, the detection power and the gate, as one JSON document."""
    run = a.loaded.run
    doc = {"run": str(a.loaded.folder), "gate": {"exit": code, "words": GATE_WORDS[code]},
           "interrupted": run.interrupted, "golden_missing": golden_missing(run, a.loaded.unrecorded),
           "verdicts": json.loads(a.verdicts.to_json(orient="records")),
           "power": json.loads(a.power.to_json(orient="records")), "tier": verdict_tier(a)}
    return json.dumps(doc, indent=1)


GATE_WORDS = {verdicts.GATE_OK: "every verdict as expected (exit 0)",
              verdicts.GATE_FAIL: "FAILED: a verdict its role does not allow (exit 1)",
              verdicts.GATE_INCONCLUSIVE: "inconclusive: nothing failed, but not everything was verified (exit 3)"}


def _slo_words(slo: dict[str, float]) -> str:
    return " and ".join(f"{k.upper()} <= {v * 1000:g} ms" for k, v in slo.items())


def uncontrolled(run: RunInfo, status: list[StatusRow]) -> dict[str, str]:
    """Configs with a cache whose reset did not succeed before some treatment, or whose stores are kept
    between treatments (`store_reset: keep`), and why."""
    cached = {s.config for s in run.servers if s.role in ("candidate", "canary")}
    out: dict[str, str] = {
        s.config: Md(f"its stores {md(sorted(s.manifest.stores))} are kept between treatments (`store_reset: keep`), "
                     "so blocks an earlier treatment stored stay there") for s in run.servers
        if s.config in cached and s.manifest.store_reset == "keep" and s.manifest.stores}
    for row in status:
        if row.config not in cached or row.reset is None:
            continue
        if row.reset.reset_prefix_cache_http != 200:
            out[row.config] = Md(f"`/reset_prefix_cache` answered {row.reset.reset_prefix_cache_http}")
        elif row.reset.stores_refused:
            out[row.config] = Md(f"its stores {md(row.reset.stores_refused)} lie outside the deployment's stores "
                                 "folder and were not wiped")
    return out


def markdown(a: Analysis, pngs: list[tuple[str, str]], tier: pd.DataFrame) -> str:
    """report.md's text, rendered from the analysis, its plots (file name, caption) and the tier table."""
    run, summary, scores, folder = a.loaded.run, a.summary, a.scores, a.loaded.name
    m = run.machine
    first = run.servers[0].manifest
    lines = [f"# kvscope report: run {md(run.run_id)}", ""]
    if run.interrupted:
        lines += [f"**This run is incomplete: it stopped early ({md(run.interrupted)}).** The treatments it finished "
                  "are scored below; continue it with " + md(f"make bench RESUME=1 RUN_ID={run.run_id}", code=True)
                  + ".", ""]
    if missing := golden_missing(run, a.loaded.unrecorded):
        lines += [f"- **{md(note)}**" for note in missing] + [""]
    lines += ["## Summary", "", f"Gate: **{GATE_WORDS[verdicts.gate(a.verdicts)]}**.", "",
              f"Verdict tier: **{a.scorer.tier}**: {a.scorer.tier_why} (what it rests on: \"How strong the verdict "
              "is\" below).", ""]
    ov = a.overview.copy()
    ov["verdict"] = [Md(f"**{x}**") for x in ov.verdict]
    heads = {"config": "config", "verdict": "verdict", "advice": "advice", "hits": "hits",
             "hit_ttft_p50_ms": "hit TTFT p50 (ms)", "golden_ttft_p50_ms": "golden p50 (ms)",
             "speedup_hits": "speed-up", "speedup_ci95": "95 % CI", "hit_rate": "hit rate",
             "hit_rate_theoretical": "ideal LRU", "requests_per_s": "req/s", "output_tokens_per_s": "tokens/s",
             "tpot_p50_ms": "TPOT p50 (ms)", "slo_met": "met SLO", "goodput_per_s": "goodput (req/s)",
             "speedup_repeats": "speed-up per repeat"}
    heads = {k: v for k, v in heads.items() if k in ov}
    lines += [_md_table(ov[ov.role != "canary"][list(heads)].rename(columns=heads)), ""]
    if (ov.role == "canary").any():
        lines += ["Canaries: wrong KV served on purpose, one fault class each; the gate expects each to FAIL on "
                  "every hit its fault broke (detection power below).", "",
                  _md_table(ov[ov.role == "canary"][["config", "verdict", "advice", "hits"]]), ""]
    if run.mode == "exact":
        lines += ["**Exact mode**: every server served batch-invariant, which is slower than normal serving, so this "
                  "report gives fidelity only: no speed-up, TTFT or throughput here. Measure speed with the same "
                  "workload in normal mode (without `EXACT=1`); `make compare` of the two runs gives the mode's "
                  "cost.", ""]
        if all(s.manifest.exact_workarounds is not None for s in run.servers):  # recorded since 2026-12-06
            workarounds = sorted({w for s in run.servers for w in s.manifest.exact_workarounds or []})
            lines += [f"Exact mode ran with the workarounds its vLLM needs: {', '.join(workarounds)} (the matrix's "
                      "`platforms.<p>.exact.workarounds`: flags added before the release that fixed each)."
                      if workarounds else "Exact mode ran without workarounds (none listed for this vLLM release).",
                      ""]
    lines += ["`hits`: measured requests that reused cached tokens; TTFT p50 of those hits and of golden's answers "
              "to the same requests; speed-up = golden / config on those requests (above 1: faster), with a 95 % "
              "bootstrap interval; hit rates are token shares, measured per request and for an ideal LRU of the "
              "server's capacity; throughput over the measure phases; TPOT: a request's mean time per output "
              "token after the first" + (f"; SLO: {_slo_words(a.slo)}, goodput = requests/s that met it"
                                         if a.slo else "; `--slo ttft=MS,tpot=MS` adds goodput") +
              " (`overview.csv`).", ""]
    lines += [f"Every figure here is computed from this folder's raw records (`{a.loaded.records_glob}`) by "
              + md(f"make report RUN={folder}", True) + f" (scorer {fidelity.SCORER_VERSION}). Fidelity compares each "
              "answer with "
              "the golden config's answer to the same request (greedy, same seed): token ids, and the top-5 "
              "logprobs wherever the tokens agree; speed-up = golden TTFT p50 / config TTFT p50 on the same "
              "requests (>1 is faster).", ""]
    lines += ["## Verdicts", ""]
    v = a.verdicts.copy()
    v["verdict"] = [Md(f"**{x}**" + ("" if ok else " (unexpected)")) for x, ok in zip(v.verdict, v.as_expected)]
    cols = ["config", "role", "verdict", "why", "verified_hits", "fail_requests", "scored", "max_dev"]
    lines += [_md_table(v[cols]), ""]
    lines += [f"- {md(c.config, code=True)}: **did not start** ({md(c.why)}): {md(c.error, code=True)}"
              for c in run.crashed]
    lines += [f"- {md(config, code=True)}: **cache state not controlled**: its cache was not emptied before every "
              f"treatment ({md(why)}); earlier requests may have warmed it, so its hit rate may exceed a fresh cache's"
              for config, why in uncontrolled(run, a.loaded.status).items()]
    lines += [f"- {md(s.config, code=True)}: upstream reports about this path: " + ", ".join(
        f"<{u}>" if LINK.fullmatch(u) else md(u) for u in s.manifest.upstream) for s in run.servers
              if s.manifest.upstream]
    lines += _tier_lines(a.loaded, a.scores, a.min_hits)
    lines += probe_lines(run, a.loaded.status)
    if len(rot := storefaults.table(a.loaded.status, a.scores)):
        lines += ["", "Store faults at rest (`store_fault` scenarios): every file of the config's stores damaged "
                  "between the prime and the measure phase; the tier must miss and recompute (answers equal "
                  "golden's) or fail the request. `detected`: blocks the tier refused (kvscope's connector counts "
                  "them; – where a tier has no such counter):", "", _md_table(rot), ""]
    lines += ["", "## How strong the verdict is", ""]
    lines += _verdict_tier_lines(a)
    lines += _floor_lines(a.scorer)
    lines += [f"- A PASS needs every expected answer scored and at least {a.min_hits} verified cache hits, and as "
              "many from each tier the config certifies.", ""]
    if len(a.power):
        lines += ["Detection power (`power.csv`): each canary treatment serves wrong KV of one fault class; "
                  "`affected_hits` are the cache hits its fault log says it broke, `detected` those that FAILed; "
                  f"`rate_low95` is the lower bound of the 95 % Wilson interval. Goal: {verdicts.POWER_GOAL:.0%} "
                  "per class. Hits the canary left correct must not FAIL (`unaffected_fail`).", ""]
        lines += [_md_table(a.power.drop(columns=["config"])), "",
                  f"All faults together: {verdicts.pooled(a.power)}.", ""]
    lines += ["## Environment", ""]
    lines += [md(f"- machine: {m.cpu}, {m.cores} cores, {m.memory_gib} GiB, {m.arch}, GPU: {m.gpu or 'none'}; "
                 f"{m.os}"),
              f"- vLLM {md(first.vllm_version)} ({md(first.platform)}), model {md(Path(first.model_path).name, True)} "
              f"(served as {md(first.served_model_name, True)}) sha256 {md(first.model_hash[:16] + '…', True)}, KV "
              f"capacity {first.kv_capacity_tokens} tokens, block {first.block_size} tokens",
              md(f"- server packages: {_packages(first.packages)}; model shape: {_shape(first.model_config_)}"),
              *_serving_path_lines(run.servers),
              *[f"- topology: {t}; the others one unsharded server each" for t in _topologies(run.servers) if t],
              *_kv_sizing_lines(run.servers),
              *_imports(run.servers),
              f"- load: {md(', '.join(f'{k} {v}' for k, v in run.load.model_dump().items()))}; workload digest "
              f"`{a.loaded.workload_digest}`",
              f"- command: {md(run.command, code=True)}", ""]
    lines += ['<details markdown="1"><summary>Server flags per config</summary>', ""]
    lines += ["| config | role | runs as | port | flags | kv-transfer-config |", "|---|---|---|---|---|---|"]
    for s in run.servers:
        args = s.manifest.server_args
        ktc = flag_value(args, "--kv-transfer-config") or "–"  # as served, spelt as given
        skip = {i + 1 for i, a in enumerate(args) if a in ("--model", "--kv-transfer-config")}
        flags = " ".join(a if len(a) <= 60 else f"{a[:40]}…({len(a)} characters)" for i, a in enumerate(args)
                         if i not in skip and a not in ("--model", "--kv-transfer-config"))
        flags = md(flags, code=True) if args else "not known (an endpoint kvscope did not deploy)"
        box, pid = s.manifest.container, s.manifest.pid
        runs_as = f"container {md(box, code=True)}" if box else (f"process {pid}" if pid else "–")
        lines.append(f"| {md(s.config)} | {s.role} | {runs_as} | {s.manifest.port} | {flags} | {md(ktc, code=True)} |")
    lines += ["", "</details>", "", "## Speed and hit rate per config and scenario", ""]
    lines += ["TTFT in ms; `miss` = requests with no cached tokens (cold), `hit` = requests that reused cached "
              "tokens (warm); `n_*` = how many; p90 needs 10 of them and p99 100 (else `–`). Hit rates are "
              "token shares: per request (server usage), from /metrics counter deltas, and theoretical (the "
              "run's block trace through an LRU of the server's capacity).", ""]
    speed_cols = ["config", "scenario", "requests", "failed", "n_miss", "ttft_p50_ms_miss", "ttft_p90_ms_miss",
                  "ttft_p99_ms_miss", "n_hit", "ttft_p50_ms_hit", "ttft_p90_ms_hit", "ttft_p99_ms_hit", "itl_p50_ms",
                  "e2e_p50_ms", "speedup_hits", "speedup_all"]
    lines += [_md_table(summary[speed_cols]), ""]
    if len(tier.columns) > 1:
        lines += ["Where the prompt tokens came from, and the connector's own counters, over the measure phases "
                  "(vLLM's `prompt_tokens_by_source` and `prompt_tokens_cached_by_source`, `kvscope:connector_*`; "
                  "columns that are zero everywhere are left out):", "", _md_table(tier), ""]
    hit_cols = ["config", "scenario", "hit_rate_per_request", "hit_rate_counters", "hit_rate_counters_local",
                "hit_rate_counters_external", "hit_rate_theoretical"]
    lines += [_md_table(summary[hit_cols]), ""]
    lines += ["## Fidelity per config and scenario", "",
              "Classes split by whether the request hit the cache (fidelity.py says what each means). "
              "`unscored`: failed requests, missing golden answers, inputs that differ from golden's (later turns "
              "after a divergence), answers without token ids, and near ties golden could not score "
              "(`unverified`).", ""]
    fid_cols = ["config", "scenario", "identical_hit", "benign_hit", "fail_hit", "identical_miss", "benign_miss",
                "fail_miss", "unscored", "unverified", "max_dev", "degenerate", "needle_golden", "needle_candidate",
                "fidelity"]
    lines += [_md_table(summary[fid_cols]), ""]
    order = {s.config: ROLE_ORDER[s.role] for s in run.servers}
    fails = scores[(scores.cls == Answer.FAIL) & (scores.phase == "measure")]
    fails = fails.iloc[fails.config.map(order).argsort(kind="stable")]
    if len(fails):
        lines += [f"First {Answer.FAIL} reasons (up to 10; candidates before canaries):", ""]
        for r in fails.head(10).itertuples():
            lines.append(f"- {md(r.config, code=True)} / {md(r.request_id, code=True)} (cached {r.cached_tokens}): "
                         f"{md(r.reason)}")
        lines.append("")
    roles = {s.role: s.config for s in run.servers if s.role in ("golden", "control")}
    if run.mode == "exact" and "golden" in roles and (shared := provenance.shared_differences(
            a.loaded.recs, scores, roles["golden"], roles.get("control"),
            [s.config for s in run.servers if s.role == "candidate"])):
        lines += ["Where the candidates' hits differ from golden (exact mode), the candidates that reused as many "
                  "tokens of the request, grouped by bitwise-equal answers (`=` joins, `|` separates): one "
                  "answer from different stores after the same reuse points at the arithmetic after a reuse "
                  "(this stack's batch invariance), unless it is the cache-off control's answer too (said beside "
                  "the group); a store's answer of its own is not isolated by this.", ""]
        lines += [f"- {line}" for line in shared[:SHARED_SHOWN]]
        lines += [f"- and {len(shared) - SHARED_SHOWN} more", ""] if len(shared) > SHARED_SHOWN else [""]
    prov = provenance.table(a.loaded.recs, scores, {s.config: s.manifest.block_size for s in run.servers
                                             if s.role not in ("golden", "canary")})
    if len(prov):
        lines += ["Where the wrong hits' KV came from (provenance.py): each loaded block is named by its prefix "
                  "and was stored by the first request that held it; a passing hit vouches for the blocks it "
                  "loaded. `wrong_in_load`: wrong hits whose every block also served a right answer; "
                  "`suspect_blocks`: blocks only wrong hits loaded; `stored_by`: the requests that stored them.",
                  "", _md_table(prov), ""]
    failed = scores[scores.cls == Answer.FAILED]
    if len(failed):
        lines += ["Failed requests (first error of each config):", ""]
        for config, part in failed.groupby("config"):
            lines.append(f"- {md(config, code=True)}: {len(part)} failed; first: {md(part.reason.iloc[0])}")
        lines.append("")
    faults = [(r, name, p) for r in a.loaded.status for name, p in r.phases.items()
              if isinstance(p, LocustPhase | RestartPhase) and _faulty(p)]
    if faults:
        lines += ["Faults during the run:", ""]
        for r, name, p in faults:
            what = (f"restart exit {p.restart_exit}: {md(' '.join(p.tail))}" if isinstance(p, RestartPhase) else
                    f"locust exit {p.locust_exit}, {md(p.metrics_error or '')} {md(' '.join(p.locust_stderr_tail))}"
                    + (f" server log: {md(p.server_error, code=True)}" if p.server_error else ""))
            lines.append(f"- {md(r.config, code=True)} x {md(r.scenario, code=True)} {md(name)}: {what}")
        lines.append("")
    if a.loaded.duplicates:
        lines += ["Records set aside (`records.request_key` repeated in a treatment's file: the first is scored):", ""]
        lines += [f"- {md(config, code=True)} x {md(scenario, code=True)}: {n} records repeat a request already "
                  "recorded; each request counts once" for (config, scenario), n in a.loaded.duplicates.items()]
        lines.append("")
    if a.loaded.cut_short:
        lines += ["Lines set aside (a last line without its newline: a write cut short by a full disk or a kill; "
                  "what it held counts as not recorded):", ""]
        lines += [f"- {md(name, code=True)}: its last line ({n} bytes) has no newline"
                  for name, n in a.loaded.cut_short.items()]
        lines.append("")
    restarts = [(r, p) for r in a.loaded.status for p in r.phases.values() if isinstance(p, RestartPhase)]
    if restarts:
        lines += ["Restarts between the prime and the measure phase (restart scenarios; hits after them come from "
                  "what the tier kept across the restart): " + ", ".join(
                      f"{md(r.config, code=True)} x {md(r.scenario, code=True)} {p.seconds} s"
                      + ("" if p.restart_exit == 0 else " (failed)") for r, p in restarts), ""]
    lines += ["## Plots", ""]
    for name, caption in pngs:
        lines += [f"![{caption}]({name})", "", f"*{caption}*", ""]
    lines += ["Tables as CSV: `summary.csv`, `verdicts.csv`, `power.csv`, `scores.csv` (one row per request and "
              "config).", ""]
    return "\n".join(lines)


def _faulty(phase: LocustPhase | RestartPhase) -> bool:
    if isinstance(phase, RestartPhase):
        return phase.restart_exit != 0
    return phase.locust_exit not in (0, 1) or bool(phase.metrics_error)


def _tier_lines(loaded: LoadedRun, scores: pd.DataFrame, least: int) -> list[str]:
    """Per config with a cache: the tiers it certifies and the verified hits each served, or why they cannot
    be told apart."""
    out = []
    for s in loaded.run.servers:
        tiers = s.manifest.tiers
        if s.role != "candidate" or not (tiers or "--kv-transfer-config" in s.manifest.server_args):
            continue
        sc = scores[(scores.config == s.config) & (scores.phase == "measure")]
        hits = verdicts.tier_hits(sc, tiers_served(loaded, s.config))
        sources = served_sources(loaded, s)
        if hits is None and tiers and sources and sources.tokens:  # no load log: vLLM's counters, per phase
            got = sources.tokens
            out.append(f"- {md(s.config, code=True)}: cached tokens each tier served, by {sources.by} (over its "
                       "measure phases, not per request): " + ", ".join(
                           f"{md(t)} {got.get(t, 0)}" for t in [*tiers, *sorted(set(got) - set(tiers))]))
            continue
        if hits is None:
            out.append(f"- {md(s.config, code=True)}: " + (f"certifies {md(', '.join(tiers))}, but the run kept no "
                                                            "load log to tell them apart" if tiers else
                                              "tiers not observable per request (no load log; its counters, where "
                                              "vLLM or the connector exports them, are in the tier table below)"))
            continue
        shown = tiers + sorted(t for t in hits if t not in tiers)
        out.append(f"- {md(s.config, code=True)}: verified hits each tier served: " + ", ".join(
            f"{md(t)} {hits.get(t, 0)}" + (" (not exercised)" if t in tiers and hits.get(t, 0) < least else "")
            for t in shown) + (f"; it certifies {md(', '.join(tiers))}" if tiers else ""))
    return out


def _nat(x: float | None) -> str:
    return "not measured" if x is None else f"{x:.3g} nat"


def _floor_lines(floor: Scorer) -> list[str]:
    """The mode, the two floors and the tolerances, and where the largest differences came from."""
    exact = floor.mode == "exact"
    lines = [f"- Mode: **{'exact' if exact else 'normal'}**" + (
        " (every server batch-invariant: a correct cache is bitwise equal to golden; any difference FAILs, and so "
        "does a split)." if exact else " (a correct cache lies within the noise the control measures; `EXACT=1` "
        "serves batch-invariant, where equal means bitwise equal).")]
    lines.append(f"- Direct floor: the control's answers ({floor.control_answers}) differ from golden's by at "
                 f"most **{_nat(floor.direct_noise_nats)}** ({floor.control_differing} of them differ at all). "
                 f"Tolerance: **{floor.tolerance_nats:.3g} nat** ({floor.source}); tie band "
                 f"{floor.tie_band_nats:.3g} nat. `max_dev` above: a config's largest difference from golden.")
    if exact and floor.control_differing:
        lines.append(f"- **Exact mode does not hold on this stack**: {floor.control_differing} of the control's "
                     "answers are not bitwise equal to golden's, so this stack (vLLM build, attention backend, "
                     "flags) is not batch-invariant; the tolerance stays 0, and the FAILs below may be that, not "
                     "wrong KV. The control's verdict fails the gate.")
    lines.append(f"- Continuation floor (after a split, golden scores the answer by prefill): golden's own answers "
                 f"({floor.golden_rescored}) scored so differ from its decoding by at most "
                 f"**{_nat(floor.continuation_noise_nats)}**; tolerance {floor.continuation_tolerance_nats:.3g} "
                 "nat" + (" (unused in exact mode: a split fails)." if exact else "."))
    if floor.largest_differences:
        lines.append("- Largest differences behind the floors: " + "; ".join(
            f"{md(d.pair)}, {md(d.request, code=True)} token {d.position}: {d.nats:.3g} nat"
            for d in floor.largest_differences) + ".")
    return lines


def _serving_path_lines(servers) -> list[str]:
    """Which serving path (SERVING_PATH=, docs/paths.md) each server ran; nothing where none ran one."""
    by_path: dict[str, list[str]] = {}
    for s in servers:
        by_path.setdefault(s.manifest.serving_path or "", []).append(s.config)
    if list(by_path) == [""]:
        return []
    return ["- serving path (docs/paths.md): " + "; ".join(
        (f"{md(path, code=True)} on " if path else "none on ") + ", ".join(md(c, code=True) for c in configs)
        for path, configs in by_path.items())]


def _topologies(servers) -> list[str]:
    """The sharded servers' ranks (a config's `topology`), as one phrase; [""] where none is sharded."""
    return ["; ".join(f"{md(s.config, code=True)} TP{t['tensor_parallel']}·PP{t['pipeline_parallel']}"
                      for s in servers if (t := s.manifest.topology))]


def _kv_sizing_lines(servers) -> list[str]:
    """Which servers vLLM's extensible KV cache sized (0.34+); nothing where no server reports it."""
    on = [md(s.config, code=True) for s in servers if s.manifest.extensible_kv_cache]
    off = [md(s.config, code=True) for s in servers if s.manifest.extensible_kv_cache is False]
    if not on and not off:
        return []
    return ["- KV cache sized by vLLM's extensible KV cache (after warm-up) on " + (", ".join(on) or "none")
            + "; by its profile or `--kv-cache-memory-bytes` on " + (", ".join(off) or "none")]


def _imports(servers) -> list[str]:
    """One line per distinct set of connector modules and how each imported in the server's environment; a
    compiled extension that failed sends LMCache to a fallback path, which only its log would show."""
    groups: dict[str, list[str]] = {}
    for s in servers:
        if s.manifest.connector_imports:
            text = ", ".join(f"{md(m, code=True)} " + ("ok" if why == "ok" else f"**does not import**: {md(why)}")
                             for m, why in s.manifest.connector_imports.items())
            groups.setdefault(text, []).append(s.config)
    return [f"- connector modules of {md(', '.join(configs))}: {text}" for text, configs in groups.items()]


def _packages(packages: dict | None) -> str:
    return ", ".join(f"{k} {v}" for k, v in (packages or {}).items()) or "not recorded"


def _shape(config: dict | None) -> str:
    if not config:
        return "not recorded"
    pattern = _pattern(config)
    return (f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, {config['num_attention_heads']} "
            f"heads / {config['num_key_value_heads']} KV heads x {config.get('head_dim')}, vocab "
            f"{config['vocab_size']}, weights stored as {config.get('torch_dtype')}"
            + (f"; attention: {', '.join(pattern)}" if pattern else ""))


def _pattern(config: dict) -> list[str]:
    """The attention types and layer pattern a manifest recorded (servers.MODEL_KEYS, docs/paths.md's model
    shapes); none for a model without one, as every run recorded before them."""
    parts = []
    if isinstance(types := config.get("layer_types"), list):
        names = [str(t) for t in types]
        parts.append(" : ".join(f"{names.count(kind)} {kind}" for kind in dict.fromkeys(names)) + " layers")
    elif "full_attention_interval" in config:
        parts.append(f"1 full-attention layer in {config['full_attention_interval']}")
    if config.get("use_sliding_window") is False:  # Qwen2's flag: its sliding_window is not applied
        parts.append("no sliding window (use_sliding_window false)")
    elif "sliding_window" in config:
        parts.append(f"sliding window {config['sliding_window']} tokens")
    if "sliding_window_pattern" in config:
        parts.append(f"1 global layer in {config['sliding_window_pattern']}")
    if "kv_lora_rank" in config:
        parts.append(f"MLA (a {config['kv_lora_rank']}-wide latent vector + a {config.get('qk_rope_head_dim')}-wide "
                     "RoPE key a token" + (f", q LoRA rank {config['q_lora_rank']}" if "q_lora_rank" in config else "")
                     + ")")
    if isinstance(quant := config.get("quantization_config"), dict):
        parts.append(f"weights {quant.get('quant_method')} {quant.get('bits')}-bit, groups of "
                     f"{quant.get('group_size')}")
    elif quant is not None:
        parts.append(f"weights {quant}")
    if "num_nextn_predict_layers" in config:
        n = config["num_nextn_predict_layers"]
        parts.append(f"MTP head of {n} layer{'' if n == 1 else 's'}")
    return parts
