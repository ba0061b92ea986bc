"""The fault-injection canary's faults on fake vLLM caches: what each writes, and what its log says."""

import json
from types import SimpleNamespace as NS

import pytest
import torch

from kvscope_connector.canary import FAULTS, RANK_FAULTS, CanaryMetadata, _FaultWorker, _PartialBlocks
from kvscope_connector.messages import KVScopeMetadata, LoadSpec, StoreSpec
from kvscope_connector.scheduler import SchedulerSide
from kvscope_connector.store import FsTier, RamTier

FP, B, HEADS = "f" * 32, 4, 2


def canary(tmp_path, blocks=3):
    """A canary worker on CPU-shaped caches (H, B, 2D) with `blocks` distinct blocks stored as k0, k1, ..."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    w = _FaultWorker(FP, B, RamTier(1 << 20), None)
    gen = torch.Generator().manual_seed(0)
    w.register({f"layer{i}": torch.randn(16, HEADS, B, 6, generator=gen) for i in range(3)})
    w.kv_heads, w.fault_log = HEADS, str(tmp_path / "faults.jsonl")
    w.save(KVScopeMetadata(stores=[StoreSpec(j, f"k{j}", True, False) for j in range(blocks)]))
    w.flush()
    return w


def load(w, fault, n=3, first_slot=8, request="r1"):
    loads = [LoadSpec(first_slot + j, f"k{j}", "ram", request_id=request, index=j) for j in range(n)]
    w.load(CanaryMetadata(loads=loads, faults={request: fault}))
    return [{name: t[first_slot + j] for name, t in w.layers.items()} for j in range(n)]


def stored(w, j):
    return {name: t[j] for name, t in w.layers.items()}


def log(tmp_path):
    return [json.loads(line) for line in (tmp_path / "faults.jsonl").read_text().splitlines()]


def test_shift_loads_every_block_one_block_late_and_the_first_as_it_is(tmp_path):
    w = canary(tmp_path)
    got = load(w, "shift")
    for name in w.layers:
        assert torch.equal(got[0][name], stored(w, 0)[name])
        assert torch.equal(got[1][name], stored(w, 0)[name]) and torch.equal(got[2][name], stored(w, 1)[name])
    assert log(tmp_path) == [{"request": "r1", "fault": "shift", "loaded": 3, "changed": 2, "inherited": 0,
                              "distance": log(tmp_path)[0]["distance"]}]
    assert len(log(tmp_path)[0]["distance"]) == 2 and min(log(tmp_path)[0]["distance"]) > 0.1


def test_shift_of_a_single_block_moves_its_tokens_one_position_late(tmp_path):
    w = canary(tmp_path, blocks=1)
    got = load(w, "shift", n=1)[0]["layer0"]
    want = stored(w, 0)["layer0"]
    assert torch.equal(got[:, 0], want[:, 0]) and torch.equal(got[:, 1:], want[:, :-1])


def test_layer_and_head_faults_touch_only_their_part(tmp_path):
    w = canary(tmp_path)
    got = load(w, "layer")
    assert torch.equal(got[2]["layer1"], stored(w, 1)["layer1"])  # the middle layer of three
    assert all(torch.equal(got[2][n], stored(w, 2)[n]) for n in ("layer0", "layer2"))
    w = canary(tmp_path / "h")
    got = load(w, "head")
    assert torch.equal(got[2]["layer1"][0], stored(w, 1)["layer1"][0])  # head 0 of the middle layer
    assert torch.equal(got[2]["layer1"][1], stored(w, 2)["layer1"][1])
    assert all(torch.equal(got[2][n], stored(w, 2)[n]) for n in ("layer0", "layer2"))


def test_zeros_and_stale_break_the_last_block_only(tmp_path):
    w = canary(tmp_path)
    got = load(w, "zeros")
    assert not got[2]["layer0"].any() and torch.equal(got[1]["layer0"], stored(w, 1)["layer0"])
    before = w.layers["layer0"][10].clone()
    got = load(w, "stale", request="r2")
    assert torch.equal(got[2]["layer0"], before) and torch.equal(got[0]["layer0"], stored(w, 0)["layer0"])
    assert [e["changed"] for e in log(tmp_path)] == [1, 1]


def test_the_log_says_how_far_each_changed_block_is_from_the_verified_one(tmp_path):
    w = canary(tmp_path)
    load(w, "zeros")  # the last block all zeros: every value off by its own size, 1.0 of the largest
    load(w, "noise-1e-3", request="r2")
    zeros, noise = log(tmp_path)
    assert zeros["distance"] == [1.0]
    assert len(noise["distance"]) == 3 and all(1e-5 < d < 1e-2 for d in noise["distance"])


def test_stale_onto_a_slot_that_already_holds_the_block_is_logged_as_unchanged(tmp_path):
    w = canary(tmp_path)  # slot 2 still holds the bytes block k2 was stored from
    w.load(CanaryMetadata(loads=[LoadSpec(2, "k2", "ram", request_id="r2")], faults={"r2": "stale"}))
    assert log(tmp_path) == [{"request": "r2", "fault": "stale", "loaded": 1, "changed": 0, "inherited": 0,
                              "distance": []}]


@pytest.mark.parametrize("fault,scale", [("noise-1e-2", 1e-2), ("noise-1e-3", 1e-3)])
def test_noise_is_small_relative_to_the_kv_and_touches_every_block(tmp_path, fault, scale):
    w = canary(tmp_path)
    got = load(w, fault)
    for j in range(3):
        diff = got[j]["layer0"] - stored(w, j)["layer0"]
        assert 0.3 * scale < float(diff.std() / stored(w, j)["layer0"].std()) < 3 * scale
    assert log(tmp_path)[0]["changed"] == 3


def test_second_hit_is_correct_on_a_keys_first_load_and_shifted_from_its_second(tmp_path):
    w = canary(tmp_path)
    first = load(w, "second-hit")
    assert all(torch.equal(first[j]["layer0"], stored(w, j)["layer0"]) for j in range(3))
    second = load(w, "second-hit", first_slot=12, request="r2")
    assert torch.equal(second[1]["layer0"], stored(w, 0)["layer0"])
    w.load(CanaryMetadata(reset=True))
    w.save(KVScopeMetadata(stores=[StoreSpec(j, f"k{j}", True, False) for j in range(3)]))
    third = load(w, "second-hit", request="r3")
    assert torch.equal(third[1]["layer0"], stored(w, 1)["layer0"])  # a reset forgets what was loaded
    assert [e["changed"] for e in log(tmp_path)] == [0, 2, 0]


def test_foreign_serves_another_keys_block(tmp_path):
    w = canary(tmp_path, blocks=4)
    got = load(w, "foreign")  # loads k0..k2; k3 is the other key in RAM
    assert torch.equal(got[2]["layer0"], stored(w, 3)["layer0"])
    assert log(tmp_path)[0]["changed"] == 1


def test_every_fault_changes_what_a_request_loads(tmp_path):
    for fault in FAULTS:  # a per-rank fault on rank 1 of two (on rank 0 it is the right KV)
        w = ranks(tmp_path / fault, n=4)[1] if fault in RANK_FAULTS else canary(tmp_path / fault, blocks=4)
        borrowed = {"r1": 0} if fault == "partial" else {}  # its scheduler side names the other prompt's block
        loads = [LoadSpec(1 + j, f"k{j}", "ram", request_id="r1", index=j) for j in range(3)]
        w.load(CanaryMetadata(loads=loads, faults={"r1": fault}, borrowed=borrowed))  # into slots k1..k3 held
        load(w, fault, first_slot=12, request="r2")  # second-hit needs a second load
        assert max(e["changed"] for e in log(tmp_path / fault)) > 0, fault


def test_an_unknown_fault_loads_correct_kv_and_says_so(tmp_path):
    w = canary(tmp_path)
    got = load(w, "bogus")
    assert all(torch.equal(got[j]["layer0"], stored(w, j)["layer0"]) for j in range(3))
    assert log(tmp_path)[0]["changed"] == 0 and "fault" in w.logged


def test_blocks_computed_on_top_of_wrong_kv_are_stored_and_whoever_loads_them_is_logged_as_served_wrong_kv(tmp_path):
    # Not storing them left the scheduler counting keys the worker never had: every later hit on them was a
    # miss vLLM had to recompute, logged nowhere (the H200 bf16 runs' 16 unattributed FAILs per treatment).
    w = canary(tmp_path)
    load(w, "zeros", request="r1")  # its third block (index 2) zeroed
    w.load(CanaryMetadata(loads=[LoadSpec(2, "k2", "ram", request_id="r2")], faults={"r2": "stale"}))  # correct
    w.save(KVScopeMetadata(stores=[StoreSpec(4, "k-r1", True, False, request_id="r1", index=3),
                                   StoreSpec(5, "k-r2", True, False, request_id="r2", index=1),
                                   StoreSpec(6, "k-r1-early", True, False, request_id="r1", index=1)]))
    w.flush()
    assert w.ram.contains("k-r1") and w.ram.contains("k-r2")
    assert w.tainted_keys == {"k-r1"}  # r1's block 1 came before its first wrong one: right
    w.load(CanaryMetadata(loads=[LoadSpec(4, "k-r1", "ram", request_id="r3"), LoadSpec(5, "k-r2", "ram",
                                                                                       request_id="r4")],
                          faults={"r3": "stale", "r4": "stale"}))  # slots 4, 5 still hold the stored bytes
    assert [(e["request"], e["changed"], e["inherited"]) for e in log(tmp_path)[-2:]] == [("r3", 0, 1), ("r4", 0, 0)]
    w.load(CanaryMetadata(reset=True))
    assert not w.tainted_keys and not w.tainted


def test_a_keys_taint_follows_the_copy_the_ram_tier_keeps(tmp_path):
    # The H200 TRITON_ATTN run (2026-12-02): a block computed over zeros was stored, then stored again by
    # requests served right, which the RAM tier ignores (it keeps a key it holds); the canary had cleared the
    # key's taint, so 7 later loads of the zeroed copy were logged unaffected (changed 0, inherited 0) and FAILed.
    w = canary(tmp_path)
    load(w, "zeros", request="r1")
    w.save(KVScopeMetadata(stores=[StoreSpec(4, "k-r1", True, False, request_id="r1", index=3)]))
    w.save(KVScopeMetadata(stores=[StoreSpec(5, "k-r1", True, False, request_id="r2", index=3)]))
    w.flush()
    assert w.tainted_keys == {"k-r1"} and torch.equal(w.ram.get("k-r1")[0], w.extract([4])[0])  # r1's copy kept

    def reload(request):
        w.load(CanaryMetadata(loads=[LoadSpec(9, "k-r1", "ram", request_id=request)], faults={request: "stale"}))
        return log(tmp_path)[-1]["inherited"]

    assert reload("r3") == 1
    # evicted and stored again in one step by a request served right: the right copy, untainted
    w.save(KVScopeMetadata(ram_evict=["k-r1"], stores=[StoreSpec(5, "k-r1", True, False, request_id="r2", index=3)]))
    w.flush()
    assert reload("r4") == 0
    # and by a request served wrong: the wrong copy, tainted (the old canary missed this one)
    w.save(KVScopeMetadata(ram_evict=["k-r1"], stores=[StoreSpec(4, "k-r1", True, False, request_id="r1", index=3)]))
    w.flush()
    assert reload("r5") == 1


def test_noise_that_the_caches_dtype_rounds_away_is_logged_as_unchanged(tmp_path):
    w = _FaultWorker(FP, B, RamTier(1 << 20), None)
    w.register({f"layer{i}": (100 + 1e-3 * torch.randn(16, HEADS, B, 6)).to(torch.bfloat16) for i in range(3)})
    w.fault_log = str(tmp_path / "faults.jsonl")
    w.save(KVScopeMetadata(stores=[StoreSpec(j, f"k{j}", True, False) for j in range(3)]))
    w.flush()
    load(w, "noise-1e-3")  # 1e-3 of a tiny spread, on values whose bf16 step is 0.5
    assert log(tmp_path)[0]["changed"] == 0
    assert torch.equal(w.layers["layer0"][8:11], torch.stack([w.layers["layer0"][j] for j in range(3)]))


def test_unloaded_writes_nothing_and_every_slot_keeps_what_it_held(tmp_path):
    w = canary(tmp_path)
    before = w.layers["layer0"][8:11].clone()
    got = load(w, "unloaded")
    assert all(torch.equal(got[j]["layer0"], before[j]) for j in range(3))
    assert log(tmp_path)[0]["changed"] == 3


def test_reused_writes_the_kv_of_the_key_each_slot_held_before(tmp_path):
    w = canary(tmp_path, blocks=4)  # slots 0..3 held k0..k3 (saved from there)
    right = [stored(w, j)["layer0"].clone() for j in range(4)]
    w.layers["layer0"][1:4] = 0  # vLLM wrote the slots since: the former owners' KV comes from the tier
    got = load(w, "reused", first_slot=1)  # k0..k2 into slots 1..3, once k1..k3's: k0's KV gone, k3's in
    assert all(torch.equal(got[j]["layer0"], right[j + 1]) for j in range(3))
    assert log(tmp_path)[0]["changed"] == 3
    again = load(w, "reused", first_slot=1, request="r2")  # each slot's last key is now its own: right KV
    assert all(torch.equal(again[j]["layer0"], right[j]) for j in range(3))
    assert log(tmp_path)[1]["changed"] == 0


def test_reused_does_not_write_the_requests_own_blocks_back_in_another_order(tmp_path):
    # vLLM frees a request's blocks last to first and hands the freed ones out first: a later request with the
    # same prefix can get them reversed, so each slot's former owner is one of its own keys. Written back, that
    # is its own KV in another order, the same attention where every query sees every loaded position (a miss
    # on 2026-12-06: "changed" 4, the answer golden's within 6.7e-06 nat)
    w = canary(tmp_path, blocks=4)  # slots 0..3 held k0..k3
    right = [stored(w, j)["layer0"].clone() for j in range(4)]
    loads = [LoadSpec(3 - j, f"k{j}", "ram", request_id="r1", index=j) for j in range(4)]  # k0..k3 into 3..0
    w.load(CanaryMetadata(loads=loads, faults={"r1": "reused"}))
    assert all(torch.equal(w.layers["layer0"][3 - j], right[j]) for j in range(4))
    assert log(tmp_path)[0]["changed"] == 0


def test_partial_claims_the_next_block_of_another_prompt_with_the_same_blocks_before_it():
    s = SchedulerSide(FP, B, ram_blocks=32, fs=None)
    p = _PartialBlocks(s)

    def ask(rid, tokens):
        req = NS(request_id=rid, prompt_token_ids=tokens)
        hit = s.lookup(req, 0)[0]
        p.remember(req)
        return req, hit, p.borrow(req, 0, hit)

    a, _, _ = ask("a", [0, 1, 2, 3, 10, 11, 12, 13, 99])  # stores k0 and its block after k0: 10..13
    meta = s.build_meta(NS(scheduled_new_reqs=[NS(req_id="a", prompt_token_ids=a.prompt_token_ids,
                                                  block_ids=([0, 1, 2],), num_computed_tokens=0)],
                           num_scheduled_tokens={"a": 9}, finished_req_ids=set(),
                           scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                    num_computed_tokens=[])))
    assert p.note(meta, ["a"]) == {}
    other = meta.stores[1].key
    req, hit, extra = ask("p", [0, 1, 2, 3, 30, 31, 32])  # shares k0; its next, partial block differs
    assert (hit, extra) == (4, 2)  # up to its last prompt token, which vLLM computes
    p.after_alloc(req, NS(get_block_ids=lambda: ([5, 6],)), 6)
    meta = s.build_meta(NS(scheduled_new_reqs=[], num_scheduled_tokens={}, finished_req_ids=set(),
                           scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                    num_computed_tokens=[])))
    assert [(x.block_id, x.key, x.index) for x in meta.loads] == [(5, meta.loads[0].key, 0), (6, other, 1)]
    assert p.note(meta, []) == {"p": 1}
    assert ask("q", [0, 1, 2, 3, 10, 11, 50])[1:] == (4, 0)  # the other block's tokens are its own there: no fault
    # Of several blocks to borrow, the one that differs earliest: the positions before a block's first
    # difference hold the right KV. "b" stores its block after k0 last: the most recent.
    b, _, _ = ask("b", [0, 1, 2, 3, 20, 21, 22, 23, 99])
    meta = s.build_meta(NS(scheduled_new_reqs=[NS(req_id="b", prompt_token_ids=b.prompt_token_ids,
                                                  block_ids=([7, 8, 9],), num_computed_tokens=0)],
                           num_scheduled_tokens={"b": 9}, finished_req_ids=set(),
                           scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(),
                                                    num_computed_tokens=[])))
    p.note(meta, ["b"])
    late = next(x.key for x in meta.stores if x.index == 1)
    req, hit, extra = ask("s", [0, 1, 2, 3, 20, 99, 50])  # b's next block differs from its second token on
    assert (hit, extra) == (4, 2) and p.plans["s"][1] == other != late  # a's differs from its first
    assert ask("r", [7, 7, 7, 7, 30, 31, 32])[1:] == (0, 0)  # no hit, no prefix to borrow after


def test_partial_never_borrows_a_block_stored_on_top_of_a_borrowed_one():
    """A prompt that borrowed a block stores that block's KV under its own key: another prompt's KV, maybe the
    very KV a later request needs. Borrowing it is no fault: on vLLM 0.34, 10 of 68 "broken" hits answered
    bitwise as golden, each having borrowed such a block (H100 bf16 exact, 2026-12-06)."""
    s = SchedulerSide(FP, B, ram_blocks=32, fs=None)
    p = _PartialBlocks(s)
    idle = NS(scheduled_new_reqs=[], num_scheduled_tokens={}, finished_req_ids=set(),
              scheduled_cached_reqs=NS(req_ids=[], new_block_ids=[], resumed_req_ids=set(), num_computed_tokens=[]))

    def serve(rid, tokens, block_ids):
        req = NS(request_id=rid, prompt_token_ids=tokens)
        hit = s.lookup(req, 0)[0]
        p.remember(req)
        extra = p.borrow(req, 0, hit)
        p.after_alloc(req, NS(get_block_ids=lambda: (block_ids,)), hit + extra)
        meta = s.build_meta(NS(**{**vars(idle), "scheduled_new_reqs": [
            NS(req_id=rid, prompt_token_ids=tokens, block_ids=(block_ids,), num_computed_tokens=hit + extra)],
            "num_scheduled_tokens": {rid: len(tokens) - hit - extra}}))
        p.note(meta, [rid])
        return extra, {x.index: x.key for x in meta.stores}

    extra, stored_q = serve("q", [0, 1, 2, 3, 10, 11, 12, 13, 99], [0, 1, 2])  # stores k0 and its block 1
    assert extra == 0 and set(stored_q) == {0, 1}
    extra, stored_p = serve("p", [0, 1, 2, 3, 20, 21, 22, 23, 99], [3, 4, 5])
    assert extra == 4 and set(stored_p) == {1}  # p borrowed q's block 1 and stores it under its own key: q's KV
    s._forget(stored_q[1])  # q's own block 1 leaves RAM
    p.note(s.build_meta(idle), [])
    req = NS(request_id="r", prompt_token_ids=[0, 1, 2, 3, 10, 11, 12, 13, 99])  # q's tokens: p's stored KV is r's
    hit = s.lookup(req, 0)[0]
    p.remember(req)
    assert (hit, p.borrow(req, 0, hit)) == (4, 0)


# Per-rank faults (issue 63): each tensor-parallel rank runs its own worker, keys its files by its rank
# (its fingerprint) and logs its own line per request; the harness sums a request's lines.


def ranks(tmp_path, n=3):
    """Fake ranks 0 and 1 of one TP2 server on one filesystem store: each stores blocks k0..k(n-1) of its own
    (rank 1's differ from rank 0's, as its heads do) under its own fingerprint; rank 1 can read rank 0's files."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    workers = []
    for rank in (0, 1):
        fp = f"{rank}" * 32  # the connector's fingerprint names the rank
        w = _FaultWorker(fp, B, RamTier(1 << 20), FsTier(str(tmp_path / "store"), fp, None))
        gen = torch.Generator().manual_seed(rank)
        w.register({f"layer{i}": torch.randn(16, HEADS, B, 6, generator=gen) for i in range(3)})
        w.kv_heads, w.fault_log, w.rank = HEADS, str(tmp_path / "faults.jsonl"), rank
        w.save(KVScopeMetadata(stores=[StoreSpec(j, f"k{j}", True, True) for j in range(n)]))
        w.flush()
        workers.append(w)
    workers[1].rank0 = FsTier(str(tmp_path / "store"), "0" * 32, None)
    workers[1].attach_rank0()
    return workers


def test_only_rank_0_loaded_leaves_every_slot_of_the_other_ranks_as_it_was(tmp_path):
    w0, w1 = ranks(tmp_path)
    before = w1.layers["layer0"][8:11].clone()
    got0, got1 = load(w0, "rank0-only"), load(w1, "rank0-only")
    assert all(torch.equal(got0[j]["layer0"], stored(w0, j)["layer0"]) for j in range(3))  # rank 0 loads
    assert all(torch.equal(got1[j]["layer0"], before[j]) for j in range(3))  # rank 1 keeps what it held
    assert [(e["fault"], e["changed"]) for e in log(tmp_path)] == [("rank0-only", 0), ("rank0-only", 3)]


def test_rank_1_got_rank_0s_heads_loads_rank_0s_file_for_each_of_its_blocks(tmp_path):
    w0, w1 = ranks(tmp_path)
    got0, got1 = load(w0, "rank0-heads"), load(w1, "rank0-heads")
    for j in range(3):
        assert all(torch.equal(got0[j][n], stored(w0, j)[n]) for n in w0.layers)
        assert all(torch.equal(got1[j][n], stored(w0, j)[n]) for n in w1.layers)  # rank 0's, not its own
        assert not torch.equal(stored(w1, j)["layer0"], stored(w0, j)["layer0"])  # its own heads differ
    assert [(e["fault"], e["changed"]) for e in log(tmp_path)] == [("rank0-heads", 0), ("rank0-heads", 3)]


def test_rank_0s_heads_where_rank_0_stored_no_file_is_the_right_kv_and_logged_so(tmp_path):
    w0, w1 = ranks(tmp_path)
    w1.rank0 = FsTier(str(tmp_path / "store"), "9" * 32, None)  # a fingerprint with no files
    w1.attach_rank0()
    got = load(w1, "rank0-heads")
    assert all(torch.equal(got[j]["layer0"], stored(w1, j)["layer0"]) for j in range(3))
    assert log(tmp_path)[-1]["changed"] == 0


@pytest.mark.parametrize("fault", RANK_FAULTS)
def test_a_per_rank_fault_on_a_one_rank_server_breaks_nothing_and_logs_no_change(tmp_path, fault):
    # a TP1 server has rank 0 only: the class cannot act, its log says so (the report: not measured)
    w = canary(tmp_path)
    got = load(w, fault)
    assert all(torch.equal(got[j]["layer0"], stored(w, j)["layer0"]) for j in range(3))
    assert log(tmp_path) == [{"request": "r1", "fault": fault, "loaded": 3, "changed": 0, "inherited": 0,
                              "distance": []}]


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_noise_on_an_fp8_cache_acts_on_its_values_not_on_its_byte_codes(tmp_path, fp8):
    """vLLM hands a connector an fp8 KV cache as uint8 codes: noise of 1e-2 of the values' spread moves the values
    by about that (rounded to fp8's steps), never into NaN or infinity, and the log's distance is in values."""
    w = _FaultWorker(FP, B, RamTier(1 << 20), None)
    gen = torch.Generator().manual_seed(0)
    w.register({f"layer{i}": torch.randn(16, HEADS, B, 64, generator=gen).to(fp8).view(torch.uint8)
                for i in range(3)})
    w.fp8, w.fault_log = fp8, str(tmp_path / "faults.jsonl")
    w.save(KVScopeMetadata(stores=[StoreSpec(j, f"k{j}", True, False) for j in range(3)]))
    w.flush()
    got = load(w, "noise-1e-2")
    for j in range(3):
        now, was = got[j]["layer0"].view(fp8).float(), stored(w, j)["layer0"].view(fp8).float()
        assert torch.isfinite(now).all()
        assert float((now - was).std() / was.std()) < 0.1  # byte noise moved them by whole steps: ~0.1-0.3
        assert float((now != was).float().mean()) < 0.5
    assert 0 < max(log(tmp_path)[0]["distance"]) < 0.2
