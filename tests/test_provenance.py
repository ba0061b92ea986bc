"""Where wrong hits' KV came from: a fault that follows stored blocks, one that follows the load, and published
runs whose cause is known (canaries break the load; LMCache's multi-process store serves one request's
blocks wrong to every hit that loads them)."""

from pathlib import Path

import pandas as pd

from kvscope.analyze import provenance
from kvscope.analyze.loaded import load
from kvscope.artifacts import Record

RESULTS = Path(__file__).resolve().parents[1] / "results"
BLOCK = 16


def rec(rid: str, blocks: list[str], cached_blocks: int, start: float) -> Record:
    return Record(config="c", scenario="s", phase="measure", request_id=rid, session_id=rid, turn=0,
                  endpoint="chat", start_unix_s=start, ok=True, prompt_tokens=BLOCK * len(blocks) + 1,
                  cached_tokens=BLOCK * cached_blocks, prompt_block_hashes=blocks)


def read(trace: list[tuple[str, list[str], int, str]]) -> dict | None:
    """trace: (request, its blocks, how many it loaded, its class), in arrival order."""
    records = [rec(rid, blocks, n, float(i)) for i, (rid, blocks, n, _) in enumerate(trace)]
    scores = pd.DataFrame([{"phase": "measure", "request_id": rid, "cached_tokens": BLOCK * n, "cls": cls}
                           for rid, _, n, cls in trace])
    return provenance.treatment("c", "s", records, scores, BLOCK)


def test_wrong_hits_that_share_stored_blocks_no_right_answer_used_follow_the_stored_data():
    row = read([("a", ["a0", "a1", "x"], 0, "identical"), ("b", ["b0", "b1", "y"], 0, "identical"),
                ("a2", ["a0", "a1", "z"], 2, "FAIL"), ("a3", ["a0", "a1", "w"], 2, "FAIL"),
                ("b2", ["b0", "b1", "v"], 2, "identical")])
    assert row["wrong_hits"] == 2 and row["wrong_in_load"] == 0 and row["suspect_blocks"] == 2
    assert row["stored_by"] == "a" and row["reading"].startswith("follows the stored blocks")


def test_a_wrong_hit_on_blocks_that_served_a_right_answer_follows_the_load():
    row = read([("a", ["a0", "a1", "x"], 0, "identical"), ("a2", ["a0", "a1", "z"], 2, "identical"),
                ("a3", ["a0", "a1", "w"], 2, "FAIL")])
    assert row["wrong_in_load"] == 1 and row["suspect_blocks"] == 0
    assert row["reading"].startswith("follows the load")


def test_when_every_hit_is_wrong_it_says_it_cannot_tell():
    row = read([("a", ["a0", "x"], 0, "identical"), ("a2", ["a0", "z"], 1, "FAIL")])
    assert row["reading"].startswith("every hit wrong")
    assert read([("a", ["a0", "x"], 0, "identical"), ("a2", ["a0", "z"], 1, "identical")]) is None


def test_blocks_no_request_of_the_treatment_computed_came_from_an_earlier_one():
    row = read([("a2", ["a0", "z"], 1, "FAIL"), ("b", ["b0", "y"], 0, "identical"),
                ("b2", ["b0", "v"], 1, "identical"), ("a3", ["a0", "w"], 1, "FAIL")])
    assert row["stored_by"] == "an earlier treatment"


def published(name: str, roles: tuple[str, ...]) -> pd.DataFrame:
    folder = RESULTS / name
    loaded = load(folder)
    run, recs = loaded.run, loaded.recs
    sizes = {s.config: s.manifest.block_size for s in run.servers if s.role in roles}
    return provenance.table(recs, pd.read_csv(folder / "scores.csv"), sizes).set_index(["config", "scenario"])


def test_lmcache_multiprocess_wrong_hits_all_loaded_one_requests_blocks():
    rows = published("2026-12-01-h200-vllm0.26-tiny-fp32-lmcache-mp5", ("candidate",))
    mp = rows.loc["lmcache-mp", "rag-zipf"]
    assert (mp.hits, mp.wrong_hits, mp.wrong_in_load, mp.stored_by) == (15, 3, 0, "rag-zipf-0002-t0")
    assert mp.reading.startswith("follows the stored blocks")


def test_faults_injected_at_load_never_read_as_stored_data():
    rows = published("2026-11-30-cpu-vllm0.32-scorer2", ("canary",))
    assert len(rows) >= 30
    assert not rows.reading.str.startswith("follows the stored blocks").any()
    assert rows.loc["canary-second-hit", "rag-zipf"].reading.startswith("mixed")


def answer(config: str, rid: str, tokens: list[int], cached: int) -> Record:
    return Record(config=config, scenario="s", phase="measure", request_id=rid, session_id=rid, turn=0,
                  endpoint="chat", start_unix_s=0.0, ok=True, prompt_tokens=100, cached_tokens=cached,
                  output_token_ids=tokens, top_logprobs=[[(t, -0.5)] for t in tokens])


def test_exact_mode_groups_the_candidates_that_reused_as_much_by_bitwise_equal_answers():
    # the H200 runs' patterns: vLLM's prefix cache and both kvscope tiers agreeing on one other answer, a store
    # alone, candidates that reused different amounts (a line each), and caches giving the control's answer
    answers = {"golden": [("r1", [1, 2], 0), ("r2", [1, 2], 0), ("r3", [5], 0), ("r4", [8], 0)],
               "control": [("r1", [1, 2], 0), ("r2", [1, 2], 0), ("r3", [5], 0), ("r4", [9], 0)],
               "apc": [("r1", [1, 3], 64), ("r2", [1, 2], 32), ("r3", [5], 32), ("r4", [9], 32)],
               "ram": [("r1", [1, 3], 64), ("r2", [1, 2], 32), ("r3", [6], 64), ("r4", [9], 32)],
               "offload": [("r1", [1, 4], 64), ("r2", [7], 32), ("r3", [4], 32), ("r4", [8], 32)]}
    recs = {(c, "s"): [answer(c, rid, t, n) for rid, t, n in rows] for c, rows in answers.items()}
    fails = [("apc", "r1", 64), ("ram", "r1", 64), ("offload", "r1", 64), ("offload", "r2", 32), ("ram", "r3", 64),
             ("offload", "r3", 32), ("apc", "r4", 32), ("ram", "r4", 32)]
    scores = pd.DataFrame([{"config": c, "scenario": "s", "phase": "measure", "request_id": rid, "cls": "FAIL",
                            "cached_tokens": n} for c, rid, n in fails])
    assert provenance.shared_differences(recs, scores, "golden", "control", ["apc", "ram", "offload"]) == [
        "`r1` (64 cached tokens): apc = ram | offload",
        "`r4` (32 cached tokens): apc = ram (the control's answer); as golden: offload",
        "`r2` (32 cached tokens): offload; as golden: apc, ram",
        "`r3` (64 cached tokens): ram",
        "`r3` (32 cached tokens): offload; as golden: apc"]
