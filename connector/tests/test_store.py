"""Keys, tiers and block verification, on real tensors and files (no server)."""

import os
import stat
import tracemalloc

import numpy as np
import pytest
import torch

from kvscope_connector import keys
from kvscope_connector.blocks import CorruptBlock, Layout, checksum, digest_hex, mix128, mix_digests, position_keys
from kvscope_connector.store import FsTier, RamTier
from kvscope_connector.transfer import SEGMENT_BYTES, Side, SlotPool


def layers(seed=0, width=8):
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(2, 4, width, generator=gen) for i in (1, 0)}


LAYOUT = Layout(layers())
FP = "f" * 32


def block(seed=0):
    return LAYOUT.pack(layers(seed))


def write(fs, key, b):
    return fs.put(key, b, checksum(b))


def tier(root, fp=FP, layout=LAYOUT, capacity=None):
    return FsTier(str(root), fp, capacity, layout=layout)


def test_a_block_is_its_layers_bytes_in_name_order():
    t = layers()
    b = LAYOUT.pack(t)
    assert b.dtype == torch.uint8 and b.numel() == LAYOUT.nbytes == 2 * 2 * 4 * 8 * 4
    assert [e.name for e in LAYOUT.entries] == sorted(t)
    assert all(torch.equal(v, t[name]) for name, v in LAYOUT.views(b).items())
    assert torch.equal(b[:LAYOUT.nbytes // 2].view(torch.float32), t["model.layers.0.self_attn.attn"].reshape(-1))


def test_keys_chain_on_every_earlier_token_and_the_fingerprint():
    a = keys.block_keys(FP, list(range(10)), 4)
    assert len(a) == 2  # full blocks only
    assert keys.block_keys(FP, [99] + list(range(1, 10)), 4)[1] != a[1]  # an early token changes later keys
    assert keys.block_keys("e" * 32, list(range(10)), 4)[0] != a[0]
    assert keys.block_keys(FP, list(range(10)), 4, limit=1) == a[:1]


def test_fingerprint_covers_everything_that_changes_kv_bytes():
    stack = {"vllm": "0.32.0", "platform": "cpu", "device_capability": None, "attention_backend": "auto"}
    base = dict(model_config={"hidden_size": 256}, weights="w", dtype="float32", kv_dtype="auto", block_size=64,
                layout="LBHNC", tp_rank=0, tp_size=1, stack=stack, signer="")
    fp = keys.fingerprint(**base)
    for field, other in (("model_config", {"hidden_size": 512}), ("weights", "w2"), ("dtype", "bfloat16"),
                         ("kv_dtype", "fp8"), ("block_size", 32), ("layout", "NHD"), ("tp_rank", 1), ("tp_size", 2),
                         ("stack", {**stack, "vllm": "0.33.0"}), ("stack", {**stack, "attention_backend": "FLASH"}),
                         ("signer", keys.secret_id(b"s" * 16)), ("checksum", "mix128"),
                         # online quantization of the same checkpoint, another revision of a hub model
                         ("quantization", "fp8"), ("revision", "0123abc")):
        assert keys.fingerprint(**{**base, field: other}) != fp, field


def test_weights_identity_sees_a_change_in_the_middle_of_a_weight_file(tmp_path):
    model, cache = tmp_path / "model", tmp_path / "cache"
    model.mkdir()
    (model / "config.json").write_text("{}")
    weights = bytearray(os.urandom(4 << 20))
    (model / "model.safetensors").write_bytes(weights)
    before = keys.weights_identity(str(model), str(cache))
    assert list(cache.rglob("*.sha256"))  # the full hash is cached by size and mtime
    assert keys.weights_identity(str(model), str(cache)) == before
    weights[2 << 20] ^= 1  # an in-place update that keeps the size and both ends
    (model / "model.safetensors").write_bytes(weights)
    assert keys.weights_identity(str(model), str(cache)) != before


def test_the_store_secret_comes_from_env_or_a_file_and_is_not_weak(tmp_path, monkeypatch):
    monkeypatch.delenv(keys.SECRET_ENV, raising=False)
    monkeypatch.delenv(keys.SECRET_FILE_ENV, raising=False)
    assert keys.store_secret() is None
    monkeypatch.setenv(keys.SECRET_ENV, "k" * 32)
    assert keys.store_secret() == b"k" * 32
    (tmp_path / "key").write_text("f" * 20 + "\n")
    monkeypatch.setenv(keys.SECRET_FILE_ENV, str(tmp_path / "key"))
    assert keys.store_secret() == b"f" * 20
    monkeypatch.setenv(keys.SECRET_FILE_ENV, "")
    monkeypatch.setenv(keys.SECRET_ENV, "short")
    with pytest.raises(ValueError, match="at least 16"):
        keys.store_secret()


def test_weights_identity_differs_between_seeds(tmp_path):
    for name, seed in (("a", 0), ("b", 1)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text("{}")
        torch.manual_seed(seed)
        (tmp_path / name / "model.safetensors").write_bytes(os.urandom(16) + bytes(range(256)) * 10)
    assert keys.weights_identity(str(tmp_path / "a")) != keys.weights_identity(str(tmp_path / "b"))
    assert keys.weights_identity("Qwen/Qwen3-8B") == ""


def test_ram_tier_is_an_lru_bounded_in_bytes():
    b = block()
    size = LAYOUT.nbytes
    ram = RamTier(capacity_bytes=2 * size)
    ram.put("k1", b, checksum(b))
    ram.put("k2", b, checksum(b))
    ram.get("k1")
    assert ram.put("k3", b, checksum(b)) == 1  # evicts k2, the least recently used
    assert set(ram.blocks) == {"k1", "k3"} and ram.used == 2 * size
    ram.blocks["k1"][0][0] += 1  # a stray write into the tier's copy
    with pytest.raises(CorruptBlock, match="checksum"):
        ram.get("k1")


def test_fs_tier_round_trip_and_verification(tmp_path):
    fs = tier(tmp_path)
    b = block()
    write(fs, "ab12", b)
    assert fs.contains("ab12") and not list(tmp_path.rglob("*.tmp"))
    got, digest = fs.get("ab12")
    assert torch.equal(got, b) and digest == checksum(b)
    assert fs.get("ffff") is None


def put_run(fs, n=4, first_seed=0):
    """n blocks of a prompt in one file, named by the last one's key; returns (keys, blocks)."""
    keys = [f"k{i}" for i in range(n)]
    blocks = [block(first_seed + i) for i in range(n)]
    fs.put_file(keys[-1], [(k, b, checksum(b)) for k, b in zip(keys, blocks)])
    return keys, blocks


def test_a_file_of_several_blocks_gives_any_run_of_them_each_checked_on_its_own(tmp_path):
    from safetensors.torch import load
    fs = tier(tmp_path)
    keys, blocks = put_run(fs)
    assert [p.name for p in fs.dir.rglob("*.safetensors")] == ["k3.safetensors"]
    tensors = load(fs.path("k3").read_bytes())  # safetensors reads it: block i's layer NAME is "i/NAME"
    assert all(torch.equal(tensors[f"{i}/{name}"], t) for i in range(4) for name, t in LAYOUT.views(blocks[i]).items())
    got = fs.get_file("k3", keys[1:3], 1, 4)
    assert [torch.equal(g, b) for (g, _), b in zip(got, blocks[1:3])] == [True, True]
    assert [d for _, d in got] == [checksum(b) for b in blocks[1:3]]
    with pytest.raises(CorruptBlock, match="foreign"):  # the keys a load expects are the keys stored there
        fs.get_file("k3", ["k1", "other"], 1, 4)
    with pytest.raises(CorruptBlock, match="truncated or padded"):  # a file of another length
        fs.get_file("k3", keys[:1], 0, 3)
    data = bytearray(fs.path("k3").read_bytes())
    data[-LAYOUT.nbytes - 5] ^= 0xFF  # block 2's last bytes
    fs.path("k3").write_bytes(bytes(data))
    assert len(fs.get_file("k3", keys[:2], 0, 4)) == 2  # blocks before the damage still verify
    with pytest.raises(CorruptBlock, match="checksum mismatch \\(block 2"):
        fs.get_file("k3", keys[1:3], 1, 4)


def test_a_file_of_several_blocks_is_read_in_one_call_from_its_start_and_two_from_within(tmp_path, monkeypatch):
    # fewer, larger reads: a file's blocks in one preadv (the header with them when they begin the file)
    fs = tier(tmp_path)
    keys, blocks = put_run(fs, 6)
    calls = []
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: calls.append(len(bufs)) or preadv(fd, bufs, offset))
    assert len(fs.get_file("k5", keys, 0, 6)) == 6 and calls == [7]
    calls.clear()
    got = fs.get_file("k5", keys[4:], 4, 6)
    assert calls == [1, 2] and all(torch.equal(g, b) for (g, _), b in zip(got, blocks[4:]))


def test_with_a_secret_every_block_of_a_file_is_signed(tmp_path):
    signed = FsTier(str(tmp_path), FP, None, layout=LAYOUT, secret=b"s" * 32)
    keys, blocks = put_run(signed, 3)
    assert torch.equal(signed.get_file("k2", keys[2:], 2, 3)[0][0], blocks[2])
    other = FsTier(str(tmp_path), FP, None, layout=LAYOUT, secret=b"t" * 32)
    with pytest.raises(CorruptBlock, match="not signed with this store's secret"):
        other.get_file("k2", keys[2:], 2, 3)


@pytest.mark.parametrize("per_file", [0, 257, 2.0, True])
def test_blocks_per_file_outside_what_one_call_reads_are_refused(tmp_path, per_file):
    with pytest.raises(ValueError, match="blocks per file"):
        FsTier(str(tmp_path), FP, None, per_file=per_file)


@pytest.mark.parametrize("like", [layers(), {"a": torch.ones(4, dtype=torch.bfloat16), "b": torch.arange(4.0)}],
                         ids=["layout", "mixed-dtypes"])
def test_a_block_file_is_a_safetensors_file_of_its_layers(tmp_path, like):
    # the header is written beside the block's own buffer (no copy); safetensors' own reader must agree
    from safetensors.torch import load
    layout = Layout(like)
    b = layout.pack(like)
    fs = FsTier(str(tmp_path), FP, None, layout=layout, secret=b"s" * 32)
    fs.put("ab12", b, checksum(b))
    data = fs.path("ab12").read_bytes()
    assert int.from_bytes(data[:8], "little") % 8 == 0  # the data begins 8-byte aligned, as safetensors writes
    assert {name: t.tolist() for name, t in load(data).items()} == {f"0/{name}": t.tolist() for name, t in like.items()}
    assert torch.equal(fs.get("ab12")[0], b)


def test_the_header_names_the_tensors_as_safetensors_writes_them_and_refuses_a_dtype_it_cannot_name(tmp_path):
    # files written by safetensors' own writer (earlier versions, on a shared store) keep the quick check
    from safetensors.torch import save

    from kvscope_connector import fileformat
    from kvscope_connector.worker import WorkerSide
    theirs = save({f"0/{name}": t for name, t in LAYOUT.views(block()).items()}, metadata={"kvscope_format": "4"})
    ours = fileformat.header([block()], LAYOUT, FP, "ab12", ["ab12"], ["0" * 32])
    after_meta = [data[8:8 + int.from_bytes(data[:8], "little")].split(b"}", 1)[1].rstrip() for data in (theirs, ours)]
    assert after_meta[0] == after_meta[1] and theirs.startswith(b'{"__metadata__":', 8)
    w = WorkerSide(FP, 2, None, tier(tmp_path))
    with pytest.raises(ValueError, match="no block format for KV caches of torch.uint16"):
        w.register({"layer": torch.zeros(4, 2, dtype=torch.uint16)})


@pytest.mark.parametrize("damage, message", [
    (lambda d: d[:-7], "truncated"),
    (lambda d: d + b"\0", "padded"),
    (lambda d: d[:-3] + bytes([d[-3] ^ 0xFF]) + d[-2:], "checksum"),    # one byte of one value flipped
    (lambda d: d[:9] + b"#" + d[10:], "unreadable"),                     # the JSON header broken
])
def test_damaged_files_are_rejected(tmp_path, damage, message):
    fs = tier(tmp_path)
    write(fs, "ab12", block())
    fs.path("ab12").write_bytes(damage(fs.path("ab12").read_bytes()))
    with pytest.raises(CorruptBlock, match=message):
        fs.get("ab12")


def test_foreign_and_misshapen_blocks_are_rejected(tmp_path):
    b = block()
    foreign = tier(tmp_path, fp="e" * 32)
    write(foreign, "ab12", b)
    mine = tier(tmp_path)
    mine.path("ab12").parent.mkdir(parents=True)
    mine.path("ab12").write_bytes(foreign.path("ab12").read_bytes())  # another server's file, planted here
    with pytest.raises(CorruptBlock, match="foreign"):
        mine.get("ab12")
    write(mine, "cd34", b)
    mine.path("ab12").write_bytes(mine.path("cd34").read_bytes())  # another block's file under this key
    with pytest.raises(CorruptBlock, match="foreign"):
        mine.get("ab12")
    with pytest.raises(CorruptBlock, match="expected"):
        tier(tmp_path, layout=Layout(layers(width=9))).get("cd34")
    bf16 = {name: t.bfloat16() for name, t in layers(width=16).items()}  # as many bytes, another dtype
    with pytest.raises(CorruptBlock, match="expected"):
        tier(tmp_path, layout=Layout(bf16)).get("cd34")


def test_fs_tier_evicts_least_recently_used_files_within_its_capacity(tmp_path):
    b = block()
    probe = tier(tmp_path / "probe")
    write(probe, "00aa", b)
    size = probe.used
    fs = tier(tmp_path, capacity=2 * size)
    for key in ("00aa", "00bb"):
        write(fs, key, b)
    fs.get("00aa")
    assert write(fs, "00cc", b) == 1
    assert fs.contains("00aa") and not fs.contains("00bb") and fs.contains("00cc")
    assert FsTier(str(tmp_path), FP, None).used == 2 * size  # a new process accounts what is on disk


def test_a_file_of_the_wrong_size_is_refused_before_it_is_read(tmp_path):
    fs = tier(tmp_path)
    write(fs, "ab12", block())
    with open(fs.path("ab12"), "r+b") as f:
        f.truncate(256 << 20)  # sparse: costs no disk, would cost 256 MiB of memory to read
    tracemalloc.start()
    with pytest.raises(CorruptBlock, match="padded"):
        fs.get("ab12")
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 1 << 20


def test_saves_never_follow_a_planted_link_and_keep_the_store_private(tmp_path):
    fs = tier(tmp_path)
    victim = tmp_path / "victim"
    victim.write_text("precious")
    write(fs, "cd34", block())
    final = fs.path("ab12")
    final.parent.mkdir()
    for pid in range(os.getpid() - 50, os.getpid() + 50):  # the temp names a predictable writer would use
        (final.parent / f".{final.name}.{pid}.tmp").symlink_to(victim)
    final.symlink_to(victim)
    with pytest.raises(CorruptBlock, match="symbolic link"):
        fs.get("ab12")  # a planted block file that is a link is never followed on a read
    write(fs, "ab12", block())
    assert victim.read_text() == "precious" and not final.is_symlink()
    assert torch.equal(fs.get("ab12")[0], block())
    assert stat.S_IMODE(final.stat().st_mode) == 0o600
    assert stat.S_IMODE(fs.dir.stat().st_mode) == 0o700 and stat.S_IMODE(fs.path("cd34").parent.stat().st_mode) == 0o700


def test_with_a_secret_only_signed_blocks_load(tmp_path):
    secret = b"s" * 32
    signed = FsTier(str(tmp_path), FP, None, layout=LAYOUT, secret=secret)
    write(signed, "ab12", block())
    assert torch.equal(signed.get("ab12")[0], block())
    unsigned = tier(tmp_path)
    write(unsigned, "cd34", block(1))  # a host without the secret: a valid block, checksum and all
    with pytest.raises(CorruptBlock, match="signed"):
        signed.get("cd34")
    other = FsTier(str(tmp_path), FP, None, layout=LAYOUT, secret=b"t" * 32)
    write(other, "ef56", block(2))
    with pytest.raises(CorruptBlock, match="signed"):
        signed.get("ef56")


def test_a_bad_block_is_moved_aside(tmp_path):
    fs = tier(tmp_path)
    write(fs, "ab12", block())
    fs.discard("ab12")
    assert not fs.contains("ab12") and list(tmp_path.rglob("*.corrupt"))


def mix128_reference(data: bytes) -> str:
    """mix128 in NumPy's wrapping uint64 arithmetic, written from its definition (blocks.py)."""
    w = np.frombuffer(data, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = w * position_keys(len(w))
        z ^= z >> np.uint64(32)
        z *= np.uint64(0x9E3779B97F4A7C15)
        first = int(z.sum(dtype=np.uint64))
        z ^= z >> np.uint64(29)
        z *= np.uint64(0xBF58476D1CE4E5B9)
        return f"{first:016x}{int(z.sum(dtype=np.uint64)):016x}"


def test_mix128_is_its_definition_batched_or_not():
    gen = torch.Generator().manual_seed(3)
    rows = torch.randint(0, 256, (5, 4096), dtype=torch.uint8, generator=gen)
    batched = mix_digests(rows).tolist()
    for row, pair in zip(rows, batched):
        assert mix128(row) == mix128_reference(row.numpy().tobytes()) == digest_hex(pair)


def test_mix128_sees_every_flipped_bit_moved_words_and_zeroed_or_foreign_blocks():
    gen = torch.Generator().manual_seed(4)
    b = torch.randint(0, 256, (8192,), dtype=torch.uint8, generator=gen)
    digest, seen = mix128(b), set()
    for bit in range(0, 8192 * 8, 61):  # a bit in every byte position class, low and high bits of words
        flipped = b.clone()
        flipped[bit // 8] ^= 1 << (bit % 8)
        seen.add(mix128(flipped))
    assert digest not in seen and len(seen) == len(range(0, 8192 * 8, 61))
    words = b.view(torch.int64)
    swapped = words.clone()
    swapped[[3, 700]] = swapped[[700, 3]]
    late = torch.cat([words[:1], words[:-1]])  # every word one position late
    others = [swapped.view(torch.uint8), late.view(torch.uint8), torch.zeros_like(b), block().repeat(32)[:8192]]
    assert digest not in {mix128(x) for x in others}


def test_slot_pool_hands_out_distinct_slots_in_power_of_two_segments_and_reuses_returned_ones():
    pool = SlotPool(4_718_592, Side(torch.device("cpu")), pinned=False)  # a Qwen3-4B block of bf16 KV
    slots = [pool.take() for _ in range(pool.per_segment + 1)]
    assert len(pool.segments) == 2 and {s.numel() for s in pool.segments} <= {SEGMENT_BYTES} | {
        pool.per_segment * 4_718_592}
    assert len({s.data_ptr() for s in slots}) == len(slots) and all(s.numel() == 4_718_592 for s in slots)
    rest = pool.take_many(len(pool.free))
    pool.give_back(slots[0])
    assert pool.take().data_ptr() == slots[0].data_ptr() and len(pool.segments) == 2 and rest


def test_slot_pool_reserved_ahead_hands_out_that_many_slots_without_growing():
    pool = SlotPool(4_718_592, Side(torch.device("cpu")), pinned=False)
    pool.reserve(2 * pool.per_segment * 4_718_592 + 1)  # a byte more than two segments' slots: a third
    assert len(pool.segments) == 3 and len(pool.free) == 3 * pool.per_segment
    pool.take_many(len(pool.free))
    assert len(pool.segments) == 3
    pool.reserve(SEGMENT_BYTES)  # what it holds already counts: taken slots are the pool's too
    assert len(pool.segments) == 3


def test_slot_pool_counts_the_time_it_spends_growing_past_its_reserve_once():
    pool = SlotPool(1 << 20, Side(torch.device("cpu")), pinned=False)
    pool.reserve(pool.per_segment << 20)
    pool.take_many(pool.per_segment)  # the reserve: no growing
    assert pool.take_grow_seconds() == 0
    pool.take_many(1)  # past it: a segment more, on the taker's thread
    grew = pool.take_grow_seconds()
    assert grew > 0 and len(pool.segments) == 2
    assert pool.take_grow_seconds() == 0  # taken once


def test_slot_pool_hands_out_neighbours_that_one_copy_fills_and_spans_find_them():
    pool = SlotPool(1 << 20, Side(torch.device("cpu")), pinned=False)
    first = pool.take_many(pool.per_segment)
    assert [(i, n) for i, n, _ in pool.spans(first)] == [(0, pool.per_segment)]  # a new segment: one run
    for i in (7, 2, 3):
        pool.give_back(first[i])
    again = pool.take_many(3)  # the three given back, in address order
    assert [s.data_ptr() for s in again] == [first[i].data_ptr() for i in (2, 3, 7)]
    runs = list(pool.spans(again))
    assert [(i, n) for i, n, _ in runs] == [(0, 2), (2, 1)]  # 2 and 3 lie side by side, 7 apart
    for i, n, host in runs:  # each run's tensor is those slots' own memory
        host.fill_(i + 1)
        assert all(int(again[k][0]) == i + 1 and host[k - i].data_ptr() == again[k].data_ptr()
                   for k in range(i, i + n))
    across = pool.take_many(pool.per_segment + 1)  # more than a segment: never one run across segments
    assert all(n <= pool.per_segment for _, n, _ in pool.spans(across)) and len(pool.segments) >= 2
    own = torch.zeros(1 << 20, dtype=torch.uint8)  # a buffer that is no slot: a run of its own
    assert [(i, n, t.data_ptr()) for i, n, t in pool.spans([own, across[0]])] == [
        (0, 1, own.data_ptr()), (1, 1, across[0].data_ptr())]


def test_ram_tier_in_pool_slots_keeps_owned_blocks_and_gives_back_what_it_drops():
    b = block()
    ram = RamTier(capacity_bytes=2 * LAYOUT.nbytes)
    ram.pool = SlotPool(LAYOUT.nbytes, Side(torch.device("cpu")), pinned=False)
    mine = ram.pool.take().copy_(b)
    ram.put("k1", mine, checksum(b), owned=True)
    assert ram.get("k1")[0].data_ptr() == mine.data_ptr()  # kept, not copied
    twice = ram.pool.take().copy_(b)
    ram.put("k1", twice, checksum(b), owned=True)  # already stored: the slot goes back
    ram.put("k2", b, checksum(b))  # not owned: copied into a slot of the pool
    ram.put("k3", b, checksum(b))  # evicts k1
    pool = ram.pool
    held = lambda: pool.per_segment * len(pool.segments) - len(pool.free) - len(pool.returned)  # noqa: E731
    assert held() == 4 and not ram.contains("k1")  # what it dropped goes back on release(), not before
    ram.release()
    assert held() == 2
    ram.clear()
    assert held() == 2 and ram.used == 0
    ram.release()
    assert held() == 0


def test_spans_run_blocks_of_their_own_only_within_one_allocation_and_never_past_a_block():
    # Blocks that are not pool slots (reads into device memory) lying side by side in one tensor are one
    # run; never blocks of two allocations that merely touch, and a short or strided block stays its own
    # bytes (a view past it would read another block's).
    bb = 1 << 16
    pool = SlotPool(bb, Side(torch.device("cpu")), pinned=False)
    pool.take()  # a segment exists
    buf = bytearray(4 * bb)
    a = torch.frombuffer(memoryview(buf)[:2 * bb], dtype=torch.uint8).view(2, bb)
    b = torch.frombuffer(memoryview(buf)[2 * bb:], dtype=torch.uint8).view(2, bb)
    assert b.data_ptr() == a.data_ptr() + 2 * bb and a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
    runs = list(pool.spans([a[0], a[1], b[0], b[1]]))
    assert [n for _, n, _ in runs] == [2, 2] and torch.equal(runs[0][2], a) and torch.equal(runs[1][2], b)
    base = torch.arange(4 * bb, dtype=torch.int64).to(torch.uint8)
    short, strided = base[:bb // 2], base[:2 * bb:2]
    for block in (short, strided):
        [(_, n, t)] = list(pool.spans([block]))
        assert n == 1 and torch.equal(t.reshape(-1), block)
    two = base[:2 * bb].view(2, bb)
    assert [n for _, n, _ in pool.spans([two[0], short, two[1]])] == [1, 1, 1]

