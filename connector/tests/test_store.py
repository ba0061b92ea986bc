"""Keys, tiers and block verification, on real tensors and files (no server)."""

import os
import stat
import tracemalloc

import pytest
import torch

from kvscope_connector import keys
from kvscope_connector.blocks import CorruptBlock, Layout, checksum
from kvscope_connector.store import FsTier, RamTier


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
                         ("signer", keys.secret_id(b"s" * 16))):
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
