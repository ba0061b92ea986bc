"""Scheduler side: which leading blocks of a prompt the store holds, and the per-step load/store plan.

The scheduler is authoritative for the RAM tier's contents: it mirrors the worker's LRU as an index of
keys and tells the worker what to store, promote and evict. The filesystem tier is looked up on disk,
because other servers may share it. A file holds an aligned run of the tier's `per_file` blocks of a prompt (blocks
[k * per_file, (k + 1) * per_file), or fewer at the prompt's end) and is named by its last block's key, so
one lookup finds a run; it is stored once its last block is computed, all its blocks then still in vLLM's
KV cache. Loads the worker cannot verify come back as invalid block ids and
vLLM recomputes them (kv_load_failure_policy "recompute").
"""

from __future__ import annotations

import logging
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from .keys import block_keys
from .messages import KVScopeMetadata, LoadSpec, StoreSpec, TierName
from .store import FsTier

log = logging.getLogger("kvscope_connector")

try:  # vLLM 0.32+: per-tier hit sources in vllm:prompt_tokens_cached_by_source
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:  # older vLLM: every external hit is reported as unspecified
    CacheHitSource = None


@dataclass(frozen=True)
class Filed:
    """Where a block lies in the filesystem tier: its file's key, its position there, the file's blocks."""

    file: str
    offset: int
    count: int


def placed(keys: list[str], per_file: int) -> list[Filed]:
    """Where each block of a whole prompt lies in a filesystem tier of per_file blocks a file."""
    n = len(keys)
    return [Filed(keys[min(i - i % per_file + per_file, n) - 1], i % per_file, min(per_file, n - i + i % per_file))
            for i in range(n)]


@dataclass
class _Req:
    request_id: str
    keys: list[str]
    prompt_len: int
    block_ids: list[int] = field(default_factory=list)
    stored_upto: int = 0  # blocks [0, stored_upto) are in RAM or were handed to the worker for it
    filed_upto: int = 0  # blocks [0, filed_upto) are in files or were handed to the worker for them
    stop: int = 1 << 62  # blocks from here on are never stored: computed on a failed load vLLM does not redo


def _extra_keys(request) -> str | None:
    """What besides its token ids makes a request's KV differ, as vLLM's prefix cache keys it (a LoRA adapter,
    multimodal input, a cache salt, prompt embeddings); None when nothing does."""
    found = [name for name, attr in (("a LoRA adapter", "lora_request"), ("multimodal input", "mm_features"),
                                     ("a cache salt", "cache_salt"), ("prompt embeddings", "prompt_embeds"))
             if (value := getattr(request, attr, None)) is not None and not (isinstance(value, list) and not value)]
    return ", ".join(found) or None


class SchedulerSide:
    def __init__(self, fingerprint: str, block_size: int, ram_blocks: int, fs: FsTier | None):
        self.fp, self.block_size, self.ram_blocks, self.fs = fingerprint, block_size, ram_blocks, fs
        self.per_file = fs.per_file if fs is not None else 1
        self.ram_index: OrderedDict[str, None] = OrderedDict()
        self.reqs: dict[str, _Req] = {}
        self.plans: dict[str, tuple[int, list[TierName], list[Filed]]] = {}  # request id -> (first block, tier
        # and file of each block)
        self.meta = KVScopeMetadata()
        self.ram_stores: dict[str, StoreSpec] = {}  # key -> this step's store of it into RAM
        self.filing: set[str] = set()  # files this step stores
        self.steps: deque[tuple[list[LoadSpec], list[StoreSpec], set[str]]] = deque(maxlen=4)  # the last steps'
        # loads, stores and scheduled requests
        self.failures = 0  # steps whose loads vLLM reported failed (the worker stores nothing until it hears)
        self.sources: dict[str, tuple[int, int]] = {}  # request id -> (tokens from RAM, tokens from fs)
        self.uncached: set[str] = set()  # what kept requests uncached, each logged once

    def _req(self, request_id: str, prompt: list[int]) -> _Req:
        if request_id not in self.reqs:
            usable = max(0, (len(prompt) - 1) // self.block_size)  # the last prompt token is always computed
            self.reqs[request_id] = _Req(request_id, block_keys(self.fp, prompt, self.block_size, usable), len(prompt))
        return self.reqs[request_id]

    def _files(self, keys: list[str], start: int) -> list[Filed]:
        """Where the leading blocks from `start` lie in files: one lookup per file. Past a whole file, at the
        first one not found whole, one lookup per block down to start finds the shorter last file of a
        stored prompt that ended there (a conversation's turn before this one); before any, only the first
        run's last key (a whole file, or the prompt's own last file where it ends within that run): a cold
        prompt costs one lookup, and a stored prompt shorter than one file is found only by its own."""
        found: list[Filed] = []
        first, n = start - start % self.per_file, len(keys)
        while self.fs is not None and first < n:
            end, lo = min(first + self.per_file, n), max(first, start)
            last = end - 1
            while last >= lo and not self.fs.contains(keys[last]):
                last = last - 1 if found else lo - 1
            found += [Filed(keys[last], i - first, last - first + 1) for i in range(lo, last + 1)]
            if last < end - 1:
                break
            first = end
        return found

    def lookup(self, request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens loadable beyond `num_computed_tokens`: the leading run of stored blocks after them. A request
        whose KV differs by more than its tokens gets no keys: it neither hits nor stores."""
        if request.request_id not in self.reqs and (extra := _extra_keys(request)):
            if extra not in self.uncached:
                self.uncached.add(extra)
                log.warning("kvscope connector: requests with %s are not cached: the store's keys cover token ids "
                            "only (said once)", extra)
            self.reqs[request.request_id] = _Req(request.request_id, [], 0)
        state = self._req(request.request_id, list(request.prompt_token_ids or []))
        start = num_computed_tokens // self.block_size
        files = self._files(state.keys, start)
        tiers: list[TierName] = []
        for i, key in enumerate(state.keys[start:]):
            if key in self.ram_index:
                tiers.append(TierName.RAM)
            elif i < len(files):
                tiers.append(TierName.FS)
            else:
                break
        # NOTE: remembering the plan is the only state this changes; the next call replaces it.
        self.plans[request.request_id] = (start, tiers, files)
        return len(tiers) * self.block_size, False

    def after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        start, tiers, files = self.plans.pop(request.request_id, (0, [], []))
        n = num_external_tokens // self.block_size
        if n == 0:
            return
        state = self.reqs[request.request_id]
        block_ids = blocks.get_block_ids()[0]
        from_ram = sum(t == TierName.RAM for t in tiers[:n]) * self.block_size
        self.sources[request.request_id] = (from_ram, n * self.block_size - from_ram)
        files += [Filed("", 0, 0)] * (n - len(files))  # RAM hits beyond the files: none to fall back on
        specs = [LoadSpec(block_ids[j], state.keys[j], tiers[j - start], request_id=request.request_id, index=j,
                          file=files[j - start].file, offset=files[j - start].offset, count=files[j - start].count)
                 for j in range(start, start + n)]
        # NOTE: touch the RAM hits before promoting the filesystem hits, so this request's own promotions
        # evict other keys first. A RAM key evicted anyway stays in the worker until this step's loads are
        # done (evictions are applied after the forward), and a miss there is read from its file where it
        # has one, else recomputed, never a crash.
        for spec in specs:
            if spec.tier == TierName.RAM and spec.key in self.ram_index:
                self.ram_index.move_to_end(spec.key)
        for spec in specs:
            if spec.tier == TierName.FS and self.ram_blocks > 0:
                spec.promote = True
                self._ram_add(spec.key)
        self.meta.loads += specs

    def hit_sources(self, request, num_external_tokens: int) -> dict:
        ram, fs = self.sources.pop(request.request_id, (0, 0))
        if CacheHitSource is None or ram + fs != num_external_tokens:
            return {}  # vLLM then reports the tokens as external_unspecified
        return {k: v for k, v in {CacheHitSource.HOST: ram, CacheHitSource.DISK: fs}.items() if v > 0}

    def _ram_add(self, key: str) -> None:
        self.ram_index[key] = None
        self.ram_index.move_to_end(key)
        while len(self.ram_index) > self.ram_blocks:
            evicted, _ = self.ram_index.popitem(last=False)
            self._evict(evicted)

    def _evict(self, key: str) -> None:
        """Tell the worker to drop a key the index dropped. The worker applies a step's evictions before its
        stores, so a key this step stores is rather not stored into RAM at all (else it keeps a block the
        index no longer has)."""
        if (spec := self.ram_stores.pop(key, None)) is not None:
            spec.to_ram = False
        else:
            self.meta.ram_evict.append(key)

    def build_meta(self, so) -> KVScopeMetadata:
        """Add this step's stores: prompt blocks that the step completes and the store lacks."""
        for new in so.scheduled_new_reqs:
            state = self._req(new.req_id, list(new.prompt_token_ids or []))
            state.block_ids = list(new.block_ids[0])
            self._plan_stores(state, new.num_computed_tokens + so.num_scheduled_tokens[new.req_id])
        cached = so.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ())  # vLLM <= 0.33; 0.34 sends a resumed request as new
        for i, req_id in enumerate(cached.req_ids):
            if req_id not in self.reqs:
                continue
            state = self.reqs[req_id]
            new_ids = cached.new_block_ids[i]
            if req_id in resumed:
                state.block_ids = list(new_ids[0]) if new_ids else []
            elif new_ids:
                state.block_ids += list(new_ids[0])
            self._plan_stores(state, cached.num_computed_tokens[i] + so.num_scheduled_tokens[req_id])
        for req_id in so.finished_req_ids:
            self.finished(req_id)
        meta, self.meta, self.ram_stores, self.filing = self.meta, KVScopeMetadata(), {}, set()
        meta.stores = [spec for spec in meta.stores if spec.to_ram or spec.to_fs]
        meta.failures = self.failures
        scheduled = {new.req_id for new in so.scheduled_new_reqs} | set(cached.req_ids)
        self.steps.append((list(meta.loads), list(meta.stores), scheduled))
        return meta

    def _plan_stores(self, state: _Req, done_tokens: int) -> None:
        """Store the blocks the step completes that RAM lacks, and the files whose last block it completes
        that the filesystem lacks (each with all of its blocks)."""
        full = min(done_tokens // self.block_size, len(state.keys), len(state.block_ids), state.stop)
        stores: dict[int, StoreSpec] = {}
        for j in range(state.stored_upto, full):
            key = state.keys[j]
            if self.ram_blocks > 0 and key not in self.ram_index:
                spec = stores[j] = StoreSpec(state.block_ids[j], key, True, False, state.request_id, j)
                self.ram_stores[key] = spec
                self._ram_add(key)
        state.stored_upto = max(state.stored_upto, full)
        while self.fs is not None and state.filed_upto < full:
            first = state.filed_upto - state.filed_upto % self.per_file
            end = min(first + self.per_file, len(state.keys))
            if end > full:  # its last block is not computed yet
                break
            if (file := state.keys[end - 1]) not in self.filing and not self.fs.contains(file):
                self.filing.add(file)  # one request files it (two with one prompt complete it together)
                for j in range(first, end):
                    spec = stores.setdefault(j, StoreSpec(state.block_ids[j], state.keys[j], False, False,
                                                          state.request_id, j))
                    spec.to_fs, spec.file = True, file
            state.filed_upto = end
        self.meta.stores += [stores[j] for j in sorted(stores)]

    def load_failed(self, block_ids: set[int]) -> None:
        """Blocks the worker could not verify in a step. The worker stored nothing in that step, nor in any
        step planned before this call (with async scheduling, the next one; KVScopeMetadata.failures): KV
        computed there may rest on a failed block, of the request's own load or of another's that vLLM
        shares with it. Forget those steps' stores, the failed keys and the promotions at or after each
        request's first failure in the RAM index (RAM hits after it are verified and kept), and store the
        blocks again once vLLM has recomputed them (the worker moved bad files aside, so the filesystem
        lookup misses too). A request of a step planned before this call that took a failed block from
        vLLM's prefix cache is not recomputed by vLLM (0.32): it never stores a block from there on."""
        self.failures += 1
        steps = list(self.steps)
        at = next((i for i in range(len(steps) - 1, -1, -1) if any(s.block_id in block_ids for s in steps[i][0])), 0)
        loads = steps[at][0] if steps else []
        first: dict[str, int] = {}  # request -> the position of its first failed block
        for spec in loads:
            if spec.block_id in block_ids:
                first[spec.request_id] = min(spec.index, first.get(spec.request_id, spec.index))
        for spec in loads:
            after = spec.index >= first.get(spec.request_id, spec.index + 1)
            if spec.block_id in block_ids or (spec.promote and after):
                self._forget(spec.key)
        loaders = set(first)
        for _, _, scheduled in steps[at + 1:]:  # planned before this call: a request that took a failed block
            for req_id in scheduled - loaders:   # from vLLM's prefix cache then is not recomputed (vLLM 0.32)
                state = self.reqs.get(req_id)
                at_block = next((i for i, b in enumerate(state.block_ids) if b in block_ids), None) if state else None
                if state is not None and at_block is not None:
                    state.stop = min(state.stop, at_block)
        for _, stores, _ in steps[at:]:
            for store in stores:
                if store.to_ram:
                    self._forget(store.key)
                first[store.request_id] = min(store.index, first.get(store.request_id, store.index))
        for req_id, index in first.items():
            if (state := self.reqs.get(req_id)) is not None:
                state.stored_upto = min(state.stored_upto, index)
                state.filed_upto = min(state.filed_upto, index - index % self.per_file)

    def _forget(self, key: str) -> None:
        if key in self.ram_index:
            del self.ram_index[key]
            self._evict(key)

    def finished(self, request_id: str) -> None:
        self.reqs.pop(request_id, None)
        self.plans.pop(request_id, None)
        self.sources.pop(request_id, None)

    def reset(self) -> bool:
        self.ram_index.clear()
        self.meta.reset = True
        return True
