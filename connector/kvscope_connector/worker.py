"""Worker side: copy blocks between vLLM's paged KV cache and the tiers, verifying every load.

Loads run in start_load_kv, before the forward; stores run in wait_for_save, after it, so a block is
saved only once the step has computed it. A block that fails verification is a miss: its id goes back
to vLLM through get_block_ids_with_load_errors() and vLLM recomputes it.
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Iterator

import torch

from .scheduler import KVScopeMetadata, LoadSpec
from .store import Block, FsTier, RamTier, Stats, checksum, decode


class WorkerSide:
    def __init__(self, fingerprint: str, block_size: int, ram: RamTier | None, fs: FsTier | None):
        self.fp, self.block_size, self.ram, self.fs = fingerprint, block_size, ram, fs
        self.layers: dict[str, torch.Tensor] = {}
        self.like: Block = {}  # one block's tensors: the shape and dtype a stored block must have
        self.stats = Stats()
        self.load_errors: set[int] = set()
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kvscope-io")

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.layers = dict(sorted(kv_caches.items()))
        self.like = {name: t[0] for name, t in self.layers.items()}

    def block_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.like.values())

    def _index(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=next(iter(self.layers.values())).device)

    def extract(self, block_ids: list[int]) -> list[Block]:
        """The blocks' host copies: one gather and one device-to-host copy per layer for all of them (block
        by block, a GPU model's 36 layers x 60 blocks would be 2160 synchronous copies per prompt)."""
        if not block_ids:
            return []
        idx = self._index(block_ids)
        host = {name: t.index_select(0, idx).cpu() for name, t in self.layers.items()}
        return [{name: h[i] for name, h in host.items()} for i in range(len(block_ids))]

    def inject(self, items: list[tuple[int, Block]]) -> None:
        """Write verified blocks into the KV cache: on a GPU one host-to-device copy per layer for all of them;
        on the CPU a direct copy per block (stacking first would copy every byte twice)."""
        if not items:
            return
        if next(iter(self.layers.values())).device.type == "cpu":
            for name, t in self.layers.items():
                for block_id, block in items:
                    t[block_id].copy_(block[name])
            return
        idx = self._index([block_id for block_id, _ in items])
        for name, t in self.layers.items():
            t.index_copy_(0, idx, torch.stack([block[name] for _, block in items]).to(t.device))

    def _from_ram(self, spec: LoadSpec) -> Block | None:
        hit = self.ram.get(spec.key) if self.ram is not None else None
        if hit is None:
            return None
        block, digest = hit
        if checksum(block) == digest:
            self.stats.ram_hits += 1
            return block
        self.stats.corrupt += 1
        self.stats.warn_once("corrupt", "RAM block %s failed its checksum", spec.key)
        self.ram.drop(spec.key)
        return None

    def _read_fs(self, key: str) -> tuple[Block | None, str, str]:
        """Read and verify one file; runs in the I/O threads, so it only returns what happened."""
        try:
            data = self.fs.read(key)
        except OSError as exc:
            return None, "io", str(exc)
        if data is None:
            return None, "miss", ""
        try:
            return decode(data, self.fp, key, self.like), "hit", ""
        except ValueError as exc:
            return None, "corrupt", str(exc)

    def _settle(self, spec: LoadSpec, result: tuple[Block | None, str, str]) -> Block | None:
        """Count a filesystem-tier outcome; quarantine what failed verification; promote hits to RAM."""
        block, outcome, why = result
        if outcome == "hit":
            self.stats.fs_hits += 1
            if spec.promote and self.ram is not None:
                self.stats.evictions += self.ram.put(spec.key, block, checksum(block))
        elif outcome == "miss":
            self.stats.misses += 1
        elif outcome == "io":
            self.stats.io_errors += 1
            self.stats.warn_once("io", "cannot read block %s: %s", spec.key, why)
        else:
            self.stats.corrupt += 1
            self.stats.warn_once("corrupt", "block %s rejected: %s", spec.key, why)
            self.fs.quarantine(spec.key)
        return block

    def fetch_all(self, loads: list[LoadSpec]) -> Iterator[tuple[LoadSpec, Block | None]]:
        """Verified blocks in load order, or None for a miss. RAM first; filesystem reads and checksums run
        on I/O threads (file reads, CRC-32 and tensor copies release the GIL) while earlier blocks are
        injected."""
        ram = {spec.key: self._from_ram(spec) for spec in loads}
        pending = {spec.key: self.pool.submit(self._read_fs, spec.key)
                   for spec in loads if ram[spec.key] is None and self.fs is not None}
        for spec in loads:
            if ram[spec.key] is not None:
                yield spec, ram[spec.key]
            elif spec.key in pending:
                yield spec, self._settle(spec, pending[spec.key].result())
            else:
                self.stats.misses += 1
                yield spec, None

    def begin_step(self, meta: KVScopeMetadata) -> None:
        """Apply a reset the scheduler asked for (POST /reset_prefix_cache?reset_external=true)."""
        if meta.reset and self.ram is not None:
            self.ram.clear()

    def load(self, meta: KVScopeMetadata) -> None:
        self.begin_step(meta)
        started = time.perf_counter()
        verified = []
        for spec, block in self.fetch_all(meta.loads):
            if block is None:
                self.load_errors.add(spec.block_id)
            else:
                verified.append((spec.block_id, self.transform(spec, block, meta)))
        self.inject(verified)
        self.stats.load_bytes += self.block_bytes() * len(verified)
        self.stats.load_seconds += time.perf_counter() - started

    def transform(self, spec: LoadSpec, block: Block, meta: KVScopeMetadata) -> Block:
        """What is written into the KV cache for a verified block: the block itself (canaries override)."""
        return block

    def save(self, meta: KVScopeMetadata) -> None:
        started = time.perf_counter()
        for key in meta.ram_evict:
            if self.ram is not None and key in self.ram.blocks:
                self.ram.drop(key)
                self.stats.evictions += 1
        for spec, block in zip(meta.stores, self.extract([spec.block_id for spec in meta.stores])):
            digest = checksum(block)
            if spec.to_ram and self.ram is not None:
                self.stats.evictions += self.ram.put(spec.key, block, digest)
            if spec.to_fs and self.fs is not None:
                try:
                    self.stats.evictions += self.fs.write(spec.key, block, digest)
                except OSError as exc:
                    self.stats.save_errors += 1
                    self.stats.warn_once("save", "cannot write block %s: %s", spec.key, exc)
                    continue
            self.stats.saves += 1
            self.stats.save_bytes += self.block_bytes()
        self.stats.save_seconds += time.perf_counter() - started

    def take_load_errors(self) -> set[int]:
        errors, self.load_errors = self.load_errors, set()
        return errors
