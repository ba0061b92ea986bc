"""A store written by a hostile or careless host: special files, links, odd headers, bad settings (no server)."""

import json
import os
import re
import socket
import threading
import time

import pytest
import torch
from test_sides import worker
from test_store import FP, LAYOUT, block, tier, write

from kvscope_connector import fileformat, loaders, store
from kvscope_connector import worker as worker_mod
from kvscope_connector.blocks import CorruptBlock, Layout
from kvscope_connector.messages import KVScopeMetadata, LoadSpec, StoreSpec
from kvscope_connector.store import FsTier


def in_time(call, seconds=5.0):
    """What call() returns or raises, failing the test (not hanging it) when it takes longer than `seconds`."""
    box: dict = {}

    def run():
        try:
            box["value"] = call()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds} s"
    if "error" in box:
        raise box["error"]
    return box.get("value")


def test_a_fifo_at_a_blocks_name_is_a_quarantined_miss_not_a_hang(tmp_path):
    fs = tier(tmp_path)
    write(fs, "ab12", block())
    os.unlink(fs.path("ab12"))
    os.mkfifo(fs.path("ab12"))
    try:
        with pytest.raises(CorruptBlock, match="not a regular file"):
            in_time(lambda: fs.get("ab12"))
    finally:  # a reader stuck in open() (the old code) is let go
        try:
            os.close(os.open(fs.path("ab12"), os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
    w = worker(tmp_path / "w", ram=False)
    w.save(KVScopeMetadata(stores=[StoreSpec(1, "k1", to_ram=False, to_fs=True)]))
    w.flush()
    path = w.fs.path("k1")
    os.unlink(path)
    os.mkfifo(path)
    in_time(lambda: w.load(KVScopeMetadata(loads=[LoadSpec(5, "k1", "fs")])))
    assert w.take_load_errors() == {5} and w.stats.corrupt == 1
    assert not path.exists() and path.with_suffix(".corrupt").exists()  # moved aside


def test_a_load_that_does_not_answer_in_time_is_a_counted_miss(tmp_path, monkeypatch):
    monkeypatch.setattr(loaders, "LOAD_WAIT_S", 0.5)
    w = worker(tmp_path, ram=False)
    stuck = threading.Event()
    w.fs.get_file = lambda *args: stuck.wait(30)  # a read that hangs (a dead NFS server)
    started = time.monotonic()
    try:
        in_time(lambda: w.load(KVScopeMetadata(loads=[LoadSpec(5, "k1", "fs")])))
    finally:
        stuck.set()
    assert time.monotonic() - started < 5
    assert w.take_load_errors() == {5} and w.stats.io_errors == 1


def test_a_hung_filesystem_costs_a_step_one_wait_not_one_per_read(tmp_path, monkeypatch):
    # review: every queued read waited LOAD_WAIT_S of its own (a 32k-token prompt in 128 files: an hour at 30 s)
    monkeypatch.setattr(loaders, "LOAD_WAIT_S", 0.5)
    w = worker(tmp_path, ram=False)
    stuck = threading.Event()
    w.fs.get_file = lambda *args: stuck.wait(30)  # a dead NFS server: every read hangs
    started = time.monotonic()
    try:
        w.load(KVScopeMetadata(loads=[LoadSpec(i, f"k{i}", "fs", request_id=f"r{i}") for i in range(8)]))
    finally:
        stuck.set()
    assert time.monotonic() - started < 2.5  # one wait, not eight (4 s)
    assert w.take_load_errors() == set(range(8)) and w.stats.io_errors == 8


def test_the_slots_of_a_read_given_up_on_go_back_to_the_pool_once_it_ends(tmp_path, monkeypatch):
    # beside a GPU a file's read fills a pool slot per block: one that hangs past the wait must not keep them
    monkeypatch.setattr(loaders, "LOAD_WAIT_S", 0.5)
    w = worker(tmp_path, ram=False, loader="slots")
    w.fs.per_file = 3
    w.save(KVScopeMetadata(stores=[StoreSpec(i, f"k{i}", False, True, file="k2") for i in range(3)]))
    w.flush()
    total = len(w.pool.free) + len(w.pool.returned)
    stuck, read = threading.Event(), w.fs.get_file
    w.fs.get_file = lambda *args: stuck.wait(30) and read(*args)  # a read that answers late (NFS)
    in_time(lambda: w.load(KVScopeMetadata(loads=[LoadSpec(5 + i, f"k{i}", "fs", request_id="r", index=i,
                                                           file="k2", offset=i, count=3) for i in range(3)])))
    assert w.take_load_errors() == {5, 6, 7} and w.stats.io_errors == 3
    stuck.set()
    w.loaders.shutdown(wait=True)
    assert len(w.pool.free) + len(w.pool.returned) == total  # every slot back


def test_writes_and_evictions_never_follow_a_linked_folder_below_the_store_root(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (tmp_path / "root").mkdir()
    fs = tier(tmp_path / "root")
    fs.dir.symlink_to(victim)  # root/<fingerprint> is a link
    with pytest.raises(OSError):
        write(fs, "ab12", block())
    assert not list(victim.rglob("*"))
    fs.dir.unlink()
    probe = tier(tmp_path / "probe")
    write(probe, "00aa", block())
    fs = tier(tmp_path / "root", capacity=probe.used)
    write(fs, "ab12", block())
    (fs.dir / "ab").rename(victim / "ab")
    (fs.dir / "ab").symlink_to(victim / "ab")  # a shard folder is a link
    with pytest.raises(OSError):
        write(fs, "ab34", block())
    write(fs, "cd34", block())  # evicts ab12, which this store no longer holds
    fs.discard("ab12")
    assert sorted(p.name for p in (victim / "ab").iterdir()) == ["ab12.safetensors"]


def test_the_store_root_is_made_private(tmp_path):
    write(tier(tmp_path / "store"), "ab12", block())
    assert (tmp_path / "store").stat().st_mode & 0o777 == 0o700


def test_a_dangling_link_does_not_stop_the_startup_scan(tmp_path):
    fs = tier(tmp_path / "store")
    for key in ("ab12", "cd34"):
        write(fs, key, block())
    (fs.dir / "ab" / "ee99.safetensors").symlink_to(tmp_path / "gone")
    assert tier(tmp_path / "store").used == fs.used > 0  # a new process accounts what is on disk


@pytest.mark.parametrize("in_file, in_env", [("", None), (" \n\t \n", None), (None, " " * 16),
                                             (None, " " * 12 + "key ")])
def test_a_store_key_that_is_set_but_unusable_stops_the_server(tmp_path, monkeypatch, in_file, in_env):
    from kvscope_connector import keys

    monkeypatch.delenv(keys.SECRET_ENV, raising=False)
    monkeypatch.delenv(keys.SECRET_FILE_ENV, raising=False)
    if in_file is not None:
        (tmp_path / "key").write_text(in_file)
        monkeypatch.setenv(keys.SECRET_FILE_ENV, str(tmp_path / "key"))
    else:
        monkeypatch.setenv(keys.SECRET_ENV, in_env)
    with pytest.raises(ValueError, match="store secret"):
        keys.store_secret()
    monkeypatch.setenv(keys.SECRET_FILE_ENV, "")
    monkeypatch.setenv(keys.SECRET_ENV, "")  # set to nothing: no key, as when deploy has none to give
    assert keys.store_secret() is None


def rewrite_header(path, edit):
    """Give a stored block file another JSON header (its data kept): edit(header text) -> new header text."""
    data = path.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = edit(data[8:8 + n].decode()).encode()
    path.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + n:])


@pytest.mark.parametrize("edit", [
    lambda h: json.dumps({**json.loads(h), "__metadata__": {**json.loads(h)["__metadata__"], "macs": "é" * 64}}),
    lambda h: h.rstrip()[:-1] + ', "deep": ' + "[" * 100_000 + "]" * 100_000 + "}",
], ids=["non-ascii-mac", "deeply-nested"])
def test_an_odd_header_is_a_corrupt_block_not_an_exception(tmp_path, edit):
    fs = FsTier(str(tmp_path), FP, None, layout=LAYOUT, secret=b"s" * 32)
    write(fs, "ab12", block())
    rewrite_header(fs.path("ab12"), edit)
    with pytest.raises(CorruptBlock):
        fs.get("ab12")


def _entries(edit):
    """A header edit of the tensors' entries (the metadata kept)."""
    def apply(h):
        doc = json.loads(h)
        meta = doc.pop("__metadata__")
        return json.dumps({"__metadata__": meta, **edit(doc)})
    return apply


def _first(doc):
    return sorted(doc)[0]


@pytest.mark.parametrize("edit", [
    lambda d: {**d, _first(d): {**d[_first(d)], "data_offsets": [e + 4 for e in d[_first(d)]["data_offsets"]]}},
    lambda d: {**d, _first(d): {**d[_first(d)], "dtype": "I32"}},
    lambda d: {**d, "extra.layer": d[_first(d)]},
    lambda d: {k: v for k, v in d.items() if k != _first(d)},
], ids=["offsets", "dtype", "extra-tensor", "missing-tensor"])
def test_a_header_whose_tensors_differ_from_the_layout_is_corrupt(tmp_path, edit):
    fs = FsTier(str(tmp_path), FP, None, layout=LAYOUT)
    write(fs, "ab12", block())
    rewrite_header(fs.path("ab12"), _entries(edit))
    with pytest.raises(CorruptBlock, match="expected"):
        fs.get("ab12")


def test_a_header_with_the_layouts_tensors_loads_whatever_its_spacing_and_order(tmp_path):
    # a load compares the parsed entries with the layout's, not the header's text
    fs = FsTier(str(tmp_path), FP, None, layout=LAYOUT)
    b = block()
    write(fs, "ab12", b)
    rewrite_header(fs.path("ab12"), lambda h: json.dumps(dict(reversed(json.loads(h).items())), indent=1))
    got, _ = fs.get("ab12")
    assert torch.equal(got, b)


def _metadata_reordered(h):
    """The header with its metadata's keys in another order (as another process's safetensors writes them)
    and its tensors' entries as they were, byte for byte."""
    meta, end = json.JSONDecoder().raw_decode(h, len('{"__metadata__":'))
    return '{"__metadata__":' + json.dumps(dict(reversed(meta.items())), separators=(",", ":")) + h[end:]


@pytest.mark.parametrize("edit", [lambda h: h, _metadata_reordered], ids=["as-written", "metadata-reordered"])
def test_a_header_as_encode_writes_it_loads_without_parsing_its_tensors(tmp_path, monkeypatch, edit):
    # the tensors' entries are compared as text: the full parse (most of a load's Python time) is not needed
    fs = FsTier(str(tmp_path), FP, None, layout=LAYOUT, secret=b"s" * 32)
    b = block()
    write(fs, "ab12", b)
    rewrite_header(fs.path("ab12"), edit)
    monkeypatch.setattr(fileformat, "_header", lambda data: pytest.fail("the full parse ran"))
    got, _ = fs.get("ab12")
    assert torch.equal(got, b)


def _header_cases(h):
    """Spellings of a header h (as encode writes it) that the quick check must judge as the full parse does."""
    meta, end = json.JSONDecoder().raw_decode(h, len('{"__metadata__":'))
    m, tail = h[len('{"__metadata__":'):end], h[end:]
    key = re.search(r'"key":"[^"]*"', m).group(0)
    return {"as-written": h,
            "duplicate-key": '{"__metadata__":' + m[:-1] + ',"key":"zz"}' + tail,
            "escaped-quote": '{"__metadata__":' + m.replace(key, '"key":"ab\\u0022"') + tail,
            "escaped-key": '{"__metadata__":' + m.replace(key, key.replace('"key"', '"\\u006bey"')) + tail,
            "second-metadata": h.rstrip()[:-1] + ',"__metadata__":{"kvscope_format":"3"}}',
            "metadata-twice": '{"__metadata__":{"kvscope_format":"2"},"__metadata__":' + m + tail,
            "nul-padding": h.rstrip() + "\x00", "trailing-object": h.rstrip() + "{}",
            "metadata-null": '{"__metadata__":null' + tail, "metadata-list": '{"__metadata__":[]' + tail,
            "not-a-string": '{"__metadata__":' + m[:-1] + ',"x":12}' + tail,
            "nan": '{"__metadata__":' + m[:-1] + ',"x":NaN}' + tail,
            "deep": '{"__metadata__":' + "[" * 100_000 + "]" * 100_000 + tail,
            "non-ascii": '{"__metadata__":' + m[:-1] + ',"x":"\u00e9"}' + tail,
            "no-metadata": "{" + tail[1:]}


def _decoded(header: str, data, layout, quick: bool, monkeypatch):
    with monkeypatch.context() as patch:
        if not quick:
            patch.setattr(fileformat, "_quick_meta", lambda *a: None)
        raw = header.encode()
        try:
            return fileformat.decode(len(raw).to_bytes(8, "little") + raw, [data.clone()], FP, "ab12", ["ab12"], 0, 1,
                                     layout, b"s" * 32, None)[0][1]
        except CorruptBlock as exc:
            return f"CorruptBlock: {exc}"


@pytest.mark.parametrize("like", [
    {name: t for name, t in LAYOUT.views(block()).items()},
    {"a": torch.ones(4, dtype=torch.bfloat16), "b": torch.arange(4, dtype=torch.float32)},  # dtype-first order
], ids=["layout", "mixed-dtypes"])
def test_the_quick_header_check_judges_every_spelling_as_the_full_parse(monkeypatch, like):
    layout = Layout(like)
    data = layout.pack(like)
    written = fileformat.header([data], layout, FP, "ab12", ["ab12"], ["0" * 32], b"s" * 32) + data.numpy().tobytes()
    n = int.from_bytes(written[:8], "little")
    body = torch.frombuffer(bytearray(written[8 + n:]), dtype=torch.uint8)
    for name, header in _header_cases(written[8:8 + n].decode()).items():
        assert (_decoded(header, body, layout, True, monkeypatch)
                == _decoded(header, body, layout, False, monkeypatch)), name


def test_a_read_that_returns_less_is_continued_not_a_corrupt_block(tmp_path, monkeypatch):
    # one preadv may return fewer bytes than asked (NFS, FUSE, a signal); only the file's end is a short file
    fs = FsTier(str(tmp_path), FP, None, layout=LAYOUT)
    b = block()
    write(fs, "ab12", b)
    preadv = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, bufs, offset: preadv(fd, [memoryview(bufs[0])[:4096]], offset))
    got, _ = fs.get("ab12")
    assert torch.equal(got, b)


def test_a_folder_at_a_blocks_name_is_a_quarantined_miss(tmp_path):
    w = worker(tmp_path, ram=False)
    w.fs.path("k1").mkdir(parents=True)
    w.load(KVScopeMetadata(loads=[LoadSpec(5, "k1", "fs")]))
    assert w.take_load_errors() == {5} and (w.stats.corrupt, w.stats.io_errors) == (1, 0)
    assert not w.fs.path("k1").exists() and w.fs.path("k1").with_suffix(".corrupt").is_dir()


@pytest.mark.parametrize("capacity", ["16G", "1e9", 1.5, -1, True])
def test_a_capacity_that_is_not_a_number_of_bytes_is_refused_when_the_tier_is_made(tmp_path, capacity):
    with pytest.raises(ValueError, match="fs_bytes"):
        FsTier(str(tmp_path), FP, capacity)


@pytest.mark.parametrize("backlog", ["4G", 1.5, -1, True])
def test_a_save_backlog_that_is_not_a_number_of_bytes_is_refused(tmp_path, backlog):
    with pytest.raises(ValueError, match="save_backlog_bytes"):
        worker_mod.WorkerSide(FP, 4, None, FsTier(str(tmp_path), FP, None), backlog=backlog)


def test_a_file_being_written_again_is_not_evicted_under_its_writer(tmp_path, monkeypatch):
    # several writer threads: one re-writes a key at the LRU's head while another's put evicts; the index must
    # not keep a key whose file the eviction removed
    fs = tier(tmp_path)
    for key in ("aa01", "aa02"):
        write(fs, key, block())
    fs.capacity = fs.used  # room for two
    replace, inside = os.replace, threading.Event()

    def slow_replace(src, dst, **kw):  # the new file in place, its writer not yet done
        replace(src, dst, **kw)
        if dst == "aa01.safetensors":
            inside.set()
            time.sleep(0.3)

    monkeypatch.setattr(os, "replace", slow_replace)
    again = threading.Thread(target=write, args=(fs, "aa01", block()))
    again.start()
    assert inside.wait(5)
    write(fs, "aa03", block())  # over capacity: evicts the oldest key not being written
    again.join()
    assert all(fs.path(key).exists() for key in fs.sizes) and "aa01" in fs.sizes and "aa02" not in fs.sizes


def test_a_save_queued_when_the_writers_are_gone_is_still_written(tmp_path):
    # an interpreter that exits without shutdown(): the writer pool takes no more work; the save thread writes
    w = worker(tmp_path, ram=False)
    w.writers.shutdown()
    w.save(KVScopeMetadata(stores=[StoreSpec(1, "k1", to_ram=False, to_fs=True)]))
    w.flush()
    assert w.fs.contains("k1") and w.stats.saves == 1


@pytest.mark.parametrize("tokens", [100, 32, 0, "256", 256.0, True])
def test_file_tokens_that_are_not_a_multiple_of_the_block_size_are_refused(tokens):
    from kvscope_connector.connector import _per_file
    with pytest.raises(ValueError, match="file_tokens"):
        _per_file(tokens, 64, "cpu")


def test_a_file_holds_256_tokens_beside_a_gpu_one_block_elsewhere_or_what_file_tokens_says():
    from kvscope_connector.connector import _per_file
    assert (_per_file(None, 16, "cuda"), _per_file(None, 512, "cuda"), _per_file(None, 64, "cpu")) == (16, 1, 1)
    assert _per_file(256, 64, "cpu") == 4


@pytest.mark.parametrize("value", ["KvikIO", "gds", 1, True, ["kvikio"]])
def test_a_file_reads_setting_the_connector_does_not_know_is_refused_at_start(value):
    from kvscope_connector.connector import _file_reads
    with pytest.raises(ValueError, match="file_reads"):
        _file_reads(value)
    assert (_file_reads(None), _file_reads("host"), _file_reads("kvikio")) == (False, False, True)


def test_a_kv_cache_that_frees_a_running_requests_blocks_and_pipeline_parallelism_are_refused():
    # review: a sliding window puts vLLM's null block (id 0) where a request's early blocks were; they were
    # planned as stores of the prompt's KV. Pipeline stages would store under one name.
    from types import SimpleNamespace as NS

    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    from kvscope_connector.connector import _unsupported

    def config(pp=1):
        return NS(parallel_config=NS(pipeline_parallel_size=pp))

    def cache(spec_cls, **kw):
        spec = spec_cls(block_size=16, num_kv_heads=8, head_size=128, dtype=torch.bfloat16, **kw)
        return NS(kv_cache_groups=[NS(kv_cache_spec=spec, layer_names=["l0"])])

    assert _unsupported(config(), cache(FullAttentionSpec)) is None
    assert _unsupported(config(), cache(FullAttentionSpec, sliding_window=4096)) is None  # interleaved, unified
    assert "SlidingWindowSpec" in _unsupported(config(), cache(SlidingWindowSpec, sliding_window=4096))
    assert "ChunkedLocalAttentionSpec" in _unsupported(config(), cache(ChunkedLocalAttentionSpec,
                                                                      attention_chunk_size=8192))
    assert "pipeline" in _unsupported(config(pp=2), None)


def test_temp_files_a_killed_save_left_are_removed_at_start_and_counted_and_fresh_ones_kept(tmp_path):
    w = worker(tmp_path, ram=False)
    w.save(KVScopeMetadata(stores=[StoreSpec(1, "k1", to_ram=False, to_fs=True)]))
    w.flush()
    shard = w.fs.path("k1").parent
    stale, fresh = shard / ".k2.safetensors.00ff00ff00ff00ff.tmp", shard / ".k3.safetensors.11ee11ee11ee11ee.tmp"
    stale.write_bytes(b"x" * 100)  # a save killed (kill -9) between its create and its rename, long ago
    fresh.write_bytes(b"x" * 100)  # another server's save on a shared store, still being written
    old = time.time() - 2 * store.STALE_TMP_S
    os.utime(stale, (old, old))
    again = worker(tmp_path, ram=False)  # the next start
    assert again.take_stats().stale_tmp_removed == 1
    assert not stale.exists() and fresh.exists() and again.fs.path("k1").exists()


def test_a_socket_at_a_blocks_name_is_a_quarantined_miss(tmp_path, monkeypatch):
    w = worker(tmp_path, ram=False)
    w.save(KVScopeMetadata(stores=[StoreSpec(1, "k1", to_ram=False, to_fs=True)]))
    w.flush()
    path = w.fs.path("k1")
    os.unlink(path)
    monkeypatch.chdir(path.parent)  # a socket's path is limited to ~108 bytes: bind it by its own name
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(path.name)
        w.load(KVScopeMetadata(loads=[LoadSpec(5, "k1", "fs")]))
    assert w.take_load_errors() == {5} and (w.stats.corrupt, w.stats.io_errors) == (1, 0)
    assert not path.exists() and path.with_suffix(".corrupt").exists()  # moved aside, as a FIFO is


def test_a_store_root_others_may_use_is_made_private_where_this_user_owns_it(tmp_path):
    root = tmp_path / "store"
    root.mkdir(mode=0o777)
    root.chmod(0o777)
    tier(root)
    assert root.stat().st_mode & 0o777 == 0o700


def test_a_store_root_others_may_write_and_this_user_does_not_own_is_refused(tmp_path, monkeypatch):
    root = tmp_path / "store"
    root.mkdir()
    root.chmod(0o777)
    monkeypatch.setattr(os, "getuid", lambda: os.stat(root).st_uid + 1)
    with pytest.raises(ValueError, match="others may write"):
        tier(root)
    assert root.stat().st_mode & 0o777 == 0o777


def test_a_fifo_as_the_store_key_file_stops_the_server_instead_of_hanging_it(tmp_path, monkeypatch):
    from kvscope_connector import keys

    fifo = tmp_path / "key"
    os.mkfifo(fifo)
    monkeypatch.setenv(keys.SECRET_FILE_ENV, str(fifo))
    try:
        with pytest.raises(ValueError, match="not a regular file"):
            in_time(keys.store_secret)
    finally:  # a reader stuck in open() (the old code) is let go
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
