"""File reads straight into device memory (KvikIO's place in a load checked on the GPU), here on the CPU's
tensors with a reader that reads as KvikIO's does: one call per file, into the tensor given, at the offset
given. The same path with KvikIO on a GPU: test_gpu.py."""

import os
import sys
import types
from dataclasses import replace

import pytest
import torch
from test_sides import slots_out

from kvscope_connector.devicereads import kvikio_reads
from kvscope_connector.loaders import KvikioLoader
from kvscope_connector.messages import KVScopeMetadata, LoadSpec, StoreSpec
from kvscope_connector.scheduler import placed
from kvscope_connector.store import FsTier, RamTier
from kvscope_connector.worker import WorkerSide

FP, B, N = "d" * 32, 4, 8


def caches():
    gen = torch.Generator().manual_seed(1)
    return {f"layer{i}": torch.randn(2 * N, 2, B, 6, generator=gen) for i in range(2)}


def stored(tmp_path, per_file=3):
    """A worker checking on the device whose file reads go to `reads` (a list of (inode, offset, blocks)),
    with blocks k0..k7 stored in files of per_file; returns it and where each block lies."""
    w = WorkerSide(FP, B, None, FsTier(str(tmp_path), FP, None, per_file=per_file), checksum="mix128",
                   on_device=True)
    w.register(caches())
    w.device_copies.chunk = 2  # eight loads span four staged chunks
    where = placed([f"k{i}" for i in range(N)], per_file)  # files of 3 blocks: 0-2, 3-5, 6-7
    w.save(KVScopeMetadata(stores=[StoreSpec(i, f"k{i}", False, True, file=where[i].file) for i in range(N)]))
    w.flush()
    w.reads = []

    def read(fd, into, offset):
        w.reads.append((os.fstat(fd).st_ino, offset, into.shape[0]))
        return os.preadv(fd, [into.numpy()], offset)
    w.load_handler = KvikioLoader(replace(w.loader.media, reads=read))
    return w, where


def loads(where, blocks):
    return KVScopeMetadata(loads=[LoadSpec(N + i, f"k{i}", "fs", request_id="r", index=i,
                                           file=where[i].file, offset=where[i].offset, count=where[i].count)
                                  for i in blocks])


def test_each_file_is_one_read_into_device_memory_past_its_header_and_no_host_slot_is_taken(tmp_path):
    w, where = stored(tmp_path)
    segments = len(w.pool.segments)
    w.load(loads(where, range(1, N)))  # from block 1: inside the first file
    assert w.take_load_errors() == set() and w.stats.fs_hits == N - 1
    assert all(torch.equal(t[N + 1:], t[1:N]) for t in w.layers.values())
    block, expected = w.layout.nbytes, []
    for f, first, n in ((where[1], 1, 2), (where[3], 0, 3), (where[6], 0, 2)):  # the first file from its block 1
        st = w.fs.path(f.file).stat()
        expected.append((st.st_ino, st.st_size - f.count * block + first * block, n))  # past the header
    assert sorted(w.reads) == sorted(expected)
    assert len(w.pool.segments) == segments and slots_out(w) == 0


def test_a_changed_byte_read_into_device_memory_is_caught_there_and_stops_its_request(tmp_path):
    w, where = stored(tmp_path)
    path = w.fs.path(where[4].file)  # the second file: blocks 3-5
    data = bytearray(path.read_bytes())
    data[-w.layout.nbytes - 1] ^= 0x01  # the last byte of block 4
    path.write_bytes(bytes(data))
    before = w.layers["layer0"][N + 4:].clone()
    w.load(loads(where, range(N)))
    assert w.take_load_errors() == {N + 4} and w.stats.corrupt == 1
    assert all(torch.equal(t[N:N + 4], t[:4]) for t in w.layers.values())
    assert torch.equal(w.layers["layer0"][N + 4:], before)  # block 4 and every block after it: recomputed
    assert path.with_suffix(".corrupt").exists()


def test_a_read_that_fails_is_a_counted_miss_and_its_file_stays(tmp_path):
    w, where = stored(tmp_path)

    def failing(fd, into, offset):
        raise OSError("KvikIO: an I/O error")
    w.loader.reads = failing
    before = w.layers["layer0"][N:].clone()
    w.load(loads(where, range(N)))
    assert w.take_load_errors() == set(range(N, 2 * N)) and w.stats.io_errors == N
    assert torch.equal(w.layers["layer0"][N:], before) and w.fs.path(where[0].file).exists()


def test_a_link_or_a_foreign_header_is_refused_before_anything_is_read_into_device_memory(tmp_path):
    w, where = stored(tmp_path)
    first, second = w.fs.path(where[0].file), w.fs.path(where[3].file)
    first.unlink()
    first.symlink_to(second)  # a link, to a file of the right size
    w.load(loads(where, range(3)))
    assert w.take_load_errors() == {N, N + 1, N + 2} and w.reads == [] and w.stats.corrupt == 3


def test_reads_into_device_memory_that_cannot_be_had_are_refused_at_registration(tmp_path):
    w = WorkerSide(FP, B, None, FsTier(str(tmp_path), FP, None), checksum="mix128", on_device=True,
                   device_reads=True)
    with pytest.raises(ValueError, match="kvikio"):
        w.register(caches())  # no GPU here


def test_a_ram_tier_beside_reads_into_device_memory_is_refused_at_registration(tmp_path):
    w = WorkerSide(FP, B, RamTier(1 << 20), FsTier(str(tmp_path), FP, None), checksum="mix128", on_device=True,
                   device_reads=True)
    with pytest.raises(ValueError, match="RAM tier takes every file hit into host memory"):
        w.register(caches())  # its promotions would read every file hit into host slots: KvikIO would read none


def test_no_device_memory_to_read_into_is_a_counted_miss_and_the_file_stays(tmp_path, monkeypatch):
    w, where = stored(tmp_path)

    def no_room(n):
        raise torch.OutOfMemoryError("CUDA out of memory")
    monkeypatch.setattr(w.loader, "_device_rows", no_room)
    w.load(loads(where, range(N)))
    assert w.take_load_errors() == set(range(N, 2 * N)) and w.stats.io_errors == N and w.stats.corrupt == 0
    assert w.fs.path(where[0].file).exists() and w.reads == []


def test_a_file_that_changes_size_under_a_failing_read_is_corrupt_and_moved_aside(tmp_path):
    w, where = stored(tmp_path)

    def truncated(fd, into, offset):  # KvikIO raises at a file's end rather than count bytes
        os.truncate(f"/proc/self/fd/{fd}", offset)  # the file itself, as another host would
        raise OSError("KvikIO: POSIX error on pread: EOF")
    w.loader.reads = truncated
    w.load(loads(where, range(3)))
    assert w.take_load_errors() == {N, N + 1, N + 2} and w.stats.corrupt == 3 and w.stats.io_errors == 0
    assert w.fs.path(where[0].file).with_suffix(".corrupt").exists()


def test_a_file_swapped_at_its_name_during_the_read_still_loads_the_file_that_was_checked(tmp_path):
    w, where = stored(tmp_path)
    mine, other = w.fs.path(where[0].file), w.fs.path(where[3].file)

    def swapping(fd, into, offset):  # as KvikIO opens it: by /proc/self/fd, after the name points elsewhere
        os.replace(other, mine)
        with open(f"/proc/self/fd/{fd}", "rb") as f:
            return os.preadv(f.fileno(), [into.numpy()], offset)
    w.loader.reads = swapping
    w.load(loads(where, range(3)))
    assert w.take_load_errors() == set() and w.stats.fs_hits == 3
    assert all(torch.equal(t[N:N + 3], t[:3]) for t in w.layers.values())


class _CuFile:
    """KvikIO's CuFile as the connector uses it: opened by path, pread into a tensor, a future's get()."""
    opened: list[str] = []
    fails: Exception | None = None

    def __init__(self, path, mode):
        assert mode == "r"
        self.f = open(path, "rb")
        _CuFile.opened.append(path)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()

    def pread(self, buf, size, offset):
        if _CuFile.fails is not None:
            raise _CuFile.fails
        got = os.preadv(self.f.fileno(), [buf.numpy()[:size]], offset)
        return types.SimpleNamespace(get=lambda: got)


@pytest.fixture
def fake_kvikio(monkeypatch):
    settings = {}
    kvikio, defaults = types.ModuleType("kvikio"), types.ModuleType("kvikio.defaults")
    defaults.set = settings.__setitem__
    kvikio.defaults, kvikio.CuFile = defaults, _CuFile
    monkeypatch.setitem(sys.modules, "kvikio", kvikio)
    monkeypatch.setitem(sys.modules, "kvikio.defaults", defaults)
    monkeypatch.setattr(_CuFile, "opened", [])
    return settings


def test_kvikios_read_opens_the_checked_descriptor_not_the_name_and_any_error_is_a_failed_read(tmp_path,
                                                                                                fake_kvikio,
                                                                                                monkeypatch):
    monkeypatch.delenv("KVIKIO_NTHREADS", raising=False)
    read = kvikio_reads(8)
    assert fake_kvikio == {"num_threads": 8}
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 4)
    into = torch.zeros(16, dtype=torch.uint8)
    with open(path, "rb") as f:
        assert read(f.fileno(), into, 100) == 16 and _CuFile.opened == [f"/proc/self/fd/{f.fileno()}"]
        assert into.tolist() == list(range(100, 116))
        monkeypatch.setattr(_CuFile, "fails", ValueError("cuFile: bad argument"))
        with pytest.raises(OSError, match="ValueError: cuFile: bad argument"):
            read(f.fileno(), into, 0)


def test_kvikios_thread_count_from_its_environment_is_left_alone(fake_kvikio, monkeypatch):
    monkeypatch.setenv("KVIKIO_NTHREADS", "3")
    assert kvikio_reads(8) is not None and fake_kvikio == {}


def test_a_files_blocks_read_into_device_memory_are_staged_by_one_copy(tmp_path):
    # Each block read into device memory went to the staging buffer in a copy of its own, with a
    # record_stream of its own, on the forward thread (535 of each for a 16k-token hit): a file's blocks lie
    # side by side in the one tensor its read filled, so one copy moves them.
    w, where = stored(tmp_path)
    w.device_copies.chunk = 4  # chunks k0-k3 and k4-k7; files k0-k2, k3-k5, k6-k7
    copies, spans = [], w.pool.spans
    w.pool.spans = lambda slots: (copies.append(n) or (i, n, t) for i, n, t in spans(slots))
    w.load(loads(where, range(N)))
    assert w.take_load_errors() == set() and all(torch.equal(t[N:], t[:N]) for t in w.layers.values())
    assert copies == [3, 1, 2, 2]
