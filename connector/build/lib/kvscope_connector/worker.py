"""Worker side: copy blocks between vLLM's paged KV cache and the tiers, verifying every load.

A block travels as one flat byte buffer (store.Layout): one checksum call and, on a GPU, one transfer
per block rather than one per layer.

Loads run in start_load_kv, before the forward: file reads and their checks run on four load threads while
the forward thread copies verified blocks into the KV cache. Stores start in wait_for_save, after the
forward: the step's new blocks are copied out of the KV cache at once (vLLM may reuse them after the
step), then checksummed and written by one save thread, off the forward path; a load waits only for the
pending saves of the keys it reads. A block that fails verification is a miss: its id goes back to vLLM
through get_block_ids_with_load_errors() and vLLM recomputes it.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import numpy as np
import torch

from .blocks import Block, CorruptBlock, Layout, checksum
from .messages import KVScopeMetadata, LoadSpec, Outcome, StoreSpec, TierName
from .store import FsTier, RamTier, Stats, Tier

MAX_PENDING_BYTES = 1 << 30  # host copies waiting for the save thread; beyond this a save waits for it


class Fetched(NamedTuple):
    """What a load found under one key: a verified block with its checksum, or why there is none."""

    outcome: Outcome
    tier: TierName | None = None  # where it was found (or failed)
    block: Block | None = None
    digest: str = ""
    why: str = ""


class WorkerSide:
    def __init__(self, fingerprint: str, block_size: int, ram: RamTier | None, fs: FsTier | None):
        self.fp, self.block_size, self.ram, self.fs = fingerprint, block_size, ram, fs
        self.layers: dict[str, torch.Tensor] = {}
        self._layout: Layout | None = None  # where each layer lies in a block; set by register()
        self.device = torch.device("cpu")
        self.rows: dict[str, np.ndarray] = {}  # CPU caches as [num_blocks, bytes] arrays
        self.logged: set[str] = set()  # kinds of fault already logged once
        self.stats = Stats(logged=self.logged)
        self.load_errors: set[int] = set()
        # four reads in flight beat two from disk; one save thread keeps stores in order
        self.loaders = ThreadPoolExecutor(max_workers=4, thread_name_prefix="kvscope-load")
        self.saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvscope-save")
        self.saving: list[tuple[Future, set[str], int]] = []  # (job, keys it stores, bytes it holds), oldest first

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Take vLLM's per-layer KV caches, each [num_blocks, ...]. On the CPU, loads copy with numpy into
        byte rows of the caches (a torch op per layer and block costs more than its bytes), which needs
        contiguous caches; vLLM's CPU backend allocates them so."""
        self.layers = dict(sorted(kv_caches.items()))
        self._layout = Layout({name: t[0] for name, t in self.layers.items()})
        if self.fs is not None:
            self.fs.layout = self.layout
        self.device = next(iter(self.layers.values())).device
        if self.ram is not None:
            self.ram.pin = self.device.type == "cuda"  # host-to-device copies straight from the tier
        if self.device.type == "cpu":
            bad = [name for name, t in self.layers.items() if not t.is_contiguous()]
            if bad:
                raise ValueError(f"kvscope connector: the CPU KV caches of {bad} are not contiguous")
            self.rows = {name: t.view(t.shape[0], -1).view(torch.uint8).numpy() for name, t in self.layers.items()}

    @property
    def layout(self) -> Layout:
        if self._layout is None:
            raise RuntimeError("kvscope connector: no block layout before vLLM registers its KV caches")
        return self._layout

    def block_bytes(self) -> int:
        return self.layout.nbytes

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.device)

    def extract(self, block_ids: list[int]) -> list[Block]:
        """The blocks' host copies. On the CPU numpy copies each layer's row into a buffer per block; on a
        GPU one gather per layer into a packed [blocks, bytes] buffer, then one copy of it into pinned
        memory (block by block, a GPU model's 36 layers x 60 blocks would be 2160 synchronous copies per
        prompt; a fresh pageable buffer of hundreds of MB costs more in page faults than the copy)."""
        if not block_ids:
            return []
        if self.device.type == "cpu":
            blocks = [torch.empty(self.layout.nbytes, dtype=torch.uint8) for _ in block_ids]
            for block, block_id in zip(blocks, block_ids):
                row = block.numpy()
                for e in self.layout.entries:
                    row[e.start:e.end] = self.rows[e.name][block_id]
            return blocks
        idx, n = self._index(block_ids), len(block_ids)
        packed = torch.empty((n, self.layout.nbytes), dtype=torch.uint8, device=self.device)
        for e in self.layout.entries:
            packed[:, e.start:e.end] = self.layers[e.name].index_select(0, idx).view(n, -1).view(torch.uint8)
        host = torch.empty((n, self.layout.nbytes), dtype=torch.uint8, pin_memory=True)
        host.copy_(packed)
        return list(host)

    def inject(self, items: Iterable[tuple[int, Block]]) -> int:
        """Write verified blocks into the KV cache as they come; returns how many. On the CPU numpy copies
        each layer's bytes straight into its row. On a GPU each block is copied to the device as it comes
        (asynchronously, from pinned memory: the RAM tier's blocks are pinned, others are pinned first),
        overlapping the verification of the next ones; then one index_copy_ per layer, on the same stream."""
        if self.device.type == "cpu":
            count = 0
            for block_id, block in items:
                src = block.numpy()
                for e in self.layout.entries:
                    self.rows[e.name][block_id] = src[e.start:e.end]
                count += 1
            return count
        ids, on_device = [], []
        for block_id, block in items:  # each block goes over as soon as it is verified
            src = block if block.is_pinned() else block.pin_memory()
            on_device.append(src.to(self.device, non_blocking=True))
            ids.append(block_id)
        if ids:
            blocks, idx = torch.stack(on_device), self._index(ids)
            for e in self.layout.entries:
                layer = blocks[:, e.start:e.end].view(e.dtype).view(len(ids), *e.shape)
                self.layers[e.name].index_copy_(0, idx, layer)
        return len(ids)

    # Loads

    @staticmethod
    def _fetch(tier: Tier, name: TierName, key: str) -> Fetched:
        """Get and verify one block from one tier; runs on a load thread or inline, so it only returns what
        happened (whatever it raises, a block that cannot be loaded is a miss, never a crash)."""
        hit = Outcome.RAM_HIT if name == TierName.RAM else Outcome.FS_HIT
        try:
            found = tier.get(key)
        except OSError as exc:
            return Fetched(Outcome.IO, name, why=str(exc))
        except Exception as exc:  # CorruptBlock, or anything an unforeseen file makes the parser raise
            why = str(exc) if isinstance(exc, CorruptBlock) else f"{type(exc).__name__}: {exc}"
            return Fetched(Outcome.CORRUPT, name, why=why)
        return Fetched(Outcome.MISS, name) if found is None else Fetched(hit, name, *found)

    def _settle(self, spec: LoadSpec, result: Fetched) -> Block | None:
        """Count an outcome; discard what failed verification; promote filesystem hits to RAM."""
        outcome, why = result.outcome, result.why
        if outcome == Outcome.RAM_HIT:
            self.stats.ram_hits += 1
        elif outcome == Outcome.FS_HIT:
            self.stats.fs_hits += 1
            if spec.promote and self.ram is not None:  # decode verified the checksum: no second pass
                self.stats.evictions += self.ram.put(spec.key, result.block, result.digest)
        elif outcome == Outcome.MISS:
            self.stats.misses += 1
        elif outcome == Outcome.IO:
            self.stats.io_errors += 1
            self.stats.warn_once("io", "cannot read block %s: %s", spec.key, why)
        else:
            self.stats.corrupt += 1
            self.stats.warn_once("corrupt", "%s block %s rejected: %s", result.tier, spec.key, why)
            self._tier(result.tier).discard(spec.key)
        return result.block

    def _tier(self, name: TierName | None) -> Tier:
        tier = self.ram if name == TierName.RAM else self.fs
        assert tier is not None
        return tier

    def fetch_all(self, loads: list[LoadSpec]) -> Iterator[tuple[LoadSpec, Block | None]]:
        """Verified blocks in load order, or None for a miss. File reads and their checks run on the load
        threads (reads, hashing and tensor copies release the GIL) while the caller injects earlier blocks.
        Beside a GPU, whose host cores are otherwise idle, RAM hits are checked on the load threads too; on
        the CPU they are checked here, as the model's threads want the cores (handing the hashing over
        cost more than it saved)."""
        ram, fs = self.ram, self.fs
        in_ram = {spec.key for spec in loads if ram is not None and ram.contains(spec.key)}
        inline = self.device.type == "cpu"
        jobs = {}
        for spec in loads:
            if ram is not None and spec.key in in_ram:
                if not inline:
                    jobs[spec.key] = self.loaders.submit(self._fetch, ram, TierName.RAM, spec.key)
            elif fs is not None:
                jobs[spec.key] = self.loaders.submit(self._fetch, fs, TierName.FS, spec.key)
        for spec in loads:
            if spec.key in jobs:
                result = jobs[spec.key].result()
            elif ram is not None and spec.key in in_ram:
                result = self._fetch(ram, TierName.RAM, spec.key)
            else:
                result = Fetched(Outcome.MISS)
            yield spec, self._settle(spec, result)

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
            self._collect(wait_upto=last)

    def load(self, meta: KVScopeMetadata) -> None:
        self.begin_step(meta)
        started = time.perf_counter()

        def verified() -> Iterator[tuple[LoadSpec, Block]]:
            broken: set[str] = set()  # requests with a failed block: vLLM recomputes from that block on
            for spec, block in self.fetch_all(meta.loads):
                if block is None:
                    self.load_errors.add(spec.block_id)
                    broken.add(spec.request_id)
                elif spec.request_id not in broken:
                    yield spec, block

        self.stats.load_bytes += self.block_bytes() * self.inject(self.to_write(meta, verified()))
        self.stats.load_seconds += time.perf_counter() - started

    def to_write(self, meta: KVScopeMetadata, verified: Iterator[tuple[LoadSpec, Block]]
                 ) -> Iterable[tuple[int, Block]]:
        """What goes into the KV cache for a step's verified blocks: each block as it comes. The one hook
        the fault-injection canaries override (canary.py)."""
        return ((spec.block_id, block) for spec, block in verified)

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors

    # Saves

    def save(self, meta: KVScopeMetadata) -> None:
        """Copy this step's new blocks out of the KV cache, then hand them to the save thread."""
        if not meta.stores and not meta.ram_evict:
            return
        started = time.perf_counter()
        blocks = self.extract([spec.block_id for spec in meta.stores])
        held = self.block_bytes() * len(blocks)
        while self.saving and sum(b for _, _, b in self.saving) + held > MAX_PENDING_BYTES:
            self._collect(wait_upto=0)  # the save thread is behind: wait for its oldest job
        job = self.saver.submit(self._store, meta.ram_evict, meta.stores, blocks, time.perf_counter() - started)
        self.saving.append((job, {spec.key for spec in meta.stores}, held))
        self._collect()

    def _store(self, evict: list[str], stores: list[StoreSpec], blocks: list[Block], seconds: float) -> Stats:
        """On the save thread: apply RAM evictions, checksum and store the blocks; returns what it counted."""
        started = time.perf_counter()
        stats = Stats(logged=self.logged)
        for key in evict:
            if self.ram is not None and self.ram.drop(key):
                stats.evictions += 1
        for spec, block in zip(stores, blocks):
            digest = checksum(block)
            if spec.to_ram and self.ram is not None:
                stats.evictions += self.ram.put(spec.key, block, digest)
            if spec.to_fs and self.fs is not None:
                try:
                    stats.evictions += self.fs.put(spec.key, block, digest)
                except OSError as exc:
                    stats.save_errors += 1
                    stats.warn_once("save", "cannot write block %s: %s", spec.key, exc)
                    continue
            stats.saves += 1
            stats.save_bytes += block.numel()
        stats.save_seconds = seconds + time.perf_counter() - started
        return stats

    def _collect(self, wait_upto: int = -1) -> None:
        """Count the finished save jobs, first waiting for the jobs up to index wait_upto."""
        pending = []
        for i, (job, keys, held) in enumerate(self.saving):
            if i <= wait_upto or job.done():
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
        return stats
