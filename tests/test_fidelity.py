"""The fidelity classifier on constructed records: identical, benign near tie, FAIL, degenerate, unscored."""

from kvscope import fidelity
from kvscope.records import Record


def rec(tokens, tops=None, config="c", ok=True, text="", needle=None, prompt_sha="p", cached=0):
    tops = tops or [[["t%d" % t, -0.1], ["x", -3.0]] for t in tokens]
    return Record(config=config, scenario="s", phase="measure", request_id="r", session_id="s", turn=0,
                  endpoint="chat", start_unix_s=0.0, ok=ok, error=None if ok else "HTTP 500", ttft_s=0.1,
                  output_token_ids=tokens, top_logprobs=tops, output_text=text, needle=needle,
                  prompt_sha=prompt_sha, cached_tokens=cached, prompt_tokens=100)


def test_identical():
    s = fidelity.score(rec([1, 2, 3], config="golden"), rec([1, 2, 3]))
    assert s.cls == "identical" and s.first_divergence is None


def test_divergence_at_a_near_tie_is_benign():
    gold = rec([1, 2, 3], tops=[[["a", -0.1], ["x", -3]], [["b", -0.70], ["c", -0.75]], [["d", -0.1], ["e", -2]]])
    cand = rec([1, 9, 9], tops=[[["a", -0.1], ["x", -3]], [["c", -0.70], ["b", -0.74]], [["z", -0.1], ["y", -2]]])
    s = fidelity.score(gold, cand)
    assert s.cls == "benign" and s.first_divergence == 1 and abs(s.golden_margin - 0.05) < 1e-9


def test_divergence_at_a_clear_margin_fails():
    gold = rec([1, 2, 3], tops=[[["a", -0.1], ["x", -3]], [["b", -0.2], ["c", -2.2]], [["d", -0.1], ["e", -2]]])
    cand = rec([1, 9, 3], tops=[[["a", -0.1], ["x", -3]], [["q", -0.2], ["b", -2.0]], [["d", -0.1], ["e", -2]]])
    s = fidelity.score(gold, cand)
    assert s.cls == "FAIL" and s.first_divergence == 1 and "margin 2.000" in s.reason


def test_near_tie_with_a_token_outside_the_others_top2_fails():
    gold = rec([1, 2], tops=[[["a", -0.1], ["x", -3]], [["b", -0.70], ["c", -0.75]]])
    cand = rec([1, 9], tops=[[["a", -0.1], ["x", -3]], [["q", -0.70], ["r", -0.75]]])
    assert fidelity.score(gold, cand).cls == "FAIL"


def test_three_way_tie_is_benign_when_both_tokens_are_in_the_band():
    # bf16 ties: golden's top-2 are c and b at equal logprob, the candidate took the third, equally likely token
    gold = rec([1, 2], tops=[[["a", -0.1]], [["c", -1.0], ["b", -1.0], ["d", -1.0]]])
    cand = rec([1, 9], tops=[[["a", -0.1]], [["d", -1.0], ["c", -1.0], ["b", -1.0]]])
    assert fidelity.score(gold, cand).cls == "benign"


def test_bf16_band_is_wider_than_fp32():
    # a swap 0.125 nat apart: one bf16 step at |logit| 16-32; a FAIL in fp32, benign in bf16
    gold = rec([1, 2], tops=[[["a", -0.1]], [["b", -0.5], ["c", -0.625]]])
    cand = rec([1, 9], tops=[[["a", -0.1]], [["c", -0.5], ["b", -0.625]]])
    assert fidelity.score(gold, cand, fidelity.near_tie_nats("float32")).cls == "FAIL"
    assert fidelity.score(gold, cand, fidelity.near_tie_nats("bfloat16")).cls == "benign"
    wide = rec([1, 9], tops=[[["a", -0.1]], [["c", -0.5], ["b", -0.9]]])  # 0.4 nat: wrong in any dtype
    assert fidelity.score(gold, wide, fidelity.near_tie_nats("bfloat16")).cls == "FAIL"


def test_shorter_answer_diverges_at_its_end():
    s = fidelity.score(rec([1, 2, 3]), rec([1, 2]))
    assert s.cls == "FAIL" and s.first_divergence == 2


def test_degenerate_repetition_is_measured_and_fails():
    a_a_a = [64] * 50  # "a a a a ..." as in UCM #867
    assert fidelity.repetition(a_a_a) == 1.0
    assert fidelity.repetition([5, 6] * 10) == 1.0
    assert fidelity.repetition(list(range(40))) == 0.0
    assert fidelity.is_degenerate(a_a_a) and not fidelity.is_degenerate([7, 7, 7])  # too short to judge
    s = fidelity.score(rec(list(range(50))), rec(a_a_a))
    assert s.cls == "FAIL" and s.degenerate and "degenerate" in s.reason


def test_degenerate_golden_does_not_blame_the_candidate():
    assert fidelity.score(rec([3] * 20), rec([3] * 20)).cls == "identical"


def test_lost_needle_fails_even_with_identical_prefix():
    gold = rec([1, 2, 3], text="The code is KX1234.", needle="KX1234")
    cand = rec([1, 2, 3], text="The code is KX12", needle="KX1234")
    s = fidelity.score(gold, cand)
    assert s.cls == "FAIL" and s.needle_golden and not s.needle_candidate


def test_unscorable_requests_are_counted_apart():
    assert fidelity.score(rec([1]), rec([1], ok=False)).cls == "failed"
    assert fidelity.score(None, rec([1])).cls == "no-golden"
    assert fidelity.score(rec([1], ok=False), rec([1])).cls == "no-golden"
    assert fidelity.score(rec([1], prompt_sha="a"), rec([1], prompt_sha="b")).cls == "input-differs"


def test_verdict():
    assert fidelity.verdict(["identical", "benign"]) == "PASS"
    assert fidelity.verdict(["identical", "FAIL"]) == "FAIL"
    assert fidelity.verdict(["failed", "no-golden"]) == "NO-DATA"
