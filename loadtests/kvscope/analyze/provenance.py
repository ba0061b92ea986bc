"""Where wrong hits' KV came from: does a fault follow the stored blocks or the load?

A hit loads the first cached_tokens // block_size blocks of its prompt. Each block is named by its chained
hash (its whole prefix), and was first computed, so stored, by the earliest request of the treatment whose
prompt holds it. A hit that passes vouches for every block it loaded: those stored bytes were right when it
loaded them. So a wrong hit whose every block also served a passing hit went wrong in its own load (a
race, a layout, a wrong slot); a wrong hit that loaded blocks no passing hit loaded is consistent with
wrong data at rest. When wrong hits are exactly the ones loading some requests' blocks, and several hits
loaded those blocks, the fault follows the stored data. With no passing hit, the two cannot be told apart.
"""

from __future__ import annotations

from collections import Counter

import pandas as pd

from kvscope.analyze import fidelity
from kvscope.analyze.escape import md
from kvscope.artifacts import Answer, Record

COLUMNS = ["config", "scenario", "hits", "wrong_hits", "wrong_in_load", "suspect_blocks", "stored_by", "reading"]


def treatment(config: str, scenario: str, records: list[Record], scores: pd.DataFrame, block_size: int
              ) -> dict | None:
    """One treatment's row, or None when none of its scored hits is wrong."""
    cls = {r.request_id: r.cls for r in scores.itertuples()
           if r.phase == "measure" and (r.cached_tokens or 0) > 0 and r.cls in fidelity.SCORED}
    trace = sorted((r for r in records if r.ok), key=lambda r: r.start_unix_s)
    stored_by: dict[str, str] = {}
    for r in trace:
        for h in r.prompt_block_hashes:
            stored_by.setdefault(h, r.request_id)
    loaded = {r.request_id: r.prompt_block_hashes[: (r.cached_tokens or 0) // block_size]
              for r in trace if r.phase == "measure" and r.request_id in cls}
    wrong = [rid for rid in loaded if cls[rid] == Answer.FAIL]
    if not wrong:
        return None
    vouched = {h for rid, blocks in loaded.items() if cls[rid] != Answer.FAIL for h in blocks}
    suspect = Counter(h for rid in wrong for h in loaded[rid] if h not in vouched)
    in_load = sum(all(h in vouched for h in loaded[rid]) for rid in wrong)
    # a block its first holder loaded rather than computed was stored before this treatment
    donors = sorted({"an earlier treatment" if h in loaded.get(stored_by[h], ()) else stored_by[h]
                     for h in suspect})
    return {"config": config, "scenario": scenario, "hits": len(loaded), "wrong_hits": len(wrong),
            "wrong_in_load": in_load, "suspect_blocks": len(suspect), "stored_by": _names(donors),
            "reading": reading(len(loaded), len(wrong), in_load, suspect)}


def _names(names: list[str], most: int = 5) -> str:
    return ", ".join(names[:most]) + (f" and {len(names) - most} more" if len(names) > most else "")


def reading(hits: int, wrong: int, in_load: int, suspect: Counter) -> str:
    if wrong == hits:
        return "every hit wrong: stored data and the load cannot be told apart"
    if in_load == wrong:
        return "follows the load: every wrong hit's blocks also served right answers"
    if in_load == 0 and any(n >= 2 for n in suspect.values()):
        return ("follows the stored blocks: the wrong hits are those that loaded these requests' blocks, "
                "which never served a right answer")
    if in_load == 0:
        return "each wrong hit loaded blocks of its own: not enough reuse to tell"
    return f"mixed: {in_load} of {wrong} wrong hits loaded only blocks that served right answers elsewhere"


def table(recs: dict[tuple[str, str], list[Record]], scores: pd.DataFrame, block_sizes: dict[str, int]
          ) -> pd.DataFrame:
    """A row per treatment with a wrong hit, for the configs in block_sizes."""
    rows = []
    for (config, scenario), records in recs.items():
        if config in block_sizes and records:
            part = scores[(scores.config == config) & (scores.scenario == scenario)]
            row = treatment(config, scenario, records, part, block_sizes[config])
            if row:
                rows.append(row)
    return pd.DataFrame(rows, columns=COLUMNS)


def shared_differences(recs: dict[tuple[str, str], list[Record]], scores: pd.DataFrame, golden: str,
                       control: str | None, candidates: list[str]) -> list[str]:
    """Exact mode: each request on which a candidate's hit differs from golden, with the candidates that reused
    as many of its tokens grouped by bitwise-equal answers ("=" joins a group, "|" separates groups; a group
    that gave the cache-off control's answer says so; as markdown, names escaped). The same answer from
    different stores after the same reuse points at the arithmetic after a reuse; a store's answer of its own
    is not isolated by this. Requests where stores agree come first."""
    fails = scores[(scores.cls == Answer.FAIL) & (scores.phase == "measure") & scores.config.isin(candidates)
                   & (scores.cached_tokens.fillna(0) > 0)]
    answers: dict[tuple[str, str], dict[str, Record]] = {}  # by scenario column, as scores name it
    for (config, column), records in recs.items():
        for r in records:
            if r.phase == "measure" and r.ok:
                answers.setdefault((column, r.request_id), {})[config] = r

    def answer(r: Record | None) -> str | None:
        return None if r is None else repr((r.output_token_ids, r.top_logprobs))

    lines: list[tuple[int, str]] = []
    for (scenario, request, cached), _ in fails.groupby(["scenario", "request_id", "cached_tokens"], sort=False):
        served = answers.get((scenario, request), {})
        groups: dict[str, list[str]] = {}
        for config in candidates:
            if (got := served.get(config)) is not None and got.cached_tokens == cached:
                groups.setdefault(answer(got) or "", []).append(config)
        same = groups.pop(answer(served.get(golden)) or "", [])
        if not groups:  # no failing store's answer found beside the score
            continue
        as_control = answer(served.get(control)) if control else None
        text = " | ".join(" = ".join(map(md, g)) + (" (the control's answer)" if key == as_control else "")
                          for key, g in groups.items())
        lines.append((-max(map(len, groups.values())), f"{md(request, code=True)} ({int(cached)} cached tokens): "
                      f"{text}" + (f"; as golden: {md(', '.join(same))}" if same else "")))
    return [line for _, line in sorted(lines, key=lambda pair: pair[0])]
