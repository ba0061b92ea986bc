"""Loads, one loader per medium the blocks come through, picked once when vLLM registers its KV caches
(worker.register), as vLLM's offloading keeps one handler per source and destination medium:

- HostLoader: blocks checked on the host (XXH3-128; the CPU's way, and the canary's everywhere) and written
  into the KV cache as they come (paths.py).
- SlotLoader: beside a GPU, host blocks in pinned pool slots (RAM hits where the tier keeps them, file reads
  into slots taken a chunk at a time), staged on the GPU a chunk at a time and checked there (mix128).
- KvikioLoader: as SlotLoader, its file hits read by KvikIO straight into device memory (no RAM tier).

A loader is handed its media (Media) when built, and keeps a step's outcomes: the blocks vLLM recomputes, the
requests that stop at a failed block, the tier that served each block. The worker (worker.py) runs it.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from typing import NamedTuple

import torch

from .blocks import Block, CorruptBlock, Layout, digest_hex, mix_digests
from .devicereads import Read
from .messages import KVScopeMetadata, LoadSpec, Outcome, TierName
from .paths import DeviceCopies, HostRows
from .store import FsTier, RamTier, Stats, Tier
from .transfer import Side, SlotPool

AHEAD_CHUNKS = 4  # with on-device checks, the blocks a load reads ahead, in chunks: each holds a pool slot. At
# the Qwen3-4B shape's 4.5 MiB blocks, 112 blocks: 14 files of 8 queued (a 16k-token file hit on an H100, 8 load
# threads: 84 ms against 92-93 with 2 chunks, one run each without servers: 2026-12-06-h100-connector-pinned-pool)
LOAD_WAIT_S = 30.0  # the longest a load waits for a read (one that hangs: a dead NFS server); then it and every
# read not done yet are misses

Written = Callable[[KVScopeMetadata, Iterator[tuple[LoadSpec, Block]]], Iterable[tuple[int, Block]]]
FileRead = Callable[[], "list[Fetched]"]  # one file's read, run on a load thread


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


@dataclass
class Media:
    """What a loader works with, known once vLLM registers its KV caches."""

    layout: Layout
    transfer: HostRows | DeviceCopies  # how blocks cross into the KV cache
    ram: RamTier | None
    fs: FsTier | None
    stats: Stats  # the worker's counters (one object for the worker's life)
    threads: ThreadPoolExecutor  # the load threads
    side: Side
    pool: SlotPool | None = None  # host slots of the blocks, with on-device checks
    reads: Read | None = None  # KvikIO's file reads into device memory
    read_stream: torch.cuda.Stream | None = None  # where their device memory is allocated


def fetch(name: TierName, read: Callable[[], list[tuple[Block, str]] | None], n: int = 1,
          owned: bool = False) -> list[Fetched]:
    """Get n blocks from one tier: `read` is its get; runs on a load thread or inline, so it only returns what
    happened (whatever it raises, a block that cannot be loaded is a miss, and so is every block read with it)."""
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


def _past_failure(spec: LoadSpec, first_bad: dict[str, int]) -> bool:
    """Whether a block lies at or after its request's first failed block (vLLM recomputes those)."""
    return spec.request_id in first_bad and spec.index >= first_bad[spec.request_id]


def _reads(loads: list[LoadSpec], in_ram: set[str]) -> Iterator[list[LoadSpec]]:
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


class Loader:
    """What every loader shares: reads queued on the load threads in load order, outcomes counted."""

    verify = True  # blocks checked on the host as they are read (else on the device, after the copy)
    owns_slots = False  # a tier's reads fill pool slots, given back or handed to the RAM tier once used

    def __init__(self, media: Media):
        self.media = media
        self.layout, self.ram, self.fs, self.stats = media.layout, media.ram, media.fs, media.stats
        self.threads = media.threads
        self.threaded_ram = False  # checked RAM hits on the load threads (else here, on the forward thread)
        self.load_errors: set[int] = set()
        self.broken: set[str] = set()  # requests with a failed load this step: none of their blocks after it loads
        self.served: dict[str, dict[str, int]] = {}  # this step's request -> tier -> blocks

    def load(self, meta: KVScopeMetadata, to_write: Written) -> int:
        """A step's loads into the KV cache; returns how many blocks were written. `to_write` is the worker's
        hook over host-checked blocks (the canary's faults)."""
        raise NotImplementedError

    def read_slots_bytes(self) -> int:
        """The pool's bytes a load's file reads hold at most."""
        return 0

    def ahead(self, loads: int) -> int:
        """The blocks read ahead of the one in use."""
        return loads

    def file_reads(self, fs: FsTier, loads: list[LoadSpec], in_ram: set[str]
                   ) -> Callable[[list[LoadSpec]], FileRead]:
        """For one load, a file's consecutive blocks -> the read a load thread runs (taken in load order)."""
        return lambda group: partial(self.fetch_file, fs, group)

    def give_back(self, *blocks: Block) -> None:
        """Owned slots back to the pool (host buffers of their own have none)."""

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    def start(self) -> None:
        self.broken, self.served = set(), {}

    def fetch_file(self, fs: FsTier, specs: list[LoadSpec], slots: list[Block] | None = None) -> list[Fetched]:
        """Consecutive blocks of one file in one read, into `slots` (the caller's), else pool slots of the
        tier's (owns_slots) or buffers of their own."""
        first = specs[0]
        read = partial(fs.get_file, first.file_key, [spec.key for spec in specs], first.offset, first.count,
                       self.verify, slots)
        return fetch(TierName.FS, read, len(specs), owned=self.owns_slots)

    def fetch_ram(self, spec: LoadSpec) -> list[Fetched]:
        """A block planned from RAM; from its file when the RAM tier evicted it since the plan (promotions and
        saves fill it within a step): a miss would make vLLM recompute, which vLLM 0.26 on a GPU gets wrong."""
        assert self.ram is not None
        ram, verify = self.ram, self.verify
        got = fetch(TierName.RAM, lambda: None if (found := ram.get(spec.key, verify)) is None else [found])
        if got[0].outcome == Outcome.MISS and self.fs is not None and spec.count > 0:
            return self.fetch_file(self.fs, [spec])
        return got

    def fetch_all(self, loads: list[LoadSpec]) -> Iterator[tuple[LoadSpec, Fetched]]:
        """What each load finds, in load order. File reads run on the load threads, a file's blocks in one read
        (reads, hashing and tensor copies release the GIL) while the caller uses earlier blocks, ahead() blocks
        ahead (whole files). Checked RAM hits run there too with threaded_ram; else here (unchecked ones are a
        lookup)."""
        ram, fs, threads = self.ram, self.fs, self.threads
        in_ram = {spec.key for spec in loads if ram is not None and ram.contains(spec.key)}
        ahead = self.ahead(len(loads))
        read_file = self.file_reads(fs, loads, in_ram) if fs is not None else None
        queued: deque[tuple[list[LoadSpec], Future | None]] = deque()
        in_flight = 0  # blocks queued

        def queue(group: list[LoadSpec]) -> None:
            nonlocal in_flight
            job = None
            if ram is not None and group[0].key in in_ram:
                if self.threaded_ram:
                    job = threads.submit(self.fetch_ram, group[0])
            elif read_file is not None and group[0].count > 0:  # else in no file: a miss
                job = threads.submit(read_file(group))
            queued.append((group, job))
            in_flight += len(group)

        pending = _reads(loads, in_ram)
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
                results = self.fetch_ram(group[0])
            else:
                results = [Fetched(Outcome.MISS)] * len(group)
            while in_flight < ahead and (more := next(pending, None)) is not None:
                queue(more)
            yield from zip(group, results)

    def settle(self, spec: LoadSpec, result: Fetched, batch: Batch | None = None) -> Block | None:
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
                self.release(result, batch)
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

    def failed(self, spec: LoadSpec, first_bad: dict[str, int]) -> None:
        self.load_errors.add(spec.block_id)
        self.broken.add(spec.request_id)
        first_bad[spec.request_id] = min(spec.index, first_bad.get(spec.request_id, spec.index))

    def release(self, result: Fetched, batch: Batch | None = None) -> None:
        """Give an owned slot back to the pool, or to `batch`, to be given back with others."""
        if result.owned and result.block is not None:
            if batch is None:
                self.give_back(result.block)
            else:
                batch.back.append(result.block)

    def _release_late(self, job: Future) -> None:
        """Give back the slots a read that was given up on filled, once it ends."""
        for result in job.result():
            self.release(result)

    def _tier(self, name: TierName | None) -> Tier:
        tier = self.ram if name == TierName.RAM else self.fs
        assert tier is not None
        return tier


class HostLoader(Loader):
    """Blocks checked on the host as they are read, each written into the KV cache as it comes (numpy rows
    beside a CPU cache). Its RAM hits are checked on the load threads where the transfer path says the host's
    cores are otherwise idle (beside a GPU); on the CPU here, as the model's threads want the cores (handing
    the hashing over cost more than it saved)."""

    def __init__(self, media: Media):
        super().__init__(media)
        self.transfer = media.transfer
        self.threaded_ram = media.transfer.ram_checks_on_load_threads

    def load(self, meta: KVScopeMetadata, to_write: Written) -> int:
        self.start()
        return self.transfer.inject(to_write(meta, self.verified(meta.loads)))

    def verified(self, loads: list[LoadSpec]) -> Iterator[tuple[LoadSpec, Block]]:
        """Host-checked blocks in load order; a request stops at its first block that fails."""
        for spec, result in self.fetch_all(loads):
            block = self.settle(spec, result)
            if block is None:  # vLLM recomputes from this block on
                self.failed(spec, {})
            elif spec.request_id not in self.broken:
                yield spec, block


class DeviceLoader(Loader):
    """Blocks checked on the device, a chunk at a time: once a chunk's blocks are here they go to the GPU
    together, on the side stream, and the chunk before is checked (and its good blocks written) while they
    travel. Host blocks are pool slots. The file reads are its subclasses'."""

    verify = False
    owns_slots = True

    def __init__(self, media: Media):
        super().__init__(media)
        assert isinstance(media.transfer, DeviceCopies) and media.pool is not None, "checks on the device"
        self.copies, self.pool, self.side = media.transfer, media.pool, media.side

    def ahead(self, loads: int) -> int:
        return AHEAD_CHUNKS * self.copies.chunk

    def give_back(self, *blocks: Block) -> None:
        self.pool.give_back(*blocks)

    def load(self, meta: KVScopeMetadata, to_write: Written) -> int:
        self.start()
        return self._load_on_device(meta.loads)

    def _load_on_device(self, loads: list[LoadSpec]) -> int:
        """Loads checked on the GPU, a chunk at a time. Returns how many were written."""
        if not loads:
            return 0
        n = min(self.copies.chunk, len(loads))
        device = self.copies.device
        chunks = [torch.empty((n, self.layout.nbytes), dtype=torch.uint8, device=device) for _ in range(2)]
        first_bad: dict[str, int] = {}  # request -> index of its first block that failed: none from there on
        written, filling = 0, 0
        staged: list[tuple[LoadSpec, Fetched]] = []
        previous: tuple[torch.Tensor, list[tuple[LoadSpec, Fetched]], torch.cuda.Event | None] | None = None
        for spec, got in self.fetch_all(loads):
            if got.block is None:
                self.settle(spec, got)
                self.failed(spec, first_bad)
                continue
            if _past_failure(spec, first_bad):
                self.release(got)
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

    def _keep_source(self, src: torch.Tensor) -> None:
        """Keep a staged run's source from reuse under its copy (pool slots: the pool's events do)."""

    def _stage(self, chunk: torch.Tensor, staged: list[tuple[LoadSpec, Fetched]]) -> torch.cuda.Event | None:
        """Copy a chunk's blocks into its staging buffer on the side stream, once the writes that last read
        the buffer are done: one copy per run of blocks side by side (neighbouring pool slots, or a file's
        blocks read into device memory). Returns the copies' event (None for no block)."""
        if not staged:
            return None
        with self.side.after_current():
            for first, count, src in self.pool.spans([got.block for _, got in staged]):
                chunk[first:first + count].copy_(src, non_blocking=True)
                self._keep_source(src)
        return self.side.mark()

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
                    self.release(got, batch)
                    self.settle(spec, got._replace(outcome=Outcome.CORRUPT, why="checksum mismatch (on the GPU)"))
                    self.failed(spec, first_bad)
                elif _past_failure(spec, first_bad):
                    self.release(got, batch)
                else:
                    self.settle(spec, got, batch)
                    keep.append(row)
                    ids.append(spec.block_id)
            if ids:
                self.copies.write(rows if len(keep) == len(staged) else rows[keep], ids)
        finally:
            if batch.promote and self.ram is not None:
                self.stats.evictions += self.ram.put_many(batch.promote, owned=True)
            if self.ram is not None:  # every RAM hit looked up so far is staged (the next chunk before this one
                self.ram.release()  # is checked): what the tier dropped may go back, with the chunk's slots
            if batch.back:
                self.pool.give_back(*batch.back)
        return len(ids)


class SlotLoader(DeviceLoader):
    """Checked on the device, its file hits read on the load threads into pool slots taken a chunk at a time
    in load order: neighbouring slots, so one copy moves a run (_stage)."""

    def read_slots_bytes(self) -> int:
        """The chunks read ahead, the one staged, the one checked."""
        return (AHEAD_CHUNKS + 2) * self.copies.chunk * self.layout.nbytes if self.fs is not None else 0

    def file_reads(self, fs: FsTier, loads: list[LoadSpec], in_ram: set[str]
                   ) -> Callable[[list[LoadSpec]], FileRead]:
        from_files = sum(spec.key not in in_ram and spec.count > 0 for spec in loads)
        slots: list[Block] = []  # taken a chunk at a time, in load order

        def read(group: list[LoadSpec]) -> FileRead:
            nonlocal from_files, slots
            taken: list[Block] = []
            while len(taken) < len(group):
                if not slots:
                    slots = self.pool.take_many(min(from_files, self.copies.chunk))[::-1]
                taken.append(slots.pop())
                from_files -= 1
            return partial(self._fetch_into, fs, group, taken)
        return read

    def _fetch_into(self, fs: FsTier, specs: list[LoadSpec], slots: list[Block]) -> list[Fetched]:
        """A file's blocks into the slots taken for them, given back unless they hold a block."""
        got = self.fetch_file(fs, specs, slots)
        if got[0].block is None:
            self.pool.give_back(*slots)
        return got


class KvikioLoader(DeviceLoader):
    """Checked on the device, its file hits read by KvikIO straight into device memory of their own, each
    file's header read and checked on the host first. No RAM tier (register): no block is promoted to host
    memory, and no host slot is taken for a read."""

    owns_slots = False

    def __init__(self, media: Media):
        super().__init__(media)
        assert media.reads is not None, "KvikIO's reads"
        self.reads: Read = media.reads
        self.read_stream = media.read_stream

    def file_reads(self, fs: FsTier, loads: list[LoadSpec], in_ram: set[str]
                   ) -> Callable[[list[LoadSpec]], FileRead]:
        return lambda group: partial(self._fetch_to_device, fs, group)

    def _fetch_to_device(self, fs: FsTier, specs: list[LoadSpec]) -> list[Fetched]:
        """Consecutive blocks of one file in one read straight into device memory of their own, the header
        read and checked on the host; their checksums are checked on the device (_check_and_write)."""
        first = specs[0]

        def read() -> list[tuple[Block, str]] | None:
            rows = self._device_rows(len(specs))
            return fs.get_file_to(first.file_key, [spec.key for spec in specs], first.offset, first.count, rows,
                                  self.reads)
        return fetch(TierName.FS, read, len(specs))

    def _device_rows(self, n: int) -> torch.Tensor:
        """Device memory for n blocks read by KvikIO, allocated on a stream nothing runs on: memory the caching
        allocator hands back there is free of queued kernels (GPUDirect Storage writes it outside any stream's
        order). No room for it beside vLLM's KV cache is a failed read (fetch), not a crash."""
        with torch.cuda.stream(self.read_stream) if self.read_stream is not None else contextlib.nullcontext():
            return torch.empty((n, self.layout.nbytes), dtype=torch.uint8, device=self.copies.device)

    def _keep_source(self, src: torch.Tensor) -> None:
        self.side.keep(src)  # a file read into device memory: not reused under the copy
