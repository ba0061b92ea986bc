"""Output fidelity: every answer against the golden (cache-off) answer to the same request.

Tokens alone are a weak test: a random-weight model's next-token distributions are flat, and wrong KV often
leaves the greedy tokens as they were. So wherever the tokens agree, the top-5 logprobs are compared too
(by token id), against tolerances measured in the run itself (two floors, because two comparisons differ):
- direct: a candidate's decoded logprobs against golden's, as far as a second cache-off server (the
  control) differs from golden; in normal mode also as far as the continuation floor (a hit's cached prefix
  runs another kernel path, which the control does not);
- continuation: after a split, golden's view of the candidate's answer (a prefill of prompt + answer,
  prompt_logprobs: another kernel path than decoding) against the candidate's, as far as golden's own
  answers scored so differ from golden's decoding.
In exact mode (every server batch-invariant, EXACT=1) a correct cache is bitwise equal to golden: the direct
tolerance is 0, whatever the control shows (a control that differs says the stack is not invariant, and the
verdicts say so; the tolerance is never widened), and a split from golden is itself a failure.

Classes, per answer:
- identical: the same token ids as golden, every logprob within the tolerance.
- benign:    the tokens split at a near tie, and the rest of the answer is what golden itself would say
             after that token: golden scored the candidate's answer (prompt + answer, prompt_logprobs; safe
             on a cache-off server) and every candidate logprob is within the continuation tolerance of
             golden's, every candidate token within its tie band (2 x that tolerance) of golden's best.
             Never in exact mode.
- FAIL:      a logprob beyond the tolerance, a split at a clear margin (any split in exact mode), a
             continuation golden finds less likely than its own, a degenerate answer that golden did not give
             ("a a a a"), or a needle that golden found and the candidate lost.
Not scored, and never counted as identical: `failed` (the request failed), `no-golden` (golden's answer is
missing or failed), `input-differs` (the server saw other prompt tokens, e.g. a later turn after an earlier
turn diverged), `no-token-ids` (the server sent no token ids: nothing to compare), `no-logprobs` (equal
tokens, but at some position no logprob to compare: an answer or golden's without logprobs, or no token both
list; equal tokens alone verify nothing), `unverified` (a split at a near tie that golden could not score: no
continuation was recorded).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import NamedTuple

from kvscope.artifacts import Answer, Record
from kvscope.run.continuations import first_divergence
from kvscope.run.records import request_key

SCORER_VERSION = 3
# A correct cache may differ from golden by more than the control did on its answers (another batch mix,
# the cached-prefix kernel path): the tolerance is this multiple of the largest difference measured.
NOISE_FACTOR = 3.0
# The least tolerance, where the run measured exact equality: a few units in the last place of a logprob.
FLOOR_NATS = {"float32": 1e-5, "float16": 1e-3, "bfloat16": 0.0625}
# For runs without a control (recorded before scorer 2): assumed, from the H200 runs of 2026-11-29, where
# correct caches and cache-off servers differed from golden by up to 1.5e-3 (fp32) and 0.92 nat (bf16).
ASSUMED_NATS = {"float32": 2e-3, "float16": 0.1, "bfloat16": 1.0}

# "a a a a": a tail that repeats with a period of at most DEGENERATE_MAX_PERIOD tokens over at least
# DEGENERATE_MIN_SHARE of the answer, for answers of at least DEGENERATE_MIN_TOKENS.
DEGENERATE_MAX_PERIOD = 4
DEGENERATE_MIN_SHARE = 0.5
DEGENERATE_MIN_TOKENS = 8

SCORED = (Answer.IDENTICAL, Answer.BENIGN, Answer.FAIL)
UNSCORED = (Answer.FAILED, Answer.NO_GOLDEN, Answer.INPUT_DIFFERS, Answer.NO_TOKEN_IDS, Answer.NO_LOGPROBS,
            Answer.UNVERIFIED)

Alts = dict  # token (an id; a string in records made before scorer 2) -> logprob, at one position


@dataclass(frozen=True)
class Tolerance:
    """How far an answer may lie from golden's, in nat (module docstring)."""

    direct: float  # a candidate's decoding against golden's
    continuation: float  # golden's prompt_logprobs view of an answer against the candidate's decoding
    exact: bool = False  # bitwise: direct is 0 and a split from golden fails

    @property
    def band(self) -> float:
        """A split at golden margin within this is a near tie (decoding against decoding)."""
        return 2 * self.direct

    @property
    def continuation_band(self) -> float:
        return 2 * self.continuation


class Deviation(NamedTuple):
    """One measured difference behind a noise floor: which servers, which request, where, how much."""

    pair: str  # "control vs golden", or "golden re-scored vs golden"
    request: str  # records.request_key
    position: int | None
    nats: float


@dataclass
class Score:
    config: str
    scenario: str
    phase: str
    request_id: str
    cls: Answer
    first_divergence: int | None
    golden_margin: float | None
    max_dev: float | None  # the largest logprob difference from golden found where they were compared
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


def alts(rec: Record, i: int) -> Alts:
    """The recorded alternatives at position i with a finite logprob; empty past the recorded answer. (One that
    is not a number fails the answer first: `not_a_number`.)"""
    return {tok: lp for tok, lp in rec.top_logprobs[i] if lp is not None} if i < len(rec.top_logprobs) else {}


NOT_A_NUMBER = "a logprob that is not a number"  # a FAIL's reason begins so where not_a_number found one


def not_a_number(rec: Record) -> int | None:
    """The first position at which the server sent a logprob that is not a finite number; None if none."""
    return next((i for i, top in enumerate(rec.top_logprobs) if any(lp is None for _, lp in top)), None)


def deviation(a: Alts, b: Alts) -> float | None:
    """The largest logprob difference between two distributions over the tokens both list. Records made
    before scorer 2 name tokens by their text, which is ambiguous (many byte tokens render as ''): there,
    only the best logprobs are compared (both sides chose the same token id at a compared position)."""
    if not a or not b:
        return None
    if isinstance(next(iter(a)), str):
        return abs(max(a.values()) - max(b.values()))
    shared = a.keys() & b.keys()
    return max(abs(a[t] - b[t]) for t in shared) if shared else None


def max_deviation(pairs) -> tuple[float | None, int | None]:
    """(largest deviation, its position) over (position, alts, alts) triples; None where nothing compared."""
    best, at = None, None
    for i, a, b in pairs:
        d = deviation(a, b)
        if d is not None and (best is None or d > best):
            best, at = d, i
    return best, at


def _margin(a: Alts) -> float | None:
    top = sorted(a.values(), reverse=True)
    return top[0] - top[1] if len(top) >= 2 else None


def _gap(a: Alts, token) -> float | None:
    """How far `token` lies below the best logprob of `a`; None when `a` does not list it."""
    return max(a.values()) - a[token] if token in a else None


def _chosen(rec: Record, i: int):
    """The token chosen at position i, as the record's alternatives name it (an id; the top string before
    scorer 2, whose records named tokens by their text)."""
    a = alts(rec, i)
    tok = rec.output_token_ids[i] if i < len(rec.output_token_ids) else None
    if tok in a or not a:
        return tok
    return max(a, key=lambda t: a[t])


def score(golden: Record | None, cand: Record, tol: Tolerance,
          continuation: tuple[int, list[Alts]] | None = None) -> Score:
    """Classify one answer. `tol`: the run's tolerances. `continuation`: (start, golden's logprobs of the
    candidate's answer position by position from start), when golden scored it."""
    needle = cand.needle
    # cls: classified below
    s = Score(cand.config, cand.scenario, cand.phase, cand.request_id, Answer.FAILED, None, None, None,
              repetition(cand.output_token_ids), is_degenerate(cand.output_token_ids),
              None if needle is None or golden is None else needle in golden.output_text,
              None if needle is None else needle in cand.output_text,
              cand.cached_tokens, cand.prompt_tokens, cand.ttft_s, "")
    if not cand.ok:
        s.cls, s.reason = Answer.FAILED, cand.error or "failed"
        return s
    if golden is None or not golden.ok:
        s.cls, s.reason = Answer.NO_GOLDEN, "golden answer missing or failed"
        return s
    if (p := not_a_number(golden)) is not None:
        s.cls, s.reason = Answer.NO_GOLDEN, f"golden's answer has a logprob that is not a number at token {p}"
        return s
    if golden.prompt_sha and cand.prompt_sha and golden.prompt_sha != cand.prompt_sha:
        s.cls, s.reason = Answer.INPUT_DIFFERS, "the server saw other prompt tokens than golden's"
        return s
    if (p := not_a_number(cand)) is not None:
        s.cls, s.reason = Answer.FAIL, f"{NOT_A_NUMBER} (NaN or infinite) at token {p}"
        return s
    if not cand.output_token_ids or not golden.output_token_ids:
        s.cls, s.reason = Answer.NO_TOKEN_IDS, "no output token ids to compare (the server ignored return_token_ids)"
        return s
    i = first_divergence(golden.output_token_ids, cand.output_token_ids)
    s.first_divergence = i
    n = len(cand.output_token_ids) if i is None else i
    s.max_dev, at = max_deviation((p, alts(golden, p), alts(cand, p)) for p in range(n))
    if s.degenerate and not is_degenerate(golden.output_token_ids):
        s.cls, s.reason = Answer.FAIL, f"degenerate answer (repetition {s.repetition:.2f}); golden's is not"
    elif s.needle_golden and not s.needle_candidate:
        s.cls, s.reason = Answer.FAIL, "golden's answer has the needle fact, the candidate's does not"
    elif s.max_dev is not None and s.max_dev > tol.direct:
        s.cls, s.reason = Answer.FAIL, (
            f"logprob differs by {s.max_dev:.3g} nat at token {at} (exact: bitwise equal expected)" if tol.exact
            else f"logprob off by {s.max_dev:.3g} nat at token {at} (tolerance {tol.direct:.3g})")
    elif i is None:
        s.cls = Answer.IDENTICAL
    elif tol.exact:
        s.golden_margin = _margin(alts(golden, i))
        s.cls, s.reason = Answer.FAIL, f"tokens differ from golden's at token {i} (exact: a correct cache never splits)"
    else:
        tf = continuation[1] if continuation is not None and continuation[0] == i else None
        s.cls, s.reason = _split(golden, cand, i, tol, tf, s)
    if s.cls in (Answer.IDENTICAL, Answer.BENIGN) and (p := _uncompared(golden, cand, n)) is not None:
        s.cls, s.reason = Answer.NO_LOGPROBS, _no_logprobs(golden, cand, p)
    return s


def _uncompared(golden: Record, cand: Record, n: int) -> int | None:
    """The first of the n positions where the tokens agree at which no logprob could be compared with golden's
    (either side lists none, or no token both list); None when every one was compared. Equal tokens alone
    verify nothing: wrong KV often keeps the greedy tokens and moves only the logprobs."""
    return next((p for p in range(n) if deviation(alts(golden, p), alts(cand, p)) is None), None)


def _no_logprobs(golden: Record, cand: Record, p: int) -> str:
    whose = "the answer has" if not cand.top_logprobs else "golden's answer has" if not golden.top_logprobs else ""
    return (f"{whose} no logprobs to compare" if whose else f"no token both answers list at token {p}") + (
        ": equal tokens alone verify nothing")


def _split(golden: Record, cand: Record, i: int, tol: Tolerance, continuation, s: Score) -> tuple[Answer, str]:
    """Class and reason of an answer whose tokens split from golden's at position i."""
    g, c = alts(golden, i), alts(cand, i)
    band = tol.band
    s.golden_margin = _margin(g)
    if s.golden_margin is None or s.golden_margin > band:
        margin = "unknown" if s.golden_margin is None else f"{s.golden_margin:.3g}"
        return Answer.FAIL, f"diverges at token {i}, golden margin {margin} nat (tie band {band:.3g})"
    if i >= len(cand.output_token_ids):  # the answer ended here: its end token is not recorded
        return Answer.UNVERIFIED, (f"the answer ends at token {i}, a near tie of golden's (golden margin "
                                   f"{s.golden_margin:.3g} nat): how far its end lies from golden's token is "
                                   "not recorded")
    if continuation is None:  # only the recorded alternatives can tell
        gaps = [(_gap(g, _chosen(cand, i)), g), (_gap(c, _chosen(golden, i)), c)]
        # a token a side does not list lies at least as far below its best as the last token it lists
        least = [gap if gap is not None else max(a.values()) - min(a.values()) for gap, a in gaps]
        if max(least) > band:
            shown = "/".join(f"{x:.3g}" if gap is not None else f">={x:.3g}" for x, (gap, _) in zip(least, gaps))
            return Answer.FAIL, (f"diverges at token {i}, golden margin {s.golden_margin:.3g} nat, gaps {shown} "
                            f"(tie band {band:.3g})")
        return Answer.UNVERIFIED, f"near tie at token {i} (golden margin {s.golden_margin:.3g} nat); golden did not " \
                             "score the rest of the answer"
    cband = tol.continuation_band
    uncompared = None
    for j, tf in enumerate(continuation, start=i):  # golden's view lists the candidate's own token too
        if j >= len(cand.output_token_ids):
            break
        gap, dev = _gap(tf, cand.output_token_ids[j]), deviation(tf, alts(cand, j))
        if gap is None or gap > cband:
            shown = "unlisted" if gap is None else f"{gap:.3g} nat"
            return Answer.FAIL, (f"near tie at token {i}; token {j} is {shown}"
                                 f" below golden's best for the same text (tie band {cband:.3g})")
        if dev is not None and dev > tol.continuation:
            return Answer.FAIL, (f"near tie at token {i}; logprob off by {dev:.3g} nat at token {j} (tolerance "
                            f"{tol.continuation:.3g})")
        if dev is None and uncompared is None:
            uncompared = j
        s.max_dev = max(s.max_dev or 0.0, dev or 0.0)
    if uncompared is not None:
        return Answer.NO_LOGPROBS, (f"near tie at token {i}; no logprob to compare with golden's view at token "
                                    f"{uncompared}: equal tokens alone verify nothing")
    return Answer.BENIGN, (f"near tie at token {i} (golden margin {s.golden_margin:.3g} nat); "
                           "golden scores the rest alike")


def _against_golden(golden: dict[str, Record], control: list[Record]) -> Iterator[tuple[str, int | None, tuple]]:
    """Each control answer golden also answered: (key, first divergence, (largest difference where the tokens
    agree, its position))."""
    for rec in control:
        key = request_key(rec.request_id, rec.phase)
        gold = golden.get(key)
        if gold is None or not (rec.ok and gold.ok) or rec.prompt_sha != gold.prompt_sha:
            continue
        i = first_divergence(gold.output_token_ids, rec.output_token_ids)
        n = len(rec.output_token_ids) if i is None else i
        yield key, i, max_deviation((p, alts(gold, p), alts(rec, p)) for p in range(n))


def direct_noise(golden: dict[str, Record], control: list[Record]) -> list[Deviation]:
    """Where the control's answers differ from golden's, where the tokens agree (one per answer compared:
    its largest difference); golden keyed by records.request_key."""
    return [Deviation("control vs golden", key, at, dev)
            for key, _, (dev, at) in _against_golden(golden, control) if dev is not None]


def differing(golden: dict[str, Record], control: list[Record]) -> int:
    """How many of the control's answers are not bitwise equal to golden's: other tokens, or other logprobs
    where the tokens agree (a split at token 0 compares no position, and differs all the same)."""
    return sum(i is not None or bool(dev) for _, i, (dev, _) in _against_golden(golden, control))


def compared(golden: dict[str, Record], control: list[Record]) -> int:
    """How many of the control's answers were compared with golden's (both answered the same prompt)."""
    return sum(1 for _ in _against_golden(golden, control))


def continuation_noise(golden: dict[str, Record], calibration: dict[str, tuple[int, list[Alts]]]) -> list[Deviation]:
    """Where golden's own answers, scored again by golden (the prompt_logprobs path continuations use),
    differ from golden's decoding."""
    found = []
    for key, (start, tf) in calibration.items():
        gold = golden.get(key)
        if gold is not None:
            dev, at = max_deviation((start + p, alts(gold, start + p), a) for p, a in enumerate(tf))
            if dev is not None:
                found.append(Deviation("golden re-scored vs golden", key, at, dev))
    return found


def floor(found: list[Deviation]) -> float | None:
    """The largest measured difference; None when nothing was measured. A broken control inflates the
    direct floor: the canaries' detection power then drops, and the gate fails on them (verdicts.py)."""
    return max((d.nats for d in found), default=None)


def tolerance(direct: float | None, continuation: float | None, dtype: str | None,
              exact: bool = False) -> tuple[Tolerance, str]:
    """The run's tolerances and where they came from. Normal mode: the direct tolerance covers both floors,
    since a cache hit runs its prefix through another kernel path than decoding (as the prefill that scores
    golden's answers again does), which a cache-off control never exercises (on the CPU a correct hit lay
    1.2e-5 nat from golden where the control lay 0). Exact mode: direct 0, never widened."""
    dtype = dtype or "float32"
    least = FLOOR_NATS.get(dtype, FLOOR_NATS["float32"])
    assumed = ASSUMED_NATS.get(dtype, ASSUMED_NATS["float32"])
    cont = assumed if continuation is None else max(NOISE_FACTOR * continuation, least)
    if exact:
        return Tolerance(0.0, cont, exact=True), "exact mode: bitwise equal to golden, or FAIL"
    if direct is None:
        return Tolerance(assumed, cont), "assumed (the run has no control)"
    both = max(direct, continuation or 0.0)
    return (Tolerance(max(NOISE_FACTOR * both, least), cont),
            f"{NOISE_FACTOR:g} x the larger floor, {both:.3g} nat (control {direct:.3g}"
            + (f", golden re-scored {continuation:.3g})" if continuation is not None else ")"))


def score_all(golden: list[Record], candidate: list[Record], tol: Tolerance,
              continuations: dict[str, tuple[int, list[Alts]]] | None = None) -> list[dict]:
    """Scores of a config's answers in one scenario; continuations keyed by records.request_key."""
    by_key = {request_key(r.request_id, r.phase): r for r in golden}
    cont = continuations or {}
    return [asdict(score(by_key.get(key := request_key(c.request_id, c.phase)), c, tol, cont.get(key)))
            for c in candidate]
