"""Keys, tiers and block verification, on real tensors and files (no server)."""

import os

import pytest
import torch

from kvscope_connector import keys
from kvscope_connector.store import FsTier, RamTier, checksum, decode


def block(seed=0, layers=2):
    gen = torch.Generator().manual_seed(seed)
    return {f"model.layers.{i}.self_attn.attn": torch.randn(2, 4, 8, generator=gen) for i in range(layers)}


FP = "f" * 32


def test_keys_chain_on_every_earlier_token_and_the_fingerprint():
    a = keys.block_keys(FP, list(range(10)), 4)
    assert len(a) == 2  # full blocks only
    assert keys.block_keys(FP, [99] + list(range(1, 10)), 4)[1] != a[1]  # an early token changes later keys
    assert keys.block_keys("e" * 32, list(range(10)), 4)[0] != a[0]
    assert keys.block_keys(FP, list(range(10)), 4, limit=1) == a[:1]


def test_fingerprint_covers_everything_that_changes_kv_bytes():
    base = dict(model_config={"hidden_size": 256}, weights="w", dtype="float32", kv_dtype="auto", block_size=64,
                layout="LBHNC", tp_rank=0, tp_size=1)
    fp = keys.fingerprint(**base)
    for field, other in (("model_config", {"hidden_size": 512}), ("weights", "w2"), ("dtype", "bfloat16"),
                         ("kv_dtype", "fp8"), ("block_size", 32), ("layout", "NHD"), ("tp_rank", 1), ("tp_size", 2)):
        assert keys.fingerprint(**{**base, field: other}) != fp, field


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
    size = sum(t.numel() * 4 for t in b.values())
    ram = RamTier(capacity_bytes=2 * size)
    ram.put("k1", b, checksum(b))
    ram.put("k2", b, checksum(b))
    ram.get("k1")
    assert ram.put("k3", b, checksum(b)) == 1  # evicts k2, the least recently used
    assert set(ram.blocks) == {"k1", "k3"} and ram.used == 2 * size


def test_fs_tier_round_trip_and_verification(tmp_path):
    fs = FsTier(str(tmp_path), FP, None)
    b = block()
    fs.write("ab12", b, checksum(b))
    assert fs.exists("ab12") and not list(tmp_path.rglob("*.tmp"))
    got, digest = decode(fs.read("ab12"), FP, "ab12", b)
    assert all(torch.equal(got[k], b[k]) for k in b) and digest == checksum(b)


@pytest.mark.parametrize("damage, message", [
    (lambda d: d[:-7], "unreadable"),                                     # truncated
    (lambda d: d[:-3] + bytes([d[-3] ^ 0xFF]) + d[-2:], "checksum"),    # one byte of one value flipped
])
def test_damaged_files_are_rejected(tmp_path, damage, message):
    fs = FsTier(str(tmp_path), FP, None)
    b = block()
    fs.write("ab12", b, checksum(b))
    with pytest.raises(ValueError, match=message):
        decode(damage(fs.read("ab12")), FP, "ab12", b)


def test_foreign_and_misshapen_blocks_are_rejected(tmp_path):
    b = block()
    foreign = FsTier(str(tmp_path), "e" * 32, None)
    foreign.write("ab12", b, checksum(b))
    with pytest.raises(ValueError, match="foreign"):
        decode(foreign.read("ab12"), FP, "ab12", b)
    fs = FsTier(str(tmp_path), FP, None)
    fs.write("cd34", b, checksum(b))
    with pytest.raises(ValueError, match="foreign"):
        decode(fs.read("cd34"), FP, "ab12", b)  # another block's file under this key
    wide = {k: torch.zeros(2, 4, 9) for k in b}
    with pytest.raises(ValueError, match="expected"):
        decode(fs.read("cd34"), FP, "cd34", wide)


def test_fs_tier_evicts_least_recently_used_files_within_its_capacity(tmp_path):
    b = block()
    probe = FsTier(str(tmp_path / "probe"), FP, None)
    probe.write("00aa", b, checksum(b))
    size = probe.used
    fs = FsTier(str(tmp_path), FP, capacity_bytes=2 * size)
    for key in ("00aa", "00bb"):
        fs.write(key, b, checksum(b))
    fs.read("00aa")
    assert fs.write("00cc", b, checksum(b)) == 1
    assert fs.exists("00aa") and not fs.exists("00bb") and fs.exists("00cc")
    assert FsTier(str(tmp_path), FP, None).used == 2 * size  # a new process accounts what is on disk


def test_quarantine_moves_a_bad_block_aside(tmp_path):
    fs = FsTier(str(tmp_path), FP, None)
    b = block()
    fs.write("ab12", b, checksum(b))
    fs.quarantine("ab12")
    assert not fs.exists("ab12") and list(tmp_path.rglob("*.corrupt"))
