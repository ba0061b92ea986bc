"""A batch's gate: a short, fixed workload against one host's new servers and the golden server, scored by the
bench's own scoring and verdicts (`kvscope bench --report` on two servers). It runs as a child process in a
session of its own (`python -m kvscope.rollout.gate SPEC`), so Ctrl-C reaches the rollout only.

The workload: `gate-repeat`, UCM #867's request sent `repeats` times in a row (a tier that is right on its
first hit and wrong from its second fails here, where a two-request check passes), and `gate-rag`, a small
RAG slice whose queries share a system prompt and documents. The defaults give about 25 cache hits, above the
verdict's 20 verified hits.

The verdict's tier (analyze/verdicts.tier) is recorded per gate; `tier: exact` (--gate-tier exact) fails a gate
whose verdict is statistical: the exact tier needs exact mode and a control bitwise equal to golden, so golden
and the rolled configs must then serve batch-invariant and include a control-role config.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pandas as pd
import yaml

from kvscope.analyze import fidelity, loaded, report, verdicts
from kvscope.artifacts import Answer, Artifact, RunInfo, Treatment, read_json
from kvscope.rollout import report as rollout_report
from kvscope.rollout.record import GateResult, GateTier
from kvscope.run import plan, treatments
from kvscope.run.plan import BenchOptions
from kvscope.runfolder import RunFolder

SCENARIOS = ["gate-repeat", "gate-rag"]


def scenarios(repeats: int, queries: int) -> dict:
    """The gate's scenarios file: fixed, sized by --gate-repeats and --gate-queries."""
    return {"scenarios": [
        {"name": "gate-repeat", "kind": "repeat", "repeats": repeats, "max_tokens": 24,
         "description": "UCM #867's greedy chat request, sent again and again: every send after the first is a hit"},
        {"name": "gate-rag", "kind": "rag", "num_docs": 8, "doc_tokens_median": 120, "docs_per_query": 2,
         "num_queries": queries, "description": "a small RAG slice: a shared system prompt, Zipf-popular documents"},
    ]}


def write_scenarios(path: Path, repeats: int, queries: int) -> None:
    path.write_text(yaml.safe_dump(scenarios(repeats, queries), sort_keys=False))


class GateSpec(Artifact):
    """What the gate's child process runs: servers (golden first), workload, options."""

    results: str  # the folder the gate's run folder goes into
    run_id: str
    scenarios_file: str
    servers: list[Treatment]
    users: int = 2
    timeout_s: float = 600
    min_hits: int = 20
    tier: GateTier = "any"  # the verdict tier the gate requires (--gate-tier)


def run(spec: GateSpec) -> int:
    """Bench the servers, score them, print the verdicts; the gate's exit code (verdicts.gate)."""
    try:
        folder = treatments.run(plan.build(BenchOptions(
            results=Path(spec.results), scenarios_file=Path(spec.scenarios_file), scenarios=SCENARIOS,
            servers=spec.servers, users=str(spec.users), timeout_s=spec.timeout_s, run_id=spec.run_id,
            command="kvscope rollout (gate)")))
    except treatments.Interrupted as exc:
        print(exc, file=sys.stderr)
        return exc.exit_code
    a = report.analyze(loaded.load(folder), spec.min_hits)
    code = report.write_report(a)
    print(report.console(a))
    words = report.GATE_WORDS[code]
    if short := rollout_report.tier_shortfall(spec.tier, a.scorer.tier):  # after a FAIL's own words, if any
        why = f"{short} ({a.scorer.tier_why})"
        words = f"{words}; {why}" if code == verdicts.GATE_FAIL else f"FAILED: {why} (exit {verdicts.GATE_FAIL})"
        code = verdicts.GATE_FAIL
    print(f"report: {RunFolder(folder).report_md}\ngate: {words}")
    return code


def result(host: str, folder: Path, rel: str, code: int, configs: list[str], tier: GateTier = "any") -> GateResult:
    """A finished gate's verdicts, hits and verdict tier, read from its run folder (verdicts.csv, scores.csv,
    run.json's scorer); `tier`: the tier it required."""
    out = GateResult(host=host, folder=rel, exit_code=code, tier_required=tier)
    rf = RunFolder(folder)
    if rf.run_json.exists():
        scorer = read_json(rf.run_json, RunInfo).scorer
        out.tier = scorer.tier if scorer is not None else None
    if rf.table("verdicts").exists():
        v = pd.read_csv(rf.table("verdicts"))
        out.verdicts = dict(zip(v.config, v.verdict))
        out.why = {r.config: str(r.why) for r in v.itertuples()}
        out.verified_hits = int(v[v.config.isin(configs)].verified_hits.sum())
    if rf.table("scores").exists():
        s = pd.read_csv(rf.table("scores"))
        hits = s[s.config.isin(configs) & (s.phase == "measure") & s.cls.isin(fidelity.SCORED)
                 & (s.cached_tokens.fillna(0) > 0)]
        out.hits, out.wrong_hits = len(hits), int((hits.cls == Answer.FAIL).sum())
    return out


def _terminated(signum, frame):
    raise SystemExit(143)


def main(argv: list[str]) -> int:
    signal.signal(signal.SIGTERM, _terminated)
    return run(read_json(Path(argv[0]), GateSpec))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
