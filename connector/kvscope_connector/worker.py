"""Worker side: copy blocks between vLLM's paged KV cache and the tiers, verifying every load.

A block travels as one flat byte buffer (blocks.Layout): one checksum and one transfer per block rather than
one per layer.

How blocks travel is chosen once, in register(), by the media at hand: one loader (loaders.py: checked on the
host, or on the device with host blocks in pool slots, or with files read by KvikIO into device memory) and one
saver (savers.py: host buffers of their own, or pool slots), looked up by medium() in LOADERS and SAVERS and
handed what they work with (loaders.Media), as vLLM's offloading keeps one handler per medium. Nothing here
branches on the path after that: this module keeps what every path shares (the save thread and its backlog,
the step's bookkeeping around failed loads, the load log).

Loads run in start_load_kv, before the forward. Beside a GPU each block goes to the GPU as it comes (a RAM
hit straight from the tier's pinned slot, a file read on a load thread into a pinned slot), on the side
stream, into a staging buffer on the GPU, a chunk of blocks at a time; each chunk's checksums are checked
there while the next chunk is on its way, and only blocks that match are written into the KV cache. On the
CPU the load threads (the forward thread, for RAM hits) check each block on the host, and numpy copies it in.

Stores start in wait_for_save, after the forward. Beside a GPU one gather per layer packs the step's new
blocks on the GPU, where their checksums are computed, and the copies to the host run on the side stream:
the forward thread waits for neither. On the CPU the step's blocks are copied out at once and checksummed
on the save thread. The save thread puts them in RAM and writes the files, in order; a load waits only for
the pending saves of the keys it reads. A block that fails verification is a miss: its id goes back to vLLM
through get_block_ids_with_load_errors() and vLLM recomputes it and every block after it. Blocks computed
in that step may rest on the block it lacked (the request's, or another's that vLLM shares it with): none is
stored until the scheduler has heard of the failure (vLLM recomputes them too, and they are stored then).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from .blocks import CHECKSUMS, Block, Layout, digest_hex, fused_on
from .devicereads import kvikio_reads
from .fileformat import writable
from .loaders import AHEAD_CHUNKS, LOAD_WAIT_S, HostLoader, KvikioLoader, Loader, Media, SlotLoader
from .messages import KVScopeMetadata, LoadSpec, StoreSpec
from .paths import DeviceCopies, HostRows, Saved
from .savers import HostSaver, SlotSaver
from .store import FsTier, RamTier, Stats
from .transfer import Side, SlotPool

__all__ = ["AHEAD_CHUNKS", "LOAD_THREADS", "LOAD_WAIT_S", "WorkerSide"]

SAVE_BACKLOG_BYTES = {"cpu": 1 << 30, "cuda": 1 << 32}  # host copies waiting for the save thread: beyond this,
# files are skipped and RAM saves waited for. Beside a GPU a step of 8k new tokens of a 4B model is 1.2 GB: the
# backlog holds a few steps, so the forward does not wait for each step's copies (the extra config overrides it)
SAVE_THREADS = {"cpu": 1, "cuda": 4}  # files written at once per step's save (the write releases the GIL)
CHUNK_BYTES = 1 << 27  # blocks staged on the GPU at a time (two such chunks: one is checked, one arrives)
LOAD_THREADS = {"cpu": 4, "cuda": 8}  # file reads in flight: four beat two from disk. Beside a GPU, with files of
# 16 blocks (one read each), eight beat four and sixteen (the H200, 2.25 MiB blocks from the page cache: 13,700,
# 17,393 and 16,568 MiB/s); with one block a file four had won, each block's Python waiting for the interpreter's lock
LOADERS: dict[str, type[Loader]] = {"host": HostLoader, "slots": SlotLoader, "kvikio": KvikioLoader}  # by medium:
# blocks checked on the host; checked on the device, host blocks in pool slots; its files read into device memory
SAVERS: dict[str, type[HostSaver] | type[SlotSaver]] = {"host": HostSaver, "slots": SlotSaver, "kvikio": SlotSaver}


def medium(on_device: bool, device_reads: bool) -> str:
    """The loader's and the saver's key: where blocks are checked, and where files are read into."""
    return "kvikio" if device_reads else "slots" if on_device else "host"


def _file_groups(stores: list[StoreSpec]) -> Iterator[list[StoreSpec]]:
    """The stores in order, as files: a request's consecutive stores into one file together (a store without
    a file alone)."""
    group: list[StoreSpec] = []
    for spec in stores:
        if (group and spec.to_fs and group[-1].to_fs and spec.file and spec.file == group[-1].file
                and spec.request_id == group[-1].request_id):
            group.append(spec)
            continue
        if group:
            yield group
        group = [spec]
    if group:
        yield group


class WorkerSide:
    """The worker side of the connector: steps' loads and saves around the tiers, run through one loader and
    one saver that register() picks by the media at hand (loaders.py, savers.py)."""

    device_checks = True  # beside a GPU, checksum on the GPU; the canary, which rewrites blocks on the host, says no

    def __init__(self, fingerprint: str, block_size: int, ram: RamTier | None, fs: FsTier | None,
                 checksum: str = "xxh3-128", on_device: bool | None = None, backlog: int | None = None,
                 load_threads: int | None = None, device_reads: bool = False):
        """`checksum` is the platform's (CHECKSUMS); `on_device` forces where blocks are checked (None: on
        the GPU beside one, else on the host); `backlog` the bytes of saves that may wait and `load_threads`
        the file reads in flight (None: the platform's SAVE_BACKLOG_BYTES, LOAD_THREADS); with `device_reads`
        files are read by KvikIO straight into GPU memory (else into pinned host slots)."""
        self.fp, self.block_size, self.ram, self.fs = fingerprint, block_size, ram, fs
        self.checksum_name, self.checksum = checksum, CHECKSUMS[checksum]
        self.forced = on_device
        self.on_device = False  # set by register()
        self.layers: dict[str, torch.Tensor] = {}
        self._layout: Layout | None = None  # where each layer lies in a block; set by register()
        self.device = torch.device("cpu")
        self.side = Side(self.device)
        self.pool: SlotPool | None = None  # host slots of the blocks, with on-device checks
        self.path: HostRows | DeviceCopies | None = None  # how blocks cross; by register()
        self.load_handler: Loader | None = None  # by register()
        self.save_handler: HostSaver | SlotSaver | None = None  # by register()
        self.logged: set[str] = set()  # kinds of fault already logged once
        self.stats = Stats(logged=self.logged, stale_tmp_removed=fs.stale_tmp_removed if fs is not None else 0)
        self.failed_plan = 0  # the scheduler's count of failures when it planned the last step with a failed load
        self.unheard = 0  # steps left whose stores are dropped unless planned after the scheduler heard of it
        self.load_log: str | None = None  # JSONL: per request and step, the blocks each tier served (extra config)
        self.loaders: ThreadPoolExecutor | None = None  # file reads (and host checks beside a GPU); by register()
        self.writers: ThreadPoolExecutor | None = None  # a save's file writes, with a filesystem tier; by register()
        if backlog is not None and (type(backlog) is not int or backlog < 0):
            raise ValueError(f"kvscope connector: save_backlog_bytes {backlog!r} is not a number of bytes (an "
                             "integer such as 4294967296; absent: the platform's)")
        self.wanted_backlog, self.load_threads, self.device_reads = backlog, load_threads, device_reads
        self.backlog = SAVE_BACKLOG_BYTES["cpu"]  # the platform's, or the one wanted; by register()
        # one save thread keeps stores in order
        self.saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvscope-save")
        self.saving: list[tuple[Future, set[str], int]] = []  # (job, keys it stores, bytes it holds), oldest first
        self.may_skip_files = True  # with the save thread behind (False with several tensor-parallel ranks)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer KV caches, each [num_blocks, ...], and choose once how blocks travel: the
        transfer path (rows copied with numpy beside a CPU cache, copies on the cache's device beside a GPU or
        wherever blocks are checked on the device: paths.py), and by the media (medium()) one loader and one
        saver, each handed what it works with. The tiers get the layout, the pool and the checksum here, the
        one place they are known."""
        self.layers = dict(sorted(kv_caches.items()))
        self._layout = Layout({name: t[0] for name, t in self.layers.items()})
        self.device = next(iter(self.layers.values())).device
        gpu = self.device.type == "cuda"
        self.on_device = (gpu and self.device_checks) if self.forced is None else self.forced
        if self.on_device and self.checksum_name != "mix128":
            raise ValueError(f"kvscope connector: {self.checksum_name} cannot be computed on the GPU (mix128 can)")
        platform = "cuda" if gpu else "cpu"
        self.side = Side(self.device)
        self.pool = SlotPool(self.layout.nbytes, self.side, pinned=gpu) if self.on_device else None
        chunk = max(1, CHUNK_BYTES // self.layout.nbytes)  # blocks per staged chunk
        self.path = (DeviceCopies(self.layers, self.layout, self.side, self.pool, chunk)
                     if self.device.type != "cpu" or self.on_device else HostRows(self.layers, self.layout))
        if self.on_device:  # mix128's kernel compiled and checked for these blocks before any request
            fused_on(self.device, self.layout.nbytes)
        threads = self.load_threads or LOAD_THREADS[platform]
        self.loaders = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvscope-load")
        media = Media(self.layout, self.path, self.ram, self.fs, self.stats, self.loaders, self.side, self.pool)
        if self.device_reads:  # a store secret's MACs are computed over a block's bytes on the host
            if self.ram is not None:
                raise ValueError("kvscope connector: file_reads kvikio reads file hits into GPU memory, but a RAM tier "
                                 "takes every file hit into host memory: ram_bytes 0")
            if not (gpu and self.on_device and self.fs is not None and self.fs.secret is None):
                raise ValueError("kvscope connector: file_reads kvikio needs a CUDA GPU that checks the blocks, "
                                 "a filesystem tier and no store secret")
            if (reads := kvikio_reads(threads)) is None:
                raise ValueError("kvscope connector: file_reads kvikio, but kvikio does not import")
            media.reads, media.read_stream = reads, torch.cuda.Stream(self.device)  # nothing runs on that stream
        key = medium(self.on_device, self.device_reads)
        self.load_handler, self.save_handler = LOADERS[key](media), SAVERS[key](media)
        if self.fs is not None:
            self.writers = ThreadPoolExecutor(max_workers=SAVE_THREADS[platform], thread_name_prefix="kvscope-write")
        self.backlog = self.wanted_backlog if self.wanted_backlog is not None else SAVE_BACKLOG_BYTES[platform]
        if self.pool is not None:
            need, host = self.host_slots_bytes(), os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            if need > host:
                raise ValueError(f"kvscope connector: ram_bytes (x1.1) and save_backlog_bytes ask for "
                                 f"{need / 2**30:.1f} GiB of host memory, more than this host's {host / 2**30:.1f} GiB")
            if self.pool.pinned:  # pinned before any request, as vLLM's offloading pins its CPU tier at start
                self.pool.reserve(need)
        if self.ram is not None:
            self.ram.attach(self.pool, self.checksum, pin=gpu and not self.on_device)
        if self.fs is not None:
            writable(self.layout, self.fs.per_file)  # refused at start, not at every save
            self.fs.attach(self.pool, self.checksum, self.layout)

    def host_slots_bytes(self) -> int:
        """The host memory the slot pool holds at most in use: the RAM tier's blocks, the saves waiting for the
        save thread (the backlog) and a load's file reads (the loader's: none when files are read into device
        memory)."""
        return (self.ram.capacity if self.ram is not None else 0) + self.backlog + self.loader.read_slots_bytes()

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            raise RuntimeError("kvscope connector: no block layout before vLLM registers its KV caches")
        return self._layout

    @property
    def transfer(self) -> HostRows | DeviceCopies:
        if self.path is None:
            raise RuntimeError("kvscope connector: no transfer path before vLLM registers its KV caches")
        return self.path

    @property
    def device_copies(self) -> DeviceCopies:
        assert isinstance(self.path, DeviceCopies), "checks on the device take the device path"
        return self.path

    @property
    def loader(self) -> Loader:
        if self.load_handler is None:
            raise RuntimeError("kvscope connector: no loader before vLLM registers its KV caches")
        return self.load_handler

    @property
    def store_path(self) -> HostSaver | SlotSaver:
        if self.save_handler is None:
            raise RuntimeError("kvscope connector: no saver before vLLM registers its KV caches")
        return self.save_handler

    def block_bytes(self) -> int:
        return self.layout.nbytes

    def extract(self, block_ids: list[int]) -> list[Block]:
        """The blocks' host copies, now (what the KV cache holds: the canary reads its writes back)."""
        return self.transfer.extract(block_ids)

    def begin_step(self, meta: KVScopeMetadata) -> None:
        """Wait for the pending saves of the keys this step loads (all of them before a reset), then apply a
        reset the scheduler asked for (POST /reset_prefix_cache?reset_external=true)."""
        if meta.reset:
            self.flush()
            if self.ram is not None:
                self.ram.clear()
        elif meta.loads:
            keys = {spec.key for spec in meta.loads}
            last = max((i for i, (_, stored, _) in enumerate(self.saving) if stored & keys), default=-1)
            self._collect(wait_upto=last, timeout=LOAD_WAIT_S)  # a save still running then: its loads miss

    def load(self, meta: KVScopeMetadata) -> None:
        loader = self.loader
        self.unheard = max(0, self.unheard - 1)
        self.begin_step(meta)
        started = time.perf_counter()
        written = loader.load(meta, self.to_write)
        if loader.broken:  # this step and the next (planned before vLLM reports this one, with async scheduling)
            self.failed_plan, self.unheard = meta.failures, 2
        if self.ram is not None:  # every looked-up block's copy is queued: what the tier dropped may go back
            self.ram.release()
        self.stats.load_bytes += self.block_bytes() * written
        self.stats.load_seconds += time.perf_counter() - started
        if self.load_log and loader.served:
            self.append_log(self.load_log, [{"request": r, **tiers} for r, tiers in loader.served.items()])

    def append_log(self, path: str, lines: list[dict]) -> None:
        """Append JSON lines to a log the bench reads (the load log, the canary's fault log); a log that
        cannot be written is said once, never raised."""
        try:
            with open(path, "a") as f:
                f.write("".join(json.dumps(line) + "\n" for line in lines))
        except OSError as exc:
            self.stats.warn_once("log", "cannot write %s: %s", path, exc)

    def to_write(self, meta: KVScopeMetadata, verified: Iterator[tuple[LoadSpec, Block]]
                 ) -> Iterable[tuple[int, Block]]:
        """What goes into the KV cache for a step's host-checked blocks: each block as it comes. The one hook
        the fault-injection canaries override (canary.py); loaders that check on the device never call it."""
        return ((spec.block_id, block) for spec, block in verified)

    def take_load_errors(self) -> set[int]:
        """The block ids of this step's failed loads (none before registration)."""
        return self.load_handler.take_load_errors() if self.load_handler is not None else set()

    # Saves

    def save(self, meta: KVScopeMetadata) -> None:
        entered = time.perf_counter()
        try:
            if self.ram is not None:  # no load in flight: what the tier dropped since may go back
                self.ram.release()
            self._save(meta)
        finally:
            self.stats.save_forward_seconds += time.perf_counter() - entered

    def _save(self, meta: KVScopeMetadata) -> None:
        """Send this step's new blocks towards the host, then hand them to the save thread. None in a step
        with a failed load, nor in the next unless the scheduler planned it after hearing of the failure
        (async scheduling plans it before): any of them may have been computed on a failed block, the
        request's own or one vLLM shares with it from another's load; the scheduler forgets them
        (scheduler.load_failed) and they are stored once recomputed."""
        if self.unheard and meta.failures <= self.failed_plan:
            meta.stores = []
        meta.stores = self._shed_files(meta.stores)
        if not meta.stores and not meta.ram_evict:
            return
        started = time.perf_counter()
        held = self.block_bytes() * len(meta.stores)
        if 0 < (pending := self._pending()) and pending + held > self.backlog:  # before the copies take slots
            waited = time.perf_counter()
            while 0 < (pending := self._pending()) and pending + held > self.backlog:
                self._collect(wait_upto=0)  # the save thread is behind: wait for its oldest job
            self.stats.save_wait_seconds += time.perf_counter() - waited
        saved = self.store_path.copy_out([spec.block_id for spec in meta.stores])
        job = self.saver.submit(self._store, meta.ram_evict, meta.stores, saved, time.perf_counter() - started)
        self.saving.append((job, {spec.key for spec in meta.stores}, held))
        self._collect()

    def _shed_files(self, stores: list[StoreSpec]) -> list[StoreSpec]:
        """With the save thread behind, the files of file-only saves beyond the backlog's room, skipped whole
        rather than waited for (a later lookup misses them on disk). A file with a block saved to RAM is
        kept whole: the scheduler's index counts on the RAM save, and a block the RAM tier evicts within a
        step is read from its file. Not with several tensor-parallel ranks: each would skip on its own
        timing, and the scheduler looks up rank 0's files only."""
        self._collect()
        pending = self._pending()
        if not pending or not self.may_skip_files:
            return stores
        room, kept = self.backlog - pending, []
        for group in _file_groups(stores):
            size = self.block_bytes() * len(group)
            if any(spec.to_ram for spec in group) or not group[0].to_fs or room >= size:
                kept += group
                room -= size
            else:
                self.stats.saves_skipped += len(group)
        return kept

    def _pending(self) -> int:
        """Bytes of host copies handed to the save thread and not yet stored."""
        return sum(held for _, _, held in self.saving)

    def _store(self, evict: list[str], stores: list[StoreSpec], saved: Saved, seconds: float) -> Stats:
        """On the save thread: wait for the blocks to reach the host, apply RAM evictions, store the blocks
        (checksummed here unless the GPU did it); returns what it counted."""
        started = time.perf_counter()
        stats = Stats(logged=self.logged)
        store_path = self.store_path
        owned = store_path.owned  # pool slots, handed to the RAM tier (else blocks it copies)
        if saved.ready is not None:
            saved.ready.synchronize()
        digests = None if saved.digests is None else [digest_hex(pair) for pair in saved.digests.tolist()]
        if evict and self.ram is not None:
            stats.evictions += self.ram.drop_many(evict)
        if digests is None:
            digests = [self.checksum(block) for block in saved.blocks]
        files = self._write_files(stores, saved.blocks, digests)
        counted: set[int] = set()  # files whose evictions are counted (errors and saves count blocks)
        to_ram: list[tuple[str, Block, str]] = []  # blocks whose files are written, for the RAM tier together
        back: list[Block] = []  # slots stored in no RAM: given back together
        for spec, block, digest, written in zip(stores, saved.blocks, digests, files):
            stored = True
            if written is not None:
                if not written.done() and to_ram and self.ram is not None:  # stored before a file that hangs
                    stats.evictions += self.ram.put_many(to_ram, owned=owned)
                    to_ram = []
                try:
                    evicted = written.result()
                except OSError as exc:
                    stored = False
                    stats.save_errors += 1
                    stats.warn_once("save", "cannot write block %s: %s", spec.key, exc)
                else:
                    stats.evictions += 0 if id(written) in counted else evicted
                    counted.add(id(written))
            if spec.to_ram and self.ram is not None:
                to_ram.append((spec.key, block, digest))
            else:
                back.append(block)
            if stored:
                stats.saves += 1
                stats.save_bytes += block.numel()
        if to_ram and self.ram is not None:  # once their files are written: the tier may give a slot back
            stats.evictions += self.ram.put_many(to_ram, owned=owned)
        store_path.give_back(back)
        stats.save_seconds = seconds + time.perf_counter() - started
        return stats

    def _write_files(self, stores: list[StoreSpec], blocks: list[Block], digests: list[str]
                     ) -> list[Future[int] | None]:
        """Start each file on the writer threads; for each store, its file's write (None where it has none).
        The caller waits for each before its slots are used again."""
        fs = self.fs
        files: list[Future[int] | None] = []
        at = 0
        for group in _file_groups(stores):
            items = [(spec.key, blocks[i], digests[i]) for i, spec in enumerate(group, start=at)]
            at += len(group)
            written = self._submit_write(fs, group[0].file_key, items) if group[0].to_fs and fs is not None else None
            files += [written] * len(group)
        return files

    def _submit_write(self, fs: FsTier, file: str, items: list[tuple[str, Block, str]]) -> Future[int]:
        """One file on a writer thread; here, once the pool takes no more work (an interpreter exiting
        without shutdown())."""
        assert self.writers is not None, "register() first"
        try:
            return self.writers.submit(fs.put_file, file, items)
        except RuntimeError:
            done: Future[int] = Future()
            try:
                done.set_result(fs.put_file(file, items))
            except OSError as exc:
                done.set_exception(exc)
            return done

    def _collect(self, wait_upto: int = -1, timeout: float | None = None) -> None:
        """Count the finished save jobs, first waiting (at most `timeout` seconds) for the jobs up to index
        wait_upto."""
        wait([job for job, _, _ in self.saving[:wait_upto + 1]], timeout)
        pending = []
        for job, keys, held in self.saving:
            if job.done():
                self.stats.add(job.result())
            else:
                pending.append((job, keys, held))
        self.saving = pending

    def flush(self) -> None:
        """Wait until every save handed to the save thread is stored and counted."""
        self._collect(wait_upto=len(self.saving) - 1)

    def take_stats(self) -> Stats:
        """The counters since the last call (vLLM asks after every step)."""
        self._collect()
        stats = self.stats.take()
        if self.save_handler is not None:  # registered
            stats.pool_grow_seconds += self.save_handler.take_grow_seconds()
        return stats
