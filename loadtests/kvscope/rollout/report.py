"""A rollout's words: the headline a team publishes ("rolled to 3 of 3 hosts, every gate PASS"; "stopped at host
1 (kvh1): FAIL, 7 of 12 hits wrong, rolled back"), one line per host, and rollout.md, which `kvscope report
results/<rollout-id>` writes from rollout.json alone."""

from __future__ import annotations

from pathlib import Path

from kvscope.artifacts import Verdict
from kvscope.rollout.folder import RolloutFolder
from kvscope.rollout.record import (
    EXIT_BAD_INPUT,
    EXIT_INCONCLUSIVE,
    EXIT_OK,
    EXIT_ROLLBACK_FAILED,
    EXIT_STOPPED,
    Batch,
    GateResult,
    GateTier,
    HostState,
    Rollout,
    load,
    restored,
    serves,
    untouched,
)

ROLLBACK_STATES = ("rolled-back", "rollback-failed", "rolling-back")


def tier_shortfall(required: GateTier, tier: str | None) -> str | None:
    """Why a gate's verdict tier is not the one it requires (--gate-tier); None when it is, or any will do."""
    if required == "any" or tier == required:
        return None
    return f"the {required} verdict tier is required (--gate-tier {required}); this gate's is {tier or 'not recorded'}"


def gate_words(g: GateResult) -> str:
    """'PASS, 25 verified hits', 'FAIL, 7 of 12 hits wrong', 'CRASHED: ...', 'inconclusive: UNVERIFIED (...)'."""
    if g.exit_code == 0:
        return f"{Verdict.PASS}, {g.verified_hits} verified hits" + (f", {g.tier} tier" if g.tier else "")
    bad = {c: v for c, v in g.verdicts.items() if v not in (Verdict.PASS, Verdict.GOLDEN)}
    if Verdict.CRASHED in bad.values():
        crashed = [f"{c} {g.why.get(c, '')}".strip() for c, v in bad.items() if v == Verdict.CRASHED]
        return f"{Verdict.CRASHED}: " + "; ".join(crashed)
    if Verdict.FAIL in bad.values():
        return f"{Verdict.FAIL}, {g.wrong_hits} of {g.hits} hits wrong"
    if g.exit_code == 1 and g.folder and (short := tier_shortfall(g.tier_required, g.tier)):
        return f"{Verdict.FAIL}: {short}"
    if g.exit_code == 3:
        return "inconclusive: " + "; ".join(f"{c} {v} ({g.why.get(c, '')})" for c, v in bad.items())
    return f"gate did not finish (exit {g.exit_code}; {g.folder or 'no run folder'})"


def batch_of(r: Rollout, host: str) -> Batch:
    return next(b for b in r.batches if host in b.hosts)


def _where(r: Rollout, b: Batch) -> str:
    if len(b.hosts) == 1:
        return f"host {r.hosts.index(b.hosts[0]) + 1} ({b.hosts[0]})"
    return f"batch {b.index} ({', '.join(b.hosts)})"


def rolled(r: Rollout) -> list[str]:
    return [h for b in r.batches if b.state == "passed" for h in b.hosts]


def headline(r: Rollout) -> str:
    n, done = len(r.hosts), rolled(r)
    gates = [g for b in r.batches for g in b.gates]
    so_far = f"; rolled to {len(done)} of {n} hosts before it" if done else ""
    if r.outcome == "completed":
        if all(g.exit_code == 0 for g in gates):
            return f"rolled to {len(done)} of {n} hosts, every gate {Verdict.PASS}"
        k = sum(g.exit_code != 0 for g in gates)
        return f"rolled to {len(done)} of {n} hosts; {k} gate(s) inconclusive, continued (--inconclusive continue)"
    stop = next((b for b in r.batches if b.state in ROLLBACK_STATES), None)
    if r.outcome in ("stopped", "rollback-failed") and stop is not None:
        failed = next((g for g in stop.gates if g.exit_code != 0), None)
        words = gate_words(failed) if failed else stop.reason or "?"
        tail = "rolled back" if stop.state == "rolled-back" else "ROLLBACK FAILED"
        return f"stopped at {_where(r, stop)}: {words}, {tail}{so_far}"
    if r.outcome == "stopped" and r.interrupted:
        return f"stopped before changing anything more: {r.interrupted}{so_far}"
    if r.outcome == "interrupted":
        at = next((b for b in r.batches if b.state != "passed"), None)
        where = f" at {_where(r, at)} ({at.state})" if at else ""
        return (f"interrupted{where}: {r.interrupted}; rolled to {len(done)} of {n} hosts so far; re-run with --id "
                f"{r.rollout_id} to resume")
    return f"running; rolled to {len(done)} of {n} hosts so far"


def exit_code(r: Rollout) -> int:
    if r.outcome == "completed":
        return EXIT_OK if all(g.exit_code == 0 for b in r.batches for g in b.gates) else EXIT_INCONCLUSIVE
    if r.outcome == "rollback-failed":
        return EXIT_ROLLBACK_FAILED
    if r.outcome == "stopped":
        return EXIT_STOPPED if any(b.state == "rolled-back" for b in r.batches) else EXIT_BAD_INPUT
    return 130


def _neither(r: Rollout, before: HostState | None, after: HostState | None, now: HostState | None) -> list[str]:
    """The rolled configs a host served before or after the change and now serves in neither version."""
    return [c for c in r.configs if now is not None and now.serving(c) is None
            and ((before is not None and before.serving(c)) or (after is not None and after.serving(c)))]


def host_line(r: Rollout, host: str) -> str:
    b = batch_of(r, host)
    before, after, final = b.before.get(host), b.after.get(host), r.final.get(host)
    gate = next((g for g in b.gates if g.host == host), None)
    if b.state == "passed":
        return f"{host}: rolled: serves {serves(after, r.configs)}; gate {gate_words(gate) if gate else '?'}"
    if b.state in ROLLBACK_STATES:
        back = b.restored.get(host)
        why = f" (gate {gate_words(gate)})" if gate and gate.exit_code != 0 else ""
        if b.state != "rolling-back" and restored(before, back, r.configs):  # as the engine judged the rollback
            return f"{host}: rolled back: serves {serves(back, r.configs)} again, as before{why}"
        now = back or final
        lost = _neither(r, before, after, now)
        return (f"{host}: ROLLBACK {'FAILED' if b.state == 'rollback-failed' else 'NOT FINISHED'}: serves "
                f"{serves(now, r.configs)}; before it served {serves(before, r.configs)}"
                + (f"; it serves neither the old nor the new {', '.join(lost)}" if lost else "")
                + (f"; it may serve neither the old nor the new {', '.join(r.configs)}" if now is None else "")
                + (f"; re-run with --id {r.rollout_id} to finish the rollback" if b.state == "rolling-back" else ""))
    if b.state in ("changing", "gating"):
        lost = _neither(r, before, after, final)
        unknown = f"; it may serve neither the old nor the new {', '.join(r.configs)}" if final is None else ""
        return (f"{host}: INTERRUPTED while {b.state}: serves {serves(final, r.configs)}; before it served "
                f"{serves(before, r.configs)}" + (f"; it serves neither the old nor the new {', '.join(lost)} until "
                                                  "the rollout is resumed" if lost else unknown)
                + f"; re-run with --id {r.rollout_id} to resume")
    initial = r.initial.get(host)
    if untouched(initial, final):
        return f"{host}: untouched: serves {serves(final, r.configs)}, as before (the same processes)"
    if final is None:
        return f"{host}: not rolled (not recorded at the end)"
    return (f"{host}: not rolled, but what it serves changed since the rollout began: {serves(initial, r.configs)} "
            f"-> {serves(final, r.configs)}")


def summary(r: Rollout) -> list[str]:
    return [f"rollout {r.rollout_id}: {headline(r)}"] + [f"  {host_line(r, h)}" for h in r.hosts]


def _steps(b: Batch) -> str:
    return ", ".join(f"{s.name} {s.seconds:.0f} s" + ("" if s.outcome == "ok" else f" ({s.outcome})")
                     for s in b.steps if s.seconds is not None)


def markdown(r: Rollout) -> str:
    lines = [f"# kvscope rollout {r.rollout_id}", "", f"**{headline(r)}**", ""]
    lines += [f"- {host_line(r, h)}" for h in r.hosts]
    lines += ["", "## Plan", "", "| | |", "|---|---|",
              f"| command | `{r.command}` |", f"| inventory | `{r.inventory}`, hosts {', '.join(r.hosts)} |",
              f"| rolled | {', '.join(r.configs)} from `{r.matrix}` (sha256 {r.matrix_sha256[:12]})"
              + (f", image `{r.image}`" if r.image else "") + " |",
              f"| batches | {r.serial} host(s) at a time: " + "; ".join(", ".join(b.hosts) for b in r.batches) + " |",
              f"| gate | golden {r.golden.get('config', '?')} on {r.golden.get('host', '?')}; "
              f"{r.gate.get('repeats')} repeats of UCM #867's request and {r.gate.get('queries')} RAG queries; "
              f"PASS needs {r.gate.get('min_hits')} verified hits; verdict tier: {r.gate.get('tier', 'any')}; "
              f"inconclusive: {r.inconclusive} |",
              f"| started, finished | {r.started}, {r.finished or '-'} |"]
    if r.extra_vars:
        lines.append(f"| extra vars | `{' '.join(r.extra_vars)}` |")
    lines += ["", "## Batches", ""]
    for b in r.batches:
        if b.state == "pending":
            lines += [f"### Batch {b.index}: {', '.join(b.hosts)}: not reached", ""]
            lines += [f"- {host_line(r, h)}" for h in b.hosts] + [""]
            continue
        lines += [f"### Batch {b.index}: {', '.join(b.hosts)}: {b.decision or b.state}", ""]
        if b.reason:
            lines += [f"Why: {b.reason}.", ""]
        lines += ["| host | before | after the change | gate | after the rollback |", "|---|---|---|---|---|"]
        for h in b.hosts:
            g = next((g for g in b.gates if g.host == h), None)
            link = f" ([report]({g.folder}/report.md))" if g and g.folder else ""
            lines.append(f"| {h} | {serves(b.before.get(h), r.configs)} | {serves(b.after.get(h), r.configs)} | "
                         f"{gate_words(g) + link if g else '-'} | "
                         f"{serves(b.restored.get(h), r.configs) if b.restored else '-'} |")
        lines += ["", f"Steps: {_steps(b) or 'none yet'}.", ""]
    return "\n".join(lines) + "\n"


def write(folder: Path, r: Rollout) -> Path:
    out = RolloutFolder(folder).report
    out.write_text(markdown(r))
    return out


def main(folder: Path) -> int:
    """`kvscope report results/<rollout-id>`: rollout.md from rollout.json, the summary, the rollout's exit code."""
    r = load(folder)
    print("\n".join(summary(r)))
    print(f"report: {write(folder, r)}")
    return exit_code(r)
