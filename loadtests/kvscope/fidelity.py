"""Output fidelity: every candidate answer against the golden (cache-off) answer to the same request.

Classes, per request:
- identical: the same output token ids as golden.
- benign:    the first divergence is at a near tie: each side's chosen token is within the near-tie band of
             the other side's best logprob there (with a band under the top-1/top-2 gap this is vLLM's
             check_logprobs_close rule). The band depends on the served dtype (near_tie_nats).
- FAIL:      any other divergence, a degenerate answer that golden did not give, or a needle that golden
             found and the candidate lost.
Requests that cannot be scored are counted apart, never as identical: `failed` (the request itself
failed), `no-golden` (golden's answer is missing or failed), `input-differs` (the server saw other prompt
tokens, e.g. a later turn after an earlier turn diverged).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .records import Record

# vLLM #5543 measured ~0.06-nat logprob shifts between prefix-hit and recompute on GPU; 0.1 nat covers that
# and is the field guide's design threshold. On CPU fp32 the paths are bit-identical, so a correct cache
# gives `identical` and never needs this allowance.
NEAR_TIE_NATS = 0.1
# bf16 logits carry 8 significant bits: at |logit| 16-32, one step is 0.125 nat, and two runs that round
# each logit one step apart can swap tokens up to two steps apart. On an H200 (2026-11-29, Qwen3-4B shape)
# cache-off misses diverged from the cache-off golden run at 0.125 nat and correct caches at up to 0.25.
NEAR_TIE_NATS_BY_DTYPE = {"bfloat16": 0.25}


def near_tie_nats(dtype: str | None) -> float:
    """The near-tie band for answers served in `dtype` (the --dtype flag; fp32 and fp16 get the default)."""
    return NEAR_TIE_NATS_BY_DTYPE.get(dtype or "", NEAR_TIE_NATS)

# "a a a a": a tail that repeats with a period of at most DEGENERATE_MAX_PERIOD tokens over at least
# DEGENERATE_MIN_SHARE of the answer, for answers of at least DEGENERATE_MIN_TOKENS.
DEGENERATE_MAX_PERIOD = 4
DEGENERATE_MIN_SHARE = 0.5
DEGENERATE_MIN_TOKENS = 8

SCORED = ("identical", "benign", "FAIL")


@dataclass
class Score:
    config: str
    scenario: str
    phase: str
    request_id: str
    cls: str
    first_divergence: int | None
    golden_margin: float | None
    repetition: float
    degenerate: bool
    needle_golden: bool | None
    needle_candidate: bool | None
    cached_tokens: int | None
    prompt_tokens: int | None
    ttft_s: float | None
    reason: str


def repetition(tokens: list[int]) -> float:
    """Share of the answer covered by its longest periodic tail (period <= DEGENERATE_MAX_PERIOD)."""
    if not tokens:
        return 0.0
    best = 0
    for period in range(1, DEGENERATE_MAX_PERIOD + 1):
        run, i = 0, len(tokens) - 1
        while i - period >= 0 and tokens[i] == tokens[i - period]:
            run += 1
            i -= 1
        best = max(best, run + period if run else 0)
    return min(best, len(tokens)) / len(tokens)


def is_degenerate(tokens: list[int]) -> bool:
    return len(tokens) >= DEGENERATE_MIN_TOKENS and repetition(tokens) >= DEGENERATE_MIN_SHARE


def _first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _alts(rec: Record, i: int) -> list[list]:
    """[token, logprob] pairs at position i, best first; empty past the recorded answer."""
    return rec.top_logprobs[i] if i < len(rec.top_logprobs) else []


def _tokens_at(rec: Record, i: int) -> list[str]:
    return [alt[0] for alt in _alts(rec, i)]


def _margin(rec: Record, i: int) -> float | None:
    alts = _alts(rec, i)
    return alts[0][1] - alts[1][1] if len(alts) >= 2 else None


def _gap(rec: Record, i: int, token: str) -> float | None:
    """How far `token` is below `rec`'s best logprob at position i; None when it is not in rec's top list."""
    alts = _alts(rec, i)
    return next((alts[0][1] - lp for tok, lp in alts if tok == token), None)


def score(golden: Record | None, cand: Record, near_tie_nats: float = NEAR_TIE_NATS) -> Score:
    needle = cand.needle
    s = Score(cand.config, cand.scenario, cand.phase, cand.request_id, "", None, None,
              repetition(cand.output_token_ids), is_degenerate(cand.output_token_ids),
              None if needle is None or golden is None else needle in golden.output_text,
              None if needle is None else needle in cand.output_text,
              cand.cached_tokens, cand.prompt_tokens, cand.ttft_s, "")
    if not cand.ok:
        s.cls, s.reason = "failed", cand.error or "failed"
    elif golden is None or not golden.ok:
        s.cls, s.reason = "no-golden", "golden answer missing or failed"
    elif golden.prompt_sha and cand.prompt_sha and golden.prompt_sha != cand.prompt_sha:
        s.cls, s.reason = "input-differs", "the server saw other prompt tokens than golden's"
    elif s.degenerate and not is_degenerate(golden.output_token_ids):
        s.cls, s.reason = "FAIL", f"degenerate answer (repetition {s.repetition:.2f}); golden's is not"
        s.first_divergence = _first_divergence(golden.output_token_ids, cand.output_token_ids)
    elif s.needle_golden and not s.needle_candidate:
        s.cls, s.reason = "FAIL", "golden's answer has the needle fact, the candidate's does not"
        s.first_divergence = _first_divergence(golden.output_token_ids, cand.output_token_ids)
    else:
        i = _first_divergence(golden.output_token_ids, cand.output_token_ids)
        s.first_divergence = i
        if i is None:
            s.cls = "identical"
        else:
            s.golden_margin = _margin(golden, i)
            g_tok, c_tok = _tokens_at(golden, i), _tokens_at(cand, i)
            gaps = (_gap(golden, i, c_tok[0]), _gap(cand, i, g_tok[0])) if g_tok and c_tok else (None, None)
            margin_ok = s.golden_margin is not None and s.golden_margin <= near_tie_nats
            if margin_ok and None not in gaps and max(gaps) <= near_tie_nats:
                s.cls, s.reason = "benign", (f"near tie at token {i} (golden margin {s.golden_margin:.3f}, "
                                             f"gaps {gaps[0]:.3f}/{gaps[1]:.3f} nats)")
            else:
                margin = "unknown" if s.golden_margin is None else f"{s.golden_margin:.3f}"
                s.cls, s.reason = "FAIL", f"diverges at token {i}, golden margin {margin} nats"
    return s


def score_all(golden: list[Record], candidate: list[Record], near_tie_nats: float = NEAR_TIE_NATS) -> list[dict]:
    by_id = {r.request_id: r for r in golden}
    return [asdict(score(by_id.get(c.request_id), c, near_tie_nats)) for c in candidate]


def verdict(classes: list[str]) -> str:
    """PASS when nothing FAILs and something was scored; FAIL on any FAIL; NO-DATA when nothing was scored."""
    if "FAIL" in classes:
        return "FAIL"
    return "PASS" if any(c in SCORED for c in classes) else "NO-DATA"
