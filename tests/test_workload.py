"""The workload generator: deterministic, Zipf-skewed, ordered as asked, sized in model tokens."""

import json
from collections import Counter
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from kvscope.config.matrix import ConfigError
from kvscope.run.workload import (
    Scenario,
    build_pool,
    generate,
    load_scenarios,
    read_jsonl,
    replay_trace,
    sessions,
    write_jsonl,
    zipf_weights,
)

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


@pytest.fixture(scope="module")
def shipped():
    return load_scenarios(REPO / "loadtests" / "kvscope" / "scenarios.yaml")


def test_shipped_scenarios_include_the_four_defaults(shipped):
    assert {"rag-zipf", "rag-relevance", "multiturn", "repeat-867"} <= set(shipped)


def test_same_seed_same_requests_other_seed_other_requests(tok, shipped, tmp_path):
    sc = shipped["rag-zipf"]
    a, b = generate(sc, tok), generate(sc, tok)
    write_jsonl(a, tmp_path / "a.jsonl")
    write_jsonl(b, tmp_path / "b.jsonl")
    assert (tmp_path / "a.jsonl").read_bytes() == (tmp_path / "b.jsonl").read_bytes()
    assert read_jsonl(tmp_path / "a.jsonl") == a
    c = generate(sc.model_copy(update={"seed": 7}), tok)
    assert [r.doc_ids for r in c] != [r.doc_ids for r in a]


def test_documents_have_unique_headers_needles_and_measured_lengths(tok):
    sc = Scenario(name="t", kind="rag", num_docs=20, doc_tokens_median=120, doc_tokens_sigma=0.5)
    pool = build_pool(sc, 20, tok)
    for d in pool:
        assert d.text.startswith(f"[doc {d.doc_id:04d} |")
        assert f"The audit code for doc {d.doc_id:04d} is {d.needle}." in d.text
        assert d.tokens == len(tok.encode(d.text).ids)
        assert 30 <= d.tokens <= 480 + 40
    texts = [d.text for d in pool]
    assert not any(a != b and b.startswith(a) for a in texts for b in texts)
    lengths = sorted(d.tokens for d in pool)
    assert lengths[0] < lengths[-1]  # drawn, not constant


def test_zipf_popularity_is_skewed(tok):
    sc = Scenario(name="z", kind="rag", num_docs=30, doc_tokens_median=40, docs_per_query=1, zipf_s=1.2,
                  num_queries=400, system_prompt_tokens=0)
    counts = Counter(r.doc_ids[0] for r in generate(sc, tok))
    top = counts.most_common()
    assert top[0][1] > 5 * top[-1][1]
    w = zipf_weights(30, 1.2)
    assert abs(top[0][1] / 400 - w[0]) < 0.08


def test_canonical_order_is_sorted_relevance_order_is_not(tok, shipped):
    canon = generate(shipped["rag-zipf"], tok)
    assert all(r.doc_ids == sorted(r.doc_ids) for r in canon)
    rel = generate(shipped["rag-relevance"], tok)
    assert any(r.doc_ids != sorted(r.doc_ids) for r in rel)
    assert all(len(set(r.doc_ids)) == len(r.doc_ids) == 3 for r in rel)  # without replacement


def test_multiturn_sessions_and_the_repeat_scenario(tok, shipped):
    mt = generate(shipped["multiturn"], tok)
    grouped = sessions(mt)
    assert len(grouped) == 6 and all([r.turn for r in s] == [0, 1, 2] for s in grouped)
    assert [m["role"] for m in grouped[0][1].messages] == ["user"]
    assert [r.with_history for r in grouped[0]] == [False, True, True]
    rep = generate(shipped["repeat-867"], tok)
    assert len(rep) == 2 and rep[0].messages == rep[1].messages and rep[0].session_id == rep[1].session_id
    assert not any(r.with_history for r in rep)  # identical requests, sent in a row
    assert "人工智能" in rep[0].messages[1]["content"]


def test_working_set_sizes_the_pool_against_kv_capacity(tok):
    sc = Scenario(name="w", kind="rag", working_set=2.0, doc_tokens_median=100, num_queries=2)
    reqs = generate(sc, tok, kv_capacity_tokens=1000)
    assert max(max(r.doc_ids) for r in reqs) < 20
    with pytest.raises(ConfigError, match="working_set"):
        generate(sc, tok, kv_capacity_tokens=None)


def test_prime_replay_sends_everything_once_first(tok):
    sc = Scenario(name="p", kind="rag", num_docs=5, doc_tokens_median=40, num_queries=3, prime="replay")
    reqs = generate(sc, tok)
    assert [r.phase for r in reqs] == ["prime"] * 3 + ["measure"] * 3
    assert reqs[0].messages == reqs[3].messages


def test_bad_scenario_names_the_field(tmp_path):
    (tmp_path / "s.yaml").write_text("scenarios:\n  - name: x\n    kind: rag\n    zipf: 1\n")
    with pytest.raises(ConfigError, match="scenario 'x': field 'zipf'"):
        load_scenarios(tmp_path / "s.yaml")


def test_a_trace_replays_each_hash_id_as_the_same_tokens_scaled_capped_and_at_its_arrival_times(tmp_path, tok):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 1100, "output_length": 300, "hash_ids": [0, 1, 2]}\n'
                     '{"timestamp": 1500, "input_length": 1024, "output_length": 5, "hash_ids": [0, 1]}\n'
                     '{"timestamp": 9000, "input_length": 600, "output_length": 5, "hash_ids": [0, 7]}\n')
    sc = Scenario(name="t", kind="trace", trace=str(trace), block_tokens=64, time_scale=2.0, duration_s=10,
                  max_tokens=16)
    first, second = generate(sc, tok, max_model_len=4096)  # the third arrives at 18 s, past duration_s
    assert len(first.prompt) == round(1100 * 64 / 512) == 138 and len(second.prompt) == 128
    assert first.prompt[:128] == second.prompt  # blocks 0 and 1: the same tokens in both
    assert (first.max_tokens, second.max_tokens) == (16, 5) and (first.arrival_s, second.arrival_s) == (0.0, 3.0)
    assert generate(sc, tok, max_model_len=100)[0].prompt == first.prompt[:84]  # room for prompt + answer
    assert generate(sc, tok, max_model_len=4096) == [first, second]  # deterministic


def test_a_trace_that_is_not_one_is_named_with_its_line(tmp_path, tok):
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 10, "output_length": 3, "hash_ids": [0]}\n{"timestamp": "x"}\n')
    with pytest.raises(ConfigError, match=r"field 'trace': .*t.jsonl:2: not a Mooncake trace row"):
        generate(Scenario(name="t", kind="trace", trace=str(trace)), tok)
    with pytest.raises(ConfigError, match="cannot read"):
        generate(Scenario(name="t", kind="trace", trace=str(tmp_path / "none.jsonl")), tok)
    with pytest.raises(ValueError, match="names its trace file"):
        Scenario(name="t", kind="trace")


def test_the_shipped_trace_scenario_finds_its_slice_beside_the_scenarios_file(shipped, tok):
    reqs = generate(shipped["trace-mooncake"], tok, max_model_len=4096)
    assert len(reqs) == 64 and all(r.endpoint == "completions" and r.arrival_s is not None for r in reqs)
    assert reqs[-1].arrival_s > 10  # open loop: the trace's own times


def test_a_controlled_reuse_shares_exactly_its_share_of_each_prompt(tok):
    sc = Scenario(name="r", kind="reuse", reuse=0.75, prompt_tokens=64, prefixes=2, num_queries=4)
    reqs = generate(sc, tok)
    assert [len(r.prompt) for r in reqs] == [64] * 4 and all(r.endpoint == "completions" for r in reqs)
    assert reqs[0].prompt[:48] == reqs[2].prompt[:48] != reqs[1].prompt[:48]  # prefixes taken in turn
    assert reqs[0].prompt[48:] != reqs[2].prompt[48:]  # the rest is each prompt's own
    none = generate(Scenario(name="n", kind="reuse", reuse=0.0, prompt_tokens=64, num_queries=3), tok)
    assert len({tuple(r.prompt[:8]) for r in none}) == 3


def test_a_restart_scenario_primes_and_needs_a_restart_command(tmp_path, tok, shipped):
    assert shipped["restart"].restart and {r.phase for r in generate(shipped["restart"], tok)} == {"prime",
                                                                                                  "measure"}
    with pytest.raises(ValueError, match="needs prime: replay"):
        Scenario(name="x", kind="rag", restart=True)


def _trace(tmp_path, *rows, **fields) -> Scenario:
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Scenario(name="t", kind="trace", trace=str(trace), **fields)


def _row(ms: int, hash_ids=(0,)) -> dict:
    return {"timestamp": ms, "input_length": 100, "output_length": 3, "hash_ids": list(hash_ids)}


def test_a_traces_duration_counts_from_its_first_row_not_from_zero(tmp_path):
    sc = _trace(tmp_path, _row(5_000_000), _row(5_001_500), _row(5_020_000), duration_s=10)
    assert [r.arrival_s for r in replay_trace(sc, 1000, None)] == [0.0, 1.5]


def test_a_trace_row_out_of_time_order_is_refused_with_its_line(tmp_path):
    sc = _trace(tmp_path, _row(0), _row(400_000), _row(1000), duration_s=10)
    with pytest.raises(ConfigError, match=r"t.jsonl:3: timestamp 1000 is before line 2's 400000"):
        replay_trace(sc, 1000, None)


@pytest.mark.parametrize("hash_ids", [["a"], [-1], [1.5], [True], [[1]]])
def test_a_trace_rows_bad_hash_id_is_refused_with_its_line(tmp_path, hash_ids):
    sc = _trace(tmp_path, _row(0), _row(10, hash_ids))
    with pytest.raises(ConfigError, match=r"t.jsonl:2: not a Mooncake trace row"):
        replay_trace(sc, 1000, None)


def test_an_empty_trace_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="t.jsonl: no rows"):
        replay_trace(_trace(tmp_path), 1000, None)


def test_the_repeat_past_window_scenario_sends_one_prompt_past_gemma3s_window_many_times(tok, shipped):
    # kvcached#446: on a sliding-window model the 3rd and 4th identical prompts answered differently
    rep = generate(shipped["repeat-past-window"], tok)
    assert len(rep) >= 20 and all(r.messages == rep[0].messages for r in rep)
    assert len({r.session_id for r in rep}) == 1 and not any(r.with_history for r in rep)
