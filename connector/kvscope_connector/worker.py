"""Worker side: copy blocks between vLLM's paged KV cache and the tiers, verifying every load.

A block travels as one flat byte buffer (blocks.Layout): one checksum and one transfer per block rather than
one per layer.

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

import contextlib
import json
import os
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch

from .blocks import CHECKSUMS, Block, CorruptBlock, Layout, digest_hex, fused_on, mix_digests
from .devicereads import Read, kvikio_reads
from .fileformat import writable
from .messages import KVScopeMetadata, LoadSpec, Outcome, StoreSpec, TierName
from .paths import DeviceCopies, HostRows, Saved
from .store import FsTier, RamTier, Stats, Tier
from .transfer import Side, SlotPool

SAVE_BACKLOG_BYTES = {"cpu": 1 << 30, "cuda": 1 << 32}  # host copies waiting for the save thread: beyond this,
# files are skipped and RAM saves waited for. Beside a GPU a step of 8k new tokens of a 4B model is 1.2 GB: the
# backlog holds a few steps, so the forward does not wait for each step's copies (the extra config overrides it)
SAVE_THREADS = {"cpu": 1, "cuda": 4}  # files written at once per step's save (the write releases the GIL)
CHUNK_BYTES = 1 << 27  # blocks staged on the GPU at a time (two such chunks: one is checked, one arrives)
AHEAD_CHUNKS = 4  # with on-device checks, the blocks a load reads ahead, in chunks: each holds a pool slot. At
# the Qwen3-4B shape's 4.5 MiB blocks, 112 blocks: 14 files of 8 queued (a 16k-token file hit on an H100, 8 load
# threads: 84 ms against 92-93 with 2 chunks, one run each without servers: 2026-12-06-h100-connector-pinned-pool)
LOAD_THREADS = {"cpu": 4, "cuda": 8}  # file reads in flight: four beat two from disk. Beside a GPU, with files of
# 16 blocks (one read each), eight beat four and sixteen (the H200, 2.25 MiB blocks from the page cache: 13,700,
# 17,393 and 16,568 MiB/s); with one block a file four had won, each block's Python waiting for the interpreter's lock
LOAD_WAIT_S = 30.0  # the longest a load waits for a read (one that hangs: a dead NFS server); then it and every
# read not done yet are misses


class Fetched(NamedTuple):
    """What a load found under one key: a block with its checksum, or why there is none."""

    outcome: Outcome
    tier: TierName | None = None  # where it was found (or failed)
    block: Block | None = None
    digest: str = ""
    why: str = ""
    owned: bool = False  # a pool slot the fetcher filled: given back or handed to the RAM tier once used


@dataclass
class Batch:
    """A chunk's pool slots to give back and blocks to promote to RAM, each done once for the chunk: one event
    on the side stream, not one per block."""

    back: list[Block] = field(default_factory=list)
    promote: list[tuple[str, Block, str]] = field(default_factory=list)


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


def _past_failure(spec: LoadSpec, first_bad: dict[str, int]) -> bool:
    """Whether a block lies at or after its request's first failed block (vLLM recomputes those)."""
    return spec.request_id in first_bad and spec.index >= first_bad[spec.request_id]


class WorkerSide:
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
        self.logged: set[str] = set()  # kinds of fault already logged once
        self.stats = Stats(logged=self.logged, stale_tmp_removed=fs.stale_tmp_removed if fs is not None else 0)
        self.load_errors: set[int] = set()
        self.broken: set[str] = set()  # requests with a failed load this step: none of their blocks after it loads
        self.failed_plan = 0  # the scheduler's count of failures when it planned the last step with a failed load
        self.unheard = 0  # steps left whose stores are dropped unless planned after the scheduler heard of it
        self.load_log: str | None = None  # JSONL: per request and step, the blocks each tier served (extra config)
        self.served: dict[str, dict[str, int]] = {}  # this step's request -> tier -> blocks
        self.loaders: ThreadPoolExecutor | None = None  # file reads (and host checks beside a GPU); by register()
        self.writers: ThreadPoolExecutor | None = None  # a save's file writes, with a filesystem tier; by register()
        if backlog is not None and (type(backlog) is not int or backlog < 0):
            raise ValueError(f"kvscope connector: save_backlog_bytes {backlog!r} is not a number of bytes (an "
                             "integer such as 4294967296; absent: the platform's)")
        self.wanted_backlog, self.load_threads, self.device_reads = backlog, load_threads, device_reads
        self.reads_to_device: Read | None = None  # KvikIO's file reads into GPU memory; by register()
        self.read_stream: torch.cuda.Stream | None = None  # where their device memory is allocated; by register()
        self.backlog = SAVE_BACKLOG_BYTES["cpu"]  # the platform's, or the one wanted; by register()
        # one save thread keeps stores in order
        self.saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvscope-save")
        self.saving: list[tuple[Future, set[str], int]] = []  # (job, keys it stores, bytes it holds), oldest first
        self.may_skip_files = True  # with the save thread behind (False with several tensor-parallel ranks)

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer KV caches, each [num_blocks, ...], and choose the transfer path once: rows
        copied with numpy beside a CPU cache (checked on the host), copies on the cache's device beside a GPU
        or wherever blocks are checked on the device (paths.py). The tiers get the layout, the pool and the
        checksum here, the one place they are known."""
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
        if self.device_reads:  # a store secret's MACs are computed over a block's bytes on the host
            if self.ram is not None:
                raise ValueError("kvscope connector: file_reads kvikio reads file hits into GPU memory, but a RAM tier "
                                 "takes every file hit into host memory: ram_bytes 0")
            if not (gpu and self.on_device and self.fs is not None and self.fs.secret is None):
                raise ValueError("kvscope connector: file_reads kvikio needs a CUDA GPU that checks the blocks, "
                                 "a filesystem tier and no store secret")
            if (reads := kvikio_reads(threads)) is None:
                raise ValueError("kvscope connector: file_reads kvikio, but kvikio does not import")
            self.reads_to_device = reads
            self.read_stream = torch.cuda.Stream(self.device)  # nothing runs on it (_device_rows)
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
        save thread (the backlog) and a load's file reads (the chunks read ahead, the one staged, the one
        checked; none when files are read into device memory)."""
        reads = ((AHEAD_CHUNKS + 2) * self.device_copies.chunk * self.layout.nbytes
                 if self.fs is not None and self.reads_to_device is None else 0)
        return (self.ram.capacity if self.ram is not None else 0) + self.backlog + reads

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

    def block_bytes(self) -> int:
        return self.layout.nbytes

    def extract(self, block_ids: list[int]) -> list[Block]:
        """The blocks' host copies, now (what the KV cache holds: the canary reads its writes back)."""
        return self.transfer.extract(block_ids)

    # Loads

    def _fetch(self, name: TierName, read: Callable[[], list[tuple[Block, str]] | None], n: int = 1,
               owned: bool = False) -> list[Fetched]:
        """Get n blocks from one tier: `read` is its get (checking the blocks, with verify); runs on a load
        thread or inline, so it only returns what happened (whatever it raises, a block that cannot be
        loaded is a miss, and so is every block read with it)."""
        hit = Outcome.RAM_HIT if name == TierName.RAM else Outcome.FS_HIT
        try:
            found = read()
        except (OSError, torch.OutOfMemoryError) as exc:  # the file stays: nothing says it is wrong
            return [Fetched(Outcome.IO, name, why=str(exc))] * n
        except Exception as exc:  # CorruptBlock, or anything an unforeseen file makes the parser raise
            why = str(exc) if isinstance(exc, CorruptBlock) else f"{type(exc).__name__}: {exc}"
            return [Fetched(Outcome.CORRUPT, name, why=why)] * n
        if found is None:
            return [Fetched(Outcome.MISS, name)] * n
        return [Fetched(hit, name, block, digest, owned=owned) for block, digest in found]

    def _fetch_file(self, fs: FsTier, specs: list[LoadSpec], verify: bool, slots: list[Block] | None) -> list[Fetched]:
        """Consecutive blocks of one file in one read, into pool slots the caller took (fetch_all, in load
        order; given back unless they hold a block) or, without a pool, buffers of their own."""
        first = specs[0]
        read = partial(fs.get_file, first.file_key, [spec.key for spec in specs], first.offset, first.count, verify,
                       slots)
        got = self._fetch(TierName.FS, read, len(specs), owned=self.pool is not None)
        if slots is not None and got[0].block is None and self.pool is not None:
            self.pool.give_back(*slots)
        return got

    def _fetch_file_to_device(self, fs: FsTier, specs: list[LoadSpec]) -> list[Fetched]:
        """Consecutive blocks of one file in one read straight into device memory of their own (KvikIO), the
        header read and checked on the host; their checksums are checked on the device (_check_and_write)."""
        reads_to_device, first = self.reads_to_device, specs[0]
        assert reads_to_device is not None

        def read() -> list[tuple[Block, str]] | None:
            rows = self._device_rows(len(specs))
            return fs.get_file_to(first.file_key, [spec.key for spec in specs], first.offset, first.count, rows,
                                  reads_to_device)
        return self._fetch(TierName.FS, read, len(specs))

    def _device_rows(self, n: int) -> torch.Tensor:
        """Device memory for n blocks read by KvikIO, allocated on a stream nothing runs on: memory the caching
        allocator hands back there is free of queued kernels (GPUDirect Storage writes it outside any stream's
        order). No room for it beside vLLM's KV cache is a failed read (_fetch), not a crash."""
        with torch.cuda.stream(self.read_stream) if self.read_stream is not None else contextlib.nullcontext():
            return torch.empty((n, self.layout.nbytes), dtype=torch.uint8, device=self.device)

    def _fetch_ram(self, spec: LoadSpec, verify: bool) -> list[Fetched]:
        """A block planned from RAM; from its file when the RAM tier evicted it since the plan (promotions and
        saves fill it within a step): a miss would make vLLM recompute, which vLLM 0.26 on a GPU gets wrong."""
        assert self.ram is not None
        ram = self.ram
        got = self._fetch(TierName.RAM, lambda: None if (found := ram.get(spec.key, verify)) is None else [found])
        if got[0].outcome == Outcome.MISS and self.fs is not None and spec.count > 0:
            return self._fetch_file(self.fs, [spec], verify, None)
        return got

    def _settle(self, spec: LoadSpec, result: Fetched, batch: Batch | None = None) -> Block | None:
        """Count an outcome; discard what failed verification; promote filesystem hits to RAM (handing an
        owned slot over, or giving it back), into `batch` when the caller settles a chunk's together.
        Returns the block, or None for a miss."""
        outcome, why = result.outcome, result.why
        tier = {Outcome.RAM_HIT: "ram", Outcome.FS_HIT: "disk"}.get(outcome, "missed")
        served = self.served.setdefault(spec.request_id, {})
        served[tier] = served.get(tier, 0) + 1
        if outcome == Outcome.RAM_HIT:
            self.stats.ram_hits += 1
        elif outcome == Outcome.FS_HIT:
            self.stats.fs_hits += 1
            assert result.block is not None
            if spec.promote and self.ram is not None:  # verified already: no second pass
                if batch is not None and result.owned:
                    batch.promote.append((spec.key, result.block, result.digest))
                else:
                    self.stats.evictions += self.ram.put(spec.key, result.block, result.digest, owned=result.owned)
            elif result.owned:
                self._release(result, batch)
        elif outcome == Outcome.MISS:
            self.stats.misses += 1
        elif outcome == Outcome.IO:
            self.stats.io_errors += 1
            self.stats.warn_once("io", "cannot read block %s: %s", spec.key, why)
        else:
            self.stats.corrupt += 1
            self.stats.warn_once("corrupt", "%s block %s rejected: %s", result.tier, spec.key, why)
            self._tier(result.tier).discard(spec.key if result.tier == TierName.RAM else spec.file_key)
        return result.block if outcome in (Outcome.RAM_HIT, Outcome.FS_HIT) else None

    def _release_late(self, job: Future) -> None:
        """Give back the slots a read that was given up on filled, once it ends."""
        for result in job.result():
            self._release(result)

    def _release(self, result: Fetched, batch: Batch | None = None) -> None:
        """Give an owned slot back to the pool, or to `batch`, to be given back with others."""
        if result.owned and self.pool is not None and result.block is not None:
            if batch is None:
                self.pool.give_back(result.block)
            else:
                batch.back.append(result.block)

    def _tier(self, name: TierName | None) -> Tier:
        tier = self.ram if name == TierName.RAM else self.fs
        assert tier is not None
        return tier

    def _reads(self, loads: list[LoadSpec], in_ram: set[str]) -> Iterator[list[LoadSpec]]:
        """The loads in order, as reads: a RAM hit alone, and the consecutive blocks of one file together."""
        group: list[LoadSpec] = []
        for spec in loads:
            if (group and spec.key not in in_ram and spec.file_key == group[-1].file_key
                    and spec.count == group[-1].count and spec.offset == group[-1].offset + 1):
                group.append(spec)
                continue
            if group:
                yield group
            group = [spec]
            if spec.key in in_ram:
                yield group
                group = []
        if group:
            yield group

    def fetch_all(self, loads: list[LoadSpec], verify: bool = True) -> Iterator[tuple[LoadSpec, Fetched]]:
        """What each load finds, in load order, checked on the host with verify. File reads run on the load
        threads, a file's blocks in one read (reads, hashing and tensor copies release the GIL) while the
        caller uses earlier blocks; with on-device checks AHEAD_CHUNKS ahead (whole files), as each block
        holds a pool slot. Checked RAM hits beside a GPU run on the load threads too; on the CPU here, as the
        model's threads want the cores (handing the hashing over cost more than it saved); unchecked ones are
        a lookup, here."""
        ram, fs, loaders = self.ram, self.fs, self.loaders
        assert loaders is not None, "register() first"
        in_ram = {spec.key for spec in loads if ram is not None and ram.contains(spec.key)}
        threaded_ram = verify and self.transfer.ram_checks_on_load_threads
        ahead = AHEAD_CHUNKS * self.device_copies.chunk if self.on_device else len(loads)
        queued: deque[tuple[list[LoadSpec], Future | None]] = deque()
        from_files = sum(spec.key not in in_ram and spec.count > 0 for spec in loads) if fs is not None else 0
        slots: list[Block] = []  # with a pool: slots for file reads, taken a chunk at a time, in load order
        in_flight = 0  # blocks queued

        def queue(group: list[LoadSpec]) -> None:
            nonlocal from_files, slots, in_flight
            job = None
            if ram is not None and group[0].key in in_ram:
                if threaded_ram:
                    job = loaders.submit(self._fetch_ram, group[0], verify)
            elif fs is None or group[0].count == 0:  # in no file: a miss
                pass
            elif self.reads_to_device is not None:  # no RAM tier (register): no block is promoted to host memory
                assert not verify, "blocks read into device memory are checked there (_check_and_write)"
                job = loaders.submit(self._fetch_file_to_device, fs, group)
            elif self.pool is not None:  # neighbouring slots: one copy moves a run (_stage)
                taken: list[Block] = []
                while len(taken) < len(group):
                    if not slots:
                        slots = self.pool.take_many(min(from_files, self.device_copies.chunk))[::-1]
                    taken.append(slots.pop())
                    from_files -= 1
                job = loaders.submit(self._fetch_file, fs, group, verify, taken)
            else:
                job = loaders.submit(self._fetch_file, fs, group, verify, None)
            queued.append((group, job))
            in_flight += len(group)

        pending = self._reads(loads, in_ram)
        while in_flight < ahead and (more := next(pending, None)) is not None:
            queue(more)
        wait_s = LOAD_WAIT_S  # once a read has not answered in it, the filesystem hangs: no read is waited for
        while queued:
            group, job = queued.popleft()
            in_flight -= len(group)
            if job is not None:
                waited = time.perf_counter()
                try:
                    results = job.result(timeout=wait_s)
                except TimeoutError:  # the read goes on in its thread: the slots it fills go back when it ends
                    job.add_done_callback(self._release_late)
                    results = [Fetched(Outcome.IO, why=f"no answer in {LOAD_WAIT_S:g} s")] * len(group)
                    wait_s = 0
                self.stats.load_read_wait_seconds += time.perf_counter() - waited
            elif ram is not None and group[0].key in in_ram:
                results = self._fetch_ram(group[0], verify)
            else:
                results = [Fetched(Outcome.MISS)] * len(group)
            while in_flight < ahead and (more := next(pending, None)) is not None:
                queue(more)
            yield from zip(group, results)

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
        self.broken, self.served = set(), {}
        self.unheard = max(0, self.unheard - 1)
        self.begin_step(meta)
        started = time.perf_counter()
        if self.on_device:
            written = self._load_on_device(meta.loads)
        else:
            written = self.transfer.inject(self.to_write(meta, self._verified(meta.loads)))
        if self.broken:  # this step and the next (planned before vLLM reports this one, with async scheduling)
            self.failed_plan, self.unheard = meta.failures, 2
        if self.ram is not None:  # every looked-up block's copy is queued: what the tier dropped may go back
            self.ram.release()
        self.stats.load_bytes += self.block_bytes() * written
        self.stats.load_seconds += time.perf_counter() - started
        if self.load_log and self.served:
            self.append_log(self.load_log, [{"request": r, **tiers} for r, tiers in self.served.items()])

    def append_log(self, path: str, lines: list[dict]) -> None:
        """Append JSON lines to a log the bench reads (the load log, the canary's fault log); a log that
        cannot be written is said once, never raised."""
        try:
            with open(path, "a") as f:
                f.write("".join(json.dumps(line) + "\n" for line in lines))
        except OSError as exc:
            self.stats.warn_once("log", "cannot write %s: %s", path, exc)

    def _verified(self, loads: list[LoadSpec]) -> Iterator[tuple[LoadSpec, Block]]:
        """Host-checked blocks in load order; a request stops at its first block that fails."""
        for spec, result in self.fetch_all(loads):
            block = self._settle(spec, result)
            if block is None:  # vLLM recomputes from this block on
                self._failed(spec, {})
            elif spec.request_id not in self.broken:
                yield spec, block

    def to_write(self, meta: KVScopeMetadata, verified: Iterator[tuple[LoadSpec, Block]]
                 ) -> Iterable[tuple[int, Block]]:
        """What goes into the KV cache for a step's host-checked blocks: each block as it comes. The one hook
        the fault-injection canaries override (canary.py)."""
        return ((spec.block_id, block) for spec, block in verified)

    def _load_on_device(self, loads: list[LoadSpec]) -> int:
        """Loads checked on the GPU, a chunk at a time: once a chunk's blocks are here they go to the GPU
        together, and the chunk before is checked (and its good blocks written) while they travel. Returns
        how many were written."""
        if not loads:
            return 0
        n = min(self.device_copies.chunk, len(loads))
        chunks = [torch.empty((n, self.layout.nbytes), dtype=torch.uint8, device=self.device) for _ in range(2)]
        first_bad: dict[str, int] = {}  # request -> index of its first block that failed: none from there on
        written, filling = 0, 0
        staged: list[tuple[LoadSpec, Fetched]] = []
        previous: tuple[torch.Tensor, list[tuple[LoadSpec, Fetched]], torch.cuda.Event | None] | None = None
        for spec, got in self.fetch_all(loads, verify=False):
            if got.block is None:
                self._settle(spec, got)
                self._failed(spec, first_bad)
                continue
            if _past_failure(spec, first_bad):
                self._release(got)
                continue
            staged.append((spec, got))
            if len(staged) == n:  # this chunk is full: on its way, check the one before
                arrived = self._stage(chunks[filling], staged)
                if previous is not None:
                    written += self._check_and_write(*previous, first_bad)
                previous, filling, staged = (chunks[filling], staged, arrived), 1 - filling, []
        arrived = self._stage(chunks[filling], staged)
        if previous is not None:
            written += self._check_and_write(*previous, first_bad)
        written += self._check_and_write(chunks[filling], staged, arrived, first_bad)
        for chunk in chunks:  # its copies are done (checked above); no reuse before the side stream's queue
            self.side.keep(chunk)
        return written

    def _stage(self, chunk: torch.Tensor, staged: list[tuple[LoadSpec, Fetched]]) -> torch.cuda.Event | None:
        """Copy a chunk's blocks into its staging buffer on the side stream, once the writes that last read
        the buffer are done: one copy per run of blocks side by side (neighbouring pool slots, or a file's
        blocks read into device memory). Returns the copies' event (None for no block)."""
        assert self.pool is not None, "checks on the device hold blocks in pool slots"
        if not staged:
            return None
        with self.side.after_current():
            for first, count, src in self.pool.spans([got.block for _, got in staged]):
                chunk[first:first + count].copy_(src, non_blocking=True)
                if not src.is_cpu:  # read into device memory: not reused under the copy
                    self.side.keep(src)
        return self.side.mark()

    def _failed(self, spec: LoadSpec, first_bad: dict[str, int]) -> None:
        self.load_errors.add(spec.block_id)
        self.broken.add(spec.request_id)
        first_bad[spec.request_id] = min(spec.index, first_bad.get(spec.request_id, spec.index))

    def _check_and_write(self, chunk: torch.Tensor, staged: list[tuple[LoadSpec, Fetched]],
                         arrived: torch.cuda.Event | None, first_bad: dict[str, int]) -> int:
        """Check one staged chunk's checksums on the GPU (reading them back is the one wait) and write the
        blocks that match, up to each request's first failure, into the KV cache."""
        if not staged:
            return 0
        waited = time.perf_counter()
        Side.wait(arrived)
        rows = chunk[:len(staged)]
        found = [digest_hex(pair) for pair in mix_digests(rows).tolist()]
        self.stats.load_device_wait_seconds += time.perf_counter() - waited
        keep, ids, batch = [], [], Batch()  # the chunk's slots given back, and its promotions, together
        try:
            for row, ((spec, got), digest) in enumerate(zip(staged, found)):
                if digest != got.digest:
                    self._release(got, batch)
                    self._settle(spec, got._replace(outcome=Outcome.CORRUPT, why="checksum mismatch (on the GPU)"))
                    self._failed(spec, first_bad)
                elif _past_failure(spec, first_bad):
                    self._release(got, batch)
                else:
                    self._settle(spec, got, batch)
                    keep.append(row)
                    ids.append(spec.block_id)
            if ids:
                self.device_copies.write(rows if len(keep) == len(staged) else rows[keep], ids)
        finally:
            if batch.promote and self.ram is not None:
                self.stats.evictions += self.ram.put_many(batch.promote, owned=True)
            if self.ram is not None:  # every RAM hit looked up so far is staged (the next chunk before this one
                self.ram.release()  # is checked): what the tier dropped may go back, with the chunk's slots
            if batch.back and self.pool is not None:
                self.pool.give_back(*batch.back)
        return len(ids)

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

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
        saved = self.transfer.copy_out([spec.block_id for spec in meta.stores])
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
                    stats.evictions += self.ram.put_many(to_ram, owned=self.pool is not None)
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
            stats.evictions += self.ram.put_many(to_ram, owned=self.pool is not None)
        if back and self.pool is not None:
            self.pool.give_back(*back)
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
        stats, self.stats = self.stats, Stats(logged=self.logged)
        if self.pool is not None:
            stats.pool_grow_seconds += self.pool.take_grow_seconds()
        return stats
