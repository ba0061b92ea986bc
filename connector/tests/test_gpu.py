"""The connector's GPU path on a real GPU (skipped where there is none; run on the H200, docs/gpu.md): the
side stream, pinned pool slots, mix128 on the device, staged and checked loads."""

import pytest
import torch
from test_sides import slots_out

from kvscope_connector.blocks import fused_on, mix_digests
from kvscope_connector.devicereads import kvikio_reads
from kvscope_connector.loaders import KvikioLoader, SlotLoader
from kvscope_connector.messages import KVScopeMetadata, LoadSpec, StoreSpec
from kvscope_connector.savers import SlotSaver
from kvscope_connector.scheduler import placed
from kvscope_connector.store import FsTier, RamTier
from kvscope_connector.worker import WorkerSide

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
FP = "g" * 32
needs_kvikio = pytest.mark.skipif(not torch.cuda.is_available() or kvikio_reads(4) is None, reason="needs KvikIO")


def caches():
    gen = torch.Generator(device="cuda").manual_seed(0)
    return {f"layer{i}": torch.randn(64, 2, 32, 8, 128, device="cuda", generator=gen).to(torch.bfloat16)
            for i in range(3)}


def worker(tmp_path, ram=True, per_file=1, device_reads=False):
    w = WorkerSide(FP, 32, RamTier(1 << 26) if ram else None,  # the pool pinned at register: a segment or two
                   None if ram else FsTier(str(tmp_path), FP, None, per_file=per_file), checksum="mix128",
                   backlog=1 << 26, device_reads=device_reads)
    w.register(caches())
    w.device_copies.chunk = 3  # eight loads span three staged chunks
    return w


@pytest.mark.parametrize("words", [589_824, 294_912, 8192, 2 * 4096 + 5, 16], ids=lambda w: f"{w}-words")
def test_mix128_on_the_gpu_is_mix128_on_the_host_and_runs_the_fused_kernel(words):
    # the Qwen3-4B shape's blocks of 32 and 16 tokens, and widths Triton compiles differently
    rows = torch.randint(0, 256, (6, 8 * words), dtype=torch.uint8)
    assert torch.equal(mix_digests(rows.cuda()).cpu(), mix_digests(rows))
    assert torch.equal(mix_digests(rows.cuda(), fused=False).cpu(), mix_digests(rows))
    assert fused_on(torch.device("cuda"), 8 * words), "mix128's fused kernel does not run here (the log says why)"


@pytest.mark.parametrize("ram, per_file", [(True, 1), (False, 1), (False, 3)], ids=["ram", "files", "files-of-3"])
def test_blocks_saved_from_the_gpu_load_back_exactly_from_pinned_slots(tmp_path, ram, per_file):
    w = worker(tmp_path, ram, per_file)
    assert w.on_device and w.side.stream is not None
    assert (type(w.loader), type(w.store_path)) == (SlotLoader, SlotSaver)  # register's pick beside a GPU
    where = placed([f"k{i}" for i in range(8)], per_file)  # files of 3 blocks: 0-2, 3-5, 6-7
    w.save(KVScopeMetadata(stores=[StoreSpec(i, f"k{i}", ram, not ram, file=where[i].file) for i in range(8)]))
    w.flush()
    assert all(s.is_pinned() for s in w.pool.segments)
    w.load(KVScopeMetadata(loads=[LoadSpec(16 + i, f"k{i}", "ram" if ram else "fs", request_id="r", index=i,
                                           file=where[i].file, offset=where[i].offset, count=where[i].count)
                                  for i in range(8)]))
    torch.cuda.synchronize()
    assert w.take_load_errors() == set()
    assert all(torch.equal(t[16:24], t[:8]) for t in w.layers.values())


def test_the_pool_is_pinned_at_registration_for_the_ram_tier_and_the_save_backlog_and_saves_never_grow_it(
        tmp_path):
    # pinning on the forward thread held a save 700-811 ms per 2.4 GB while the RAM tier filled (H100)
    w = WorkerSide(FP, 32, RamTier(1 << 27), None, checksum="mix128", backlog=1 << 26)
    w.register(caches())
    held = len(w.pool.segments) * w.pool.per_segment
    assert held * w.pool.block_bytes >= (1 << 27) + (1 << 26) and all(s.is_pinned() for s in w.pool.segments)
    segments = len(w.pool.segments)
    for r in range(32):  # 2048 blocks of 393 KB: more than the pool's slots, the tier (341 blocks) evicting
        w.save(KVScopeMetadata(stores=[StoreSpec(i, f"r{r}-{i}", True, False) for i in range(64)]))
    w.flush()
    assert len(w.pool.segments) == segments and w.take_stats().evictions > 0


@needs_kvikio
def test_files_read_by_kvikio_into_gpu_memory_load_back_exactly_and_a_changed_byte_is_caught(tmp_path):
    w = worker(tmp_path, ram=False, per_file=3, device_reads=True)
    assert (type(w.loader), type(w.store_path)) == (KvikioLoader, SlotSaver)
    where = placed([f"k{i}" for i in range(8)], 3)
    w.save(KVScopeMetadata(stores=[StoreSpec(i, f"k{i}", False, True, file=where[i].file) for i in range(8)]))
    w.flush()
    in_use = slots_out(w)

    def load(first):
        w.load(KVScopeMetadata(loads=[LoadSpec(16 + i, f"k{i}", "fs", request_id="r", index=i, file=where[i].file,
                                               offset=where[i].offset, count=where[i].count)
                                      for i in range(first, 8)]))
        torch.cuda.synchronize()
    load(1)  # from inside the first file
    assert w.take_load_errors() == set() and w.stats.fs_hits == 7
    assert all(torch.equal(t[17:24], t[1:8]) for t in w.layers.values())
    assert slots_out(w) <= in_use  # no pinned slot was taken
    path = w.fs.path(where[4].file)
    data = bytearray(path.read_bytes())
    data[-w.layout.nbytes - 1] ^= 0x01  # the last byte of block 4
    path.write_bytes(bytes(data))
    for t in w.layers.values():
        t[16:24].zero_()
    load(0)
    assert w.take_load_errors() == {20} and w.stats.corrupt == 1 and path.with_suffix(".corrupt").exists()
    assert all(torch.equal(t[16:20], t[:4]) and not t[20:24].any() for t in w.layers.values())


@needs_kvikio
def test_with_a_store_secret_reads_into_gpu_memory_are_refused_as_its_macs_are_checked_on_the_host(tmp_path):
    w = WorkerSide(FP, 32, None, FsTier(str(tmp_path), FP, None, secret=b"s" * 32), checksum="mix128",
                   device_reads=True)
    with pytest.raises(ValueError, match="no store secret"):
        w.register(caches())


def test_a_changed_pinned_slot_is_caught_on_the_gpu_and_stops_its_request(tmp_path):
    w = worker(tmp_path)
    w.save(KVScopeMetadata(stores=[StoreSpec(i, f"k{i}", True, False) for i in range(8)]))
    w.flush()
    w.ram.blocks["k4"][0][100] ^= 1  # one bit of one block in host memory
    before = w.layers["layer0"][20:24].clone()
    w.load(KVScopeMetadata(loads=[LoadSpec(16 + i, f"k{i}", "ram", request_id="r", index=i) for i in range(8)]))
    torch.cuda.synchronize()
    assert w.take_load_errors() == {20} and w.stats.corrupt == 1 and not w.ram.contains("k4")
    assert all(torch.equal(t[16:20], t[:4]) for t in w.layers.values())
    assert torch.equal(w.layers["layer0"][20:24], before)


@pytest.mark.parametrize("ids", [list(range(8)), list(range(40, 32, -1)), [9, 10, 11, 2, 3, 60, 61, 0],
                                 [17, 3, 25, 9, 12, 4, 30, 1, 22, 6, 14, 27, 19, 11]])
def test_blocks_cross_the_gpu_in_any_order_of_their_ids(tmp_path, ids):
    w = worker(tmp_path)
    paths = w.device_copies
    packed = paths.gather(ids)
    one_by_one = torch.stack([torch.cat([t[i].reshape(-1).view(torch.uint8) for _, t in sorted(w.layers.items())])
                              for i in ids])
    assert torch.equal(packed, one_by_one)
    targets = [(i * 7 + 5) % 64 for i in range(len(ids))]
    paths.write(packed.flip(0), targets)
    assert torch.equal(paths.gather(targets), packed.flip(0))
