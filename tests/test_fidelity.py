"""The fidelity scorer on constructed records: logprobs, near ties and their continuations, and the noise floor."""

import pytest

from kvscope.analyze import fidelity
from kvscope.artifacts import Record

TOL = fidelity.Tolerance(1e-4, 1e-4)
EXACT = fidelity.Tolerance(0.0, 1e-4, exact=True)


def tol(nats):
    return fidelity.Tolerance(nats, nats)


def rec(tokens, tops=None, config="c", ok=True, text="", needle=None, prompt_sha="p", cached=64, rid="r"):
    """A record whose alternatives default to the chosen token at -0.1 and token 999 at -3.0."""
    tops = tops or [[[t, -0.1], [999, -3.0]] for t in tokens]
    return Record(config=config, scenario="s", phase="measure", request_id=rid, session_id="s", turn=0,
                  endpoint="chat", start_unix_s=0.0, ok=ok, error=None if ok else "HTTP 500", ttft_s=0.1,
                  output_token_ids=tokens, top_logprobs=tops, output_text=text, needle=needle,
                  prompt_sha=prompt_sha, cached_tokens=cached, prompt_tokens=100)


def shifted(tokens, by):
    """The default alternatives of `tokens`, every logprob moved by `by` nat."""
    return [[[t, -0.1 + by], [999, -3.0 + by]] for t in tokens]


def test_identical_tokens_and_logprobs():
    s = fidelity.score(rec([1, 2, 3], config="golden"), rec([1, 2, 3]), TOL)
    assert s.cls == "identical" and s.first_divergence is None and s.max_dev == 0


def test_logprobs_within_the_tolerance_are_identical_and_beyond_it_fail():
    gold = rec([1, 2, 3])
    assert fidelity.score(gold, rec([1, 2, 3], tops=shifted([1, 2, 3], 0.5 * TOL.direct)), TOL).cls == "identical"
    s = fidelity.score(gold, rec([1, 2, 3], tops=shifted([1, 2, 3], 3 * TOL.direct)), TOL)
    # wrong KV that leaves every greedy token as it was: the case token comparison alone misses
    assert s.cls == "FAIL" and "logprob off by 0.0003 nat at token 0" in s.reason


def test_split_at_a_clear_margin_fails():
    gold = rec([1, 2, 3], tops=[[[1, -0.1]], [[2, -0.2], [9, -2.2]], [[3, -0.1]]])
    cand = rec([1, 9, 3], tops=[[[1, -0.1]], [[9, -0.2], [2, -2.0]], [[3, -0.1]]])
    s = fidelity.score(gold, cand, TOL)
    assert s.cls == "FAIL" and s.first_divergence == 1 and "golden margin 2 nat" in s.reason


NEAR_GOLD = [[[1, -0.1]], [[2, -0.70000], [9, -0.70005]], [[3, -0.1], [7, -2.0]], [[4, -0.1], [8, -2.0]]]
NEAR_CAND = [[[1, -0.1]], [[9, -0.70001], [2, -0.70003]], [[7, -0.3], [3, -2.0]], [[8, -0.3], [4, -2.0]]]


def test_a_near_tie_flip_whose_rest_golden_would_also_say_is_benign():
    gold, cand = rec([1, 2, 3, 4], tops=NEAR_GOLD), rec([1, 9, 7, 8], tops=NEAR_CAND)
    # golden's own logprobs of the candidate's answer from the split on: the same distributions
    continuation = (1, [{9: -0.70001, 2: -0.70003}, {7: -0.3, 3: -2.0}, {8: -0.3, 4: -2.0}])
    s = fidelity.score(gold, cand, TOL, continuation)
    assert s.cls == "benign" and s.first_divergence == 1, s.reason


def test_a_near_tie_flip_followed_by_other_tokens_fails():
    # the real case of rag-zipf-0009-t0 (canary-shift): a tie at token 1, then tokens golden finds unlikely
    gold, cand = rec([1, 2, 3, 4], tops=NEAR_GOLD), rec([1, 9, 7, 8], tops=NEAR_CAND)
    continuation = (1, [{9: -0.70001, 2: -0.70003}, {3: -0.1, 7: -2.5}, {4: -0.1, 8: -2.5}])
    s = fidelity.score(gold, cand, TOL, continuation)
    assert s.cls == "FAIL" and "token 2 is 2.4 nat below golden's best" in s.reason


def test_a_near_tie_flip_whose_continuation_logprobs_drift_fails():
    gold, cand = rec([1, 2, 3, 4], tops=NEAR_GOLD), rec([1, 9, 7, 8], tops=NEAR_CAND)
    continuation = (1, [{9: -0.70001, 2: -0.70003}, {7: -0.3, 3: -2.0}, {8: -0.31, 4: -2.0}])
    s = fidelity.score(gold, cand, TOL, continuation)
    assert s.cls == "FAIL" and "logprob off by 0.01 nat at token 3" in s.reason


def test_records_from_before_token_ids_compare_only_the_chosen_tokens_logprob():
    # by text, '' may name two different tokens: only the best logprobs (the same chosen id) are compared
    gold = rec([1, 2], tops=[[["a", -0.1], ["", -3.0]], [["b", -0.2], ["", -2.2]]])
    cand = rec([1, 2], tops=[[["a", -0.1], ["", -5.0]], [["b", -0.2], ["", -4.2]]])
    assert fidelity.score(gold, cand, tol(1e-4)).cls == "identical"
    cand = rec([1, 2], tops=[[["a", -0.1], ["", -5.0]], [["b", -0.3], ["", -4.2]]])
    assert fidelity.score(gold, cand, tol(1e-4)).cls == "FAIL"


def test_a_near_tie_flip_golden_did_not_score_is_unverified_not_benign():
    s = fidelity.score(rec([1, 2, 3, 4], tops=NEAR_GOLD), rec([1, 9, 7, 8], tops=NEAR_CAND), TOL)
    assert s.cls == "unverified"


def test_ties_are_matched_by_token_id_not_by_text():
    # ids 9 and 11 may both render as '' (byte tokens): by text the candidate's token would be "in" golden's list
    gold = rec([1, 2], tops=[[[1, -0.1]], [[2, -0.70000], [9, -0.70001]]])
    cand = rec([1, 11], tops=[[[1, -0.1]], [[11, -0.70000], [2, -0.70001]]])
    s = fidelity.score(gold, cand, TOL)  # 11 is not among golden's two: at least 1e-05 below its best
    assert s.cls == "unverified"
    far = rec([1, 2], tops=[[[1, -0.1]], [[2, -0.70000], [9, -0.70001], [5, -0.9]]])
    s = fidelity.score(far, cand, TOL)  # at least 0.2 nat below golden's best: beyond the band
    assert s.cls == "FAIL" and "gaps >=0.2/1e-05" in s.reason
    # golden's own view of the answer lists the candidate's token, far below its best
    s = fidelity.score(gold, cand, TOL, (1, [{2: -0.70000, 9: -0.70001, 11: -5.0}]))
    assert s.cls == "FAIL" and "token 1 is 4.3 nat below golden's best" in s.reason


def test_exact_ties_within_the_band():
    gold = rec([1, 2], tops=[[[1, -0.1]], [[2, -1.0], [9, -1.0], [5, -1.0]]])
    cand = rec([1, 5], tops=[[[1, -0.1]], [[5, -1.0], [2, -1.0], [9, -1.0]]])
    assert fidelity.score(gold, cand, TOL, (1, [{2: -1.0, 9: -1.0, 5: -1.0}])).cls == "benign"


def test_answers_without_token_ids_are_not_scored():
    s = fidelity.score(rec([1, 2]), rec([], tops=[]), TOL)
    assert s.cls == "no-token-ids"
    assert fidelity.score(rec([], tops=[]), rec([], tops=[]), TOL).cls == "no-token-ids"


def test_shorter_answer_diverges_at_its_end():
    s = fidelity.score(rec([1, 2, 3]), rec([1, 2]), TOL)
    assert s.cls == "FAIL" and s.first_divergence == 2


def test_degenerate_repetition_is_measured_and_fails():
    a_a_a = [64] * 50  # "a a a a ..." as in UCM #867
    assert fidelity.repetition(a_a_a) == 1.0
    assert fidelity.repetition([5, 6] * 10) == 1.0
    assert fidelity.repetition(list(range(40))) == 0.0
    assert fidelity.is_degenerate(a_a_a) and not fidelity.is_degenerate([7, 7, 7])  # too short to judge
    s = fidelity.score(rec(list(range(50))), rec(a_a_a), TOL)
    assert s.cls == "FAIL" and s.degenerate and "degenerate" in s.reason


def test_degenerate_golden_does_not_blame_the_candidate():
    assert fidelity.score(rec([3] * 20), rec([3] * 20), TOL).cls == "identical"


def test_lost_needle_fails_even_with_identical_tokens():
    gold = rec([1, 2, 3], text="The code is KX1234.", needle="KX1234")
    cand = rec([1, 2, 3], text="The code is KX12", needle="KX1234")
    s = fidelity.score(gold, cand, TOL)
    assert s.cls == "FAIL" and s.needle_golden and not s.needle_candidate


def test_unscorable_requests_are_counted_apart():
    assert fidelity.score(rec([1]), rec([1], ok=False), TOL).cls == "failed"
    assert fidelity.score(None, rec([1]), TOL).cls == "no-golden"
    assert fidelity.score(rec([1], ok=False), rec([1]), TOL).cls == "no-golden"
    assert fidelity.score(rec([1], prompt_sha="a"), rec([1], prompt_sha="b"), TOL).cls == "input-differs"


def test_records_from_before_token_ids_still_score_by_their_token_text():
    gold = rec([1, 2], tops=[[["a", -0.1], ["x", -3.0]], [["b", -0.2], ["c", -2.2]]])
    cand = rec([1, 9], tops=[[["a", -0.1], ["x", -3.0]], [["q", -0.2], ["b", -2.0]]])
    assert fidelity.score(gold, cand, tol(2e-3)).cls == "FAIL"


def test_two_floors_the_control_for_direct_comparisons_and_golden_rescored_for_continuations():
    golden = {"r@measure": rec([1, 2]), "q@measure": rec([1, 2], rid="q")}
    control = [rec([1, 2], tops=shifted([1, 2], 2e-6)), rec([1, 5], tops=shifted([1, 5], 9.0), rid="q")]
    calibration = {"r@measure": (0, [{1: -0.1 + 5e-6, 999: -3.0}, {2: -0.1}])}
    # a control answer counts up to its split; one 9 nat off is what this run measured (a broken control:
    # the canaries' power drops and the gate fails on them)
    direct = fidelity.direct_noise(golden, control)
    assert fidelity.floor(direct) == pytest.approx(9.0)
    assert [(d.request, d.position) for d in direct] == [("r@measure", 0), ("q@measure", 0)]
    assert fidelity.floor(fidelity.direct_noise(golden, control[:1])) == pytest.approx(2e-6)
    cont = fidelity.continuation_noise(golden, calibration)
    assert fidelity.floor(cont) == pytest.approx(5e-6) and cont[0].pair == "golden re-scored vs golden"
    assert fidelity.floor(fidelity.direct_noise(golden, [])) is None


def test_the_tolerances_follow_their_floors_with_a_least_value_and_are_assumed_without_one():
    t, _ = fidelity.tolerance(1e-5, 0.5, "float32")  # a hit's cached prefix is another kernel path: both floors
    assert t.direct == pytest.approx(1.5) and t.continuation == pytest.approx(1.5) and not t.exact
    t, _ = fidelity.tolerance(0.5, 1e-5, "float32")
    assert t.direct == pytest.approx(1.5) and t.continuation == pytest.approx(3e-5)
    assert fidelity.tolerance(0.0, 0.0, "float32")[0].direct == fidelity.FLOOR_NATS["float32"]
    assert fidelity.tolerance(0.2, None, "bfloat16")[0].direct == pytest.approx(0.6)
    t, source = fidelity.tolerance(None, None, "bfloat16")
    assert t.direct == fidelity.ASSUMED_NATS["bfloat16"] and "assumed" in source


def test_exact_mode_tolerates_nothing_and_never_widens_for_a_noisy_control():
    t, source = fidelity.tolerance(0.47, 0.47, "bfloat16", exact=True)
    assert t.direct == 0.0 and t.band == 0.0 and t.exact and "exact" in source
    gold = rec([1, 2, 3])
    assert fidelity.score(gold, rec([1, 2, 3]), t).cls == "identical"
    s = fidelity.score(gold, rec([1, 2, 3], tops=shifted([1, 2, 3], 1e-7)), t)
    assert s.cls == "FAIL" and "bitwise" in s.reason


def test_in_exact_mode_a_split_fails_even_at_a_near_tie_golden_would_score_as_benign():
    gold, cand = rec([1, 2, 3, 4], tops=NEAR_GOLD), rec([1, 9, 7, 8], tops=NEAR_CAND)
    continuation = (1, [{9: -0.70001, 2: -0.70003}, {7: -0.3, 3: -2.0}, {8: -0.3, 4: -2.0}])
    assert fidelity.score(gold, cand, TOL, continuation).cls == "benign"
    s = fidelity.score(gold, cand, EXACT, continuation)
    assert s.cls == "FAIL" and "never splits" in s.reason and s.first_divergence == 1


def test_a_logprob_that_is_not_a_number_fails_the_answer_even_with_golden_tokens():
    """None: a logprob the server sent as NaN or infinite. Equal tokens do not save it, and it never widens
    a noise floor (the control's floor compares finite logprobs only)."""
    golden = rec([1, 2, 3], config="golden")
    nan = rec([1, 2, 3], tops=[[[1, -0.1], [999, -3.0]], [[2, None], [999, None]], [[3, -0.1], [999, -3.0]]])
    for t in (TOL, EXACT):
        s = fidelity.score(golden, nan, t)
        assert s.cls == fidelity.Answer.FAIL and "not a number" in s.reason and "token 1" in s.reason
    assert fidelity.deviation(fidelity.alts(golden, 1), fidelity.alts(nan, 1)) is None
    bad_golden = fidelity.score(nan.model_copy(update={"config": "golden"}), golden, TOL)
    assert bad_golden.cls == fidelity.Answer.NO_GOLDEN and "not a number" in bad_golden.reason


def test_golden_re_scoring_drops_a_logprob_that_is_not_a_number(monkeypatch):
    """A NaN in golden's prompt_logprobs would make the continuation floor, and so every near-tie check, NaN
    (each comparison with it false: every split BENIGN). Golden's view keeps finite logprobs only; a position
    that loses the candidate's token then lists it as unlisted (FAIL)."""
    import json
    from types import SimpleNamespace as NS

    from kvscope.artifacts import Continuation
    from kvscope.run import continuations

    body = {"choices": [{"prompt_logprobs": [None, {"7": {"logprob": -0.5}, "8": {"logprob": float("nan")}},
                                             {"9": {"logprob": float("-inf")}, "4": {"logprob": -2.0}, "5": {"logprob": None}, "6": {"logprob": True}}]}]}
    monkeypatch.setattr(continuations.bounded_http, "fetch", lambda *a, **k: json.dumps(body).encode())
    golden = NS(url="http://x", manifest=NS(served_model_name="m"))
    view = continuations.golden_logprobs(golden, [1], [7, 9], 0)
    assert view == [[(7, -0.5)], [(4, -2.0)]]
    with pytest.raises(ValueError):
        Continuation(request_id="r", phase="measure", start=0, logprobs=[[(7, float("nan"))]])


def test_an_answer_that_ends_where_golden_has_a_near_tie_is_unverified_not_a_crash():
    # its end token is not recorded, so nothing says how far it is from golden's choice; the scorer took the
    # largest of the answer's (no) alternatives past its end, and the whole report died
    gold = rec([1, 2, 3], tops=[[[1, -0.1], [9, -3.0]], [[2, -0.1], [9, -3.0]], [[3, -0.5], [7, -0.50001]]],
               config="golden")
    s = fidelity.score(gold, rec([1, 2]), TOL)
    assert s.cls == "unverified" and s.first_divergence == 2 and "ends at token 2" in s.reason
    clear = rec([1, 2, 3], config="golden")  # golden's token 2 by a clear margin: the early end FAILs
    assert fidelity.score(clear, rec([1, 2]), TOL).cls == "FAIL"
