"""Fault-injection canary, for tests and demos only: a connector that loads wrong KV on purpose.

FaultCanary stores and verifies exactly like KVScopeConnector and breaks only what it writes into vLLM's KV
cache, through the worker's one hook (WorkerSide.to_write). Which fault, per request: the request's
`kv_transfer_params` {"kvscope_fault": NAME} (kvscope's bench sends one per canary treatment), else the
extra config's `fault` (default "shift"). The faults, graded from the upstream bug's class down to noise
near the numerical floor:

- shift:      every loaded block gets its predecessor's KV, the first keeps its own: KV loaded one block
              late (UCM #867's class); a request that loads one block gets its tokens one position late.
              (A rotation would be no fault at all: attention over a permuted set of keys and values is
              the same attention.)
- zeros:      the last loaded block is zeros (a block that was never filled).
- stale:      the last loaded block is not written: its slot keeps what an earlier request left there.
- layer:      "shift", in the middle layer only.
- head:       "shift", in one KV head of the middle layer only.
- noise-1e-2, noise-1e-3: Gaussian noise of 1e-2 / 1e-3 times each layer's standard deviation on every
              loaded value.
- second-hit: correct the first time a key is loaded after a reset; from its second load on, "shift".
- foreign:    the last loaded block is replaced by the block stored under another key.
- unloaded:   the load reports success and writes nothing: every loaded block keeps what its slot held before,
              another request's KV (a failed load counted as done, dynamo#15079). Where the slots still hold
              the request's own blocks in another order, its log says "changed" though attention is the same.
- reused:     every loaded block gets the KV of the key its slot held before (the block's former owner, from
              the tier) written over the right KV, as a transfer that lands after the block was freed and
              reassigned (vllm#52234, NIXL's read-after-release race); not where the former owners are the
              request's own blocks in another order (no fault where attention sees every loaded position).
- rank0-only: only tensor-parallel rank 0 loads; every other rank reports success and writes nothing, so its
              slots keep what they held (UCM PR #716: with TP > 1 only rank 0 loaded KV).
- rank0-heads: every rank above 0 loads rank 0's file of each block (rank 0's heads) instead of its own
              (LMCache#2405: every TP worker loaded worker 0's KV); a block rank 0 stored no file of stays right.
              Both act on ranks above 0 only: on a one-rank server they change nothing (logged so: changed 0).
- partial:    a hit also gets, beyond its last whole block, the next block of another prompt with the same
              blocks before it (of several, the one whose tokens differ earliest), claimed as loaded up to the
              request's last prompt token at most; never one stored on top of a borrowed block (its KV is a
              third prompt's, maybe this request's own): the last,
              partial block of a prefix from another prompt (Mooncake#4153). vLLM hands a connector whole
              blocks and this connector stores only full prompt blocks, so the canary plays the buggy tier at
              the hit's end on the scheduler side: it claims those tokens too and loads the other prompt's
              stored block into the request's next block; vLLM computes the rest of that block after them.

Every request a step loads for gets one line in the JSONL file `fault_log` (extra config, optional):
{"request": vLLM's request id, "fault": NAME, "loaded": blocks, "changed": blocks that the KV cache holds
otherwise than verified, read back after the write, and "partial"'s block of another prompt (verified as
that prompt's), "inherited": blocks it loaded that an earlier request computed on top of wrong KV, "distance":
per changed block, its largest difference from the verified block relative to the layer's largest value (1.0:
as far as zeros; near the dtype's rounding: right KV in all but name; 0 for "partial"'s borrowed block)}. A request
with both 0 was served correct KV ("stale" onto a slot that already held the right bytes, "second-hit" on a
first load, "foreign" with no other key stored, "reused" or "partial" with no other block to give, noise that
the KV cache's dtype rounds away). Blocks a request computed on top of wrong KV are stored like any other (so the
scheduler's view of the store stays true) and remembered, from the request's first wrong block on: whoever
loads them later got wrong KV too. Which copy a key's loads get is decided on the save thread as the RAM tier
changes (it keeps a key it holds; an evicted key is stored anew).
Noise is added in the KV cache itself after the write, on its device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch

from .blocks import Block
from .connector import KVScopeConnector, _tp_rank
from .keys import fingerprint
from .messages import KVScopeMetadata, LoadSpec, StoreSpec, TierName
from .scheduler import SchedulerSide
from .store import FsTier
from .worker import WorkerSide

log = logging.getLogger("kvscope_connector")

FAULTS = ("shift", "zeros", "stale", "layer", "head", "noise-1e-2", "noise-1e-3", "second-hit", "foreign",
          "unloaded", "reused", "partial", "rank0-only", "rank0-heads")
RANK_FAULTS = ("rank0-only", "rank0-heads")  # they act on tensor-parallel ranks above 0 only
# vLLM's fp8 KV cache dtypes, whose cache it allocates as uint8 codes of these formats
FP8_CODES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}

Part = Callable[[str, torch.Tensor], "torch.Tensor | None"]  # the slice of a layer's block a fault touches


@dataclass
class CanaryMetadata(KVScopeMetadata):
    faults: dict[str, str] = field(default_factory=dict)  # request id -> fault, for the requests that load
    borrowed: dict[str, int] = field(default_factory=dict)  # request id -> the index of the block it loads from
    # another prompt ("partial")


def _token_dim(t: torch.Tensor, block_size: int) -> int:
    """The first axis of one block's tensor that is block_size long: (H, B, 2D) on CPU, (2, B, H, D) on GPU."""
    return next(d for d in range(t.dim()) if t.shape[d] == block_size)


def _late(dst: torch.Tensor, src: torch.Tensor, dim: int) -> None:
    """dst = src one position late along dim; position 0 keeps its own value."""
    n = src.shape[dim]
    dst.narrow(dim, 1, n - 1).copy_(src.narrow(dim, 0, n - 1))


class _FaultWorker(WorkerSide):
    device_checks = False  # its faults rewrite verified blocks on the host
    default_fault = "shift"
    fault_log: str | None = None
    kv_heads = 1
    fp8: torch.dtype | None = None  # the fp8 format of a KV cache vLLM hands over as uint8 codes (None: not fp8)
    rank = 0  # this worker's tensor-parallel rank
    rank0: FsTier | None = None  # rank 0's files, on a rank above 0 with a filesystem tier (rank0-heads)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: set[str] = set()  # keys loaded since the last reset (second-hit)
        self.tainted: dict[str, int] = {}  # request given wrong KV since the last reset -> its first wrong block
        self.tainted_keys: set[str] = set()  # keys whose stored copy a request computed on top of wrong KV
        self.pending: list[tuple[str, str, list[tuple[LoadSpec, Block]]]] = []  # this step's (request, fault, loads)
        self.held: dict[int, str] = {}  # vLLM block id -> the key last loaded or saved there (reused)

    def _store(self, evict: list[str], stores: list[StoreSpec], saved, seconds: float):
        """On the save thread, before the tier changes: a key's taint follows the copy its RAM tier will keep
        (the canary's only tier; it keeps a key it holds). A stored block is wrong when its request got wrong
        KV at or before the block's position."""
        for key in evict:
            self.tainted_keys.discard(key)
        held = {spec.key for spec in stores if self.ram is not None and self.ram.contains(spec.key)} - set(evict)
        for spec in stores:
            if spec.key in held or not (spec.to_ram or self.ram is None):
                continue
            held.add(spec.key)
            wrong = spec.index >= self.tainted.get(spec.request_id, spec.index + 1)
            (self.tainted_keys.add if wrong else self.tainted_keys.discard)(spec.key)
        return super()._store(evict, stores, saved, seconds)

    def load(self, meta: KVScopeMetadata) -> None:
        super().load(meta)  # to_write() notes what each request loaded, the transfer path writes it
        lines = []
        for request_id, fault, loaded in self.pending:
            ids = [spec.block_id for spec, _ in loaded]
            if fault.startswith("noise-"):
                self._add_noise(ids, float(fault[len("noise-"):]))
            now = self.extract(ids)  # what the KV cache holds after the write: a fault the dtype rounds away is none
            borrowed = getattr(meta, "borrowed", {}).get(request_id)
            changed = {spec.index: self._distance(held, block) for held, (spec, block) in zip(now, loaded)
                       if spec.index == borrowed or not torch.equal(held, block)}
            inherited = [spec.index for spec, _ in loaded if spec.key in self.tainted_keys]
            if changed or inherited:
                self.tainted[request_id] = min([*changed, *inherited])
            lines.append({"request": request_id, "fault": fault, "loaded": len(loaded), "changed": len(changed),
                          "inherited": len(inherited), "distance": list(changed.values())})
        self.pending = []
        if self.fault_log and lines:
            self.append_log(self.fault_log, lines)

    def _distance(self, now: Block, right: Block) -> float:
        """How far a block the KV cache holds is from the verified one: the largest difference of a value in
        any layer, relative to that layer's largest verified value (3 significant digits)."""
        wants = self.layout.views(right)
        worst = 0.0
        for name, got in self.layout.views(now).items():
            want = self._values(wants[name])
            worst = max(worst, float((self._values(got) - want).abs().max() / want.abs().max().clamp_min(1e-30)))
        return float(f"{worst:.3g}")

    def _values(self, t: torch.Tensor) -> torch.Tensor:
        """KV values as float32: an fp8 cache's uint8 codes decoded, so faults and distances act on values."""
        return t.view(self.fp8).float() if self.fp8 is not None and t.dtype == torch.uint8 else t.float()

    def _encoded(self, x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Float32 values back in the cache's dtype: an fp8 cache's codes, within fp8's finite range."""
        if self.fp8 is None or dtype != torch.uint8:
            return x.to(dtype)
        big = torch.finfo(self.fp8).max
        return x.clamp(-big, big).to(self.fp8).view(torch.uint8)

    def to_write(self, meta: KVScopeMetadata, verified: Iterator[tuple[LoadSpec, Block]]
                 ) -> Iterable[tuple[int, Block]]:
        if meta.reset:
            self.seen.clear()
            self.tainted.clear()
            self.tainted_keys.clear()
            self.held.clear()
        by_request: dict[str, list[tuple[LoadSpec, Block]]] = {}
        for spec, block in verified:
            by_request.setdefault(spec.request_id, []).append((spec, block))
        faults = getattr(meta, "faults", {})
        out = []
        for request_id, loaded in by_request.items():
            fault = faults.get(request_id, self.default_fault)
            written = self._apply(fault, loaded)
            out += [(spec.block_id, new) for (spec, _), new in zip(loaded, written) if new is not None]
            self.pending.append((request_id, fault, loaded))
            self.held.update((spec.block_id, spec.key) for spec, _ in loaded)
        return out

    def register(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register(kv_caches)
        self.attach_rank0()

    def attach_rank0(self) -> None:
        """Rank 0's store reads blocks of this worker's layout (rank 0's shapes are this rank's)."""
        if self.rank0 is not None and self._layout is not None:
            self.rank0.attach(self.pool, self.checksum, self.layout)

    def save(self, meta: KVScopeMetadata) -> None:
        self.held.update((spec.block_id, spec.key) for spec in meta.stores)
        super().save(meta)

    def _apply(self, fault: str, loaded: list[tuple[LoadSpec, Block]]) -> list[Block | None]:
        """The blocks to write for one request's loads, in load order; None leaves a slot as it is."""
        blocks = [block for _, block in loaded]
        keys = {spec.key for spec, _ in loaded}
        if fault == "shift":
            return self._shifted(blocks, lambda name, t: t)
        if fault == "layer":
            return self._shifted(blocks, lambda name, t: t if name == self._middle() else None)
        if fault == "head":
            return self._shifted(blocks, lambda name, t: t.narrow(self._head_dim(t), 0, 1)
                                 if name == self._middle() else None)
        if fault == "zeros":
            return blocks[:-1] + [torch.zeros_like(blocks[-1])]
        if fault == "stale":
            return blocks[:-1] + [None]
        if fault.startswith("noise-"):
            return blocks  # added in the KV cache after the write (load)
        if fault == "second-hit":
            again = bool(keys & self.seen)
            self.seen |= keys
            return self._shifted(blocks, lambda name, t: t) if again else blocks
        if fault == "foreign":
            other = self._other_block(keys)
            return blocks if other is None else blocks[:-1] + [other]
        if fault == "unloaded":
            return [None] * len(blocks)
        if fault == "reused":
            return self._reused(loaded)
        if fault == "rank0-only":
            return blocks if self.rank == 0 else [None] * len(blocks)
        if fault == "rank0-heads":
            return [block if (theirs := self._rank0_block(spec.key)) is None else theirs for spec, block in loaded]
        self.stats.warn_once("fault", "unknown canary fault %r: loading correct KV", fault)
        return blocks

    def _shifted(self, blocks: list[Block], part: Part) -> list[Block]:
        out = [block.clone() for block in blocks]
        src_views = [self.layout.views(block) for block in blocks]
        dst_views = [self.layout.views(block) for block in out]
        for name in src_views[0]:
            if len(blocks) == 1:
                src, dst = part(name, src_views[0][name]), part(name, dst_views[0][name])
                if src is not None and dst is not None:
                    _late(dst, src, _token_dim(src, self.block_size))
                continue
            for j in range(1, len(blocks)):
                src, dst = part(name, src_views[j - 1][name]), part(name, dst_views[j][name])
                if src is not None and dst is not None:
                    dst.copy_(src)
        return out

    def _middle(self) -> str:
        return self.layout.entries[len(self.layout.entries) // 2].name

    def _head_dim(self, t: torch.Tensor) -> int:
        """The axis of the KV heads: the last one of that length that is neither the token axis nor the last."""
        token = _token_dim(t, self.block_size)
        return max(d for d in range(t.dim() - 1) if t.shape[d] == self.kv_heads and d != token)

    def _add_noise(self, block_ids: list[int], scale: float) -> None:
        """Gaussian noise of `scale` times each layer's standard deviation within each block, added to the
        blocks in the KV cache, on its device (on the host it took ~0.1 s per block of a 4B model)."""
        idx = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        gen = torch.Generator(device=self.device).manual_seed(block_ids[0])
        for layer in self.layers.values():
            x = self._values(layer.index_select(0, idx))
            std = x.reshape(len(block_ids), -1).std(dim=1).view(-1, *[1] * (x.dim() - 1))
            noise = torch.randn(x.shape, generator=gen, device=self.device) * std * scale
            layer.index_copy_(0, idx, self._encoded(x + noise, layer.dtype))

    def _reused(self, loaded: list[tuple[LoadSpec, Block]]) -> list[Block]:
        """Each slot's former owner's block (the key it held before, where the tier holds it and it is another
        key); the right blocks where those are the request's own blocks in another order: the same attention
        where every query sees every loaded position."""
        got: list[tuple[str, Block]] = []  # per slot: the key whose block it gets, and that block
        for spec, block in loaded:
            former = self.held.get(spec.block_id)
            theirs = self.ram.peek(former) if self.ram is not None and former not in (None, spec.key) else None
            got.append((spec.key, block) if former is None or theirs is None else (former, theirs))
        if sorted(key for key, _ in got) == sorted(spec.key for spec, _ in loaded):
            return [block for _, block in loaded]
        return [block for _, block in got]

    def _rank0_block(self, key: str) -> Block | None:
        """Rank 0's verified block of `key`, on a rank above 0 whose rank 0 stored one."""
        got = self.rank0.get(key) if self.rank > 0 and self.rank0 is not None else None
        return None if got is None else got[0]

    def _other_block(self, keys: set[str]) -> Block | None:
        """The most recently used RAM-tier block stored under a key this request does not load."""
        return None if self.ram is None else self.ram.recent(keys)


class _PartialBlocks:
    """Scheduler side of "partial": the stored blocks by the key of the block before them (their prompt's
    earlier blocks), and per request the block of another prompt it is to load after its hit."""

    def __init__(self, scheduler: SchedulerSide):
        self.scheduler = scheduler
        self.prompts: dict[str, list[int]] = {}  # request id -> its prompt, for its stored blocks' tokens
        self.children: dict[str, dict[str, tuple[int, ...]]] = {}  # key before ("" at a prompt's start) ->
        # the stored keys after it -> their tokens
        self.parent: dict[str, str] = {}
        self.plans: dict[str, tuple[int, str, int, int]] = {}  # request id -> (its block's index, the other key,
        # the tokens claimed from it, the tokens claimed in all)
        self.loading: dict[str, int] = {}  # this step's borrowed blocks: request id -> index
        self.wrong: dict[str, int] = {}  # request id -> the index of its first block of wrong KV: its borrowed
        # block, or a loaded block stored on top of one
        self.tainted: set[str] = set()  # stored keys whose KV a request computed at or after its first wrong block

    def remember(self, request) -> None:
        """Keep a request's prompt until it finishes: the tokens of the blocks it stores."""
        self.prompts[request.request_id] = list(request.prompt_token_ids or [])
        self.plans.pop(request.request_id, None)

    def borrow(self, request, num_computed_tokens: int, hit: int) -> int:
        """Tokens to claim beyond a hit of `hit` tokens after the computed ones (> 0, whole blocks): the next
        block of another stored prompt whose blocks before it are the request's and whose tokens differ from
        the request's own there, the one that differs earliest (every position from its first difference on
        holds wrong KV from the second layer on), up to the request's last prompt token (always computed).
        0 where none is stored."""
        bs, prompt = self.scheduler.block_size, self.prompts[request.request_id]
        state = self.scheduler.reqs.get(request.request_id)
        hit_end = num_computed_tokens + hit
        j = hit_end // bs
        n = min(bs, len(prompt) - hit_end - 1)
        if state is None or hit <= 0 or n <= 0 or not 0 < j <= len(state.keys):
            return 0
        own = state.keys[j] if j < len(state.keys) else None
        mine = tuple(prompt[hit_end:hit_end + n])
        best: tuple[int, str] | None = None  # (the first position it differs at, its key)
        for key, tokens in reversed(self.children.get(state.keys[j - 1], {}).items()):
            if key == own or key in self.tainted or key not in self.scheduler.ram_index:
                continue
            first = next((i for i, (a, b) in enumerate(zip(tokens, mine)) if a != b), None)
            if first is not None and (best is None or first < best[0]):
                best = (first, key)
        if best is None:
            return 0
        self.plans[request.request_id] = (j, best[1], n, hit + n)
        return n

    def after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        """Plan a request's loads: its own hit's, then its borrowed block's."""
        plan = self.plans.pop(request.request_id, None)
        if plan is None or num_external_tokens != plan[3]:
            self.scheduler.after_alloc(request, blocks, num_external_tokens)
            return
        j, key, n, _ = plan
        self.scheduler.after_alloc(request, blocks, num_external_tokens - n)
        self.loading[request.request_id] = j
        if key in self.scheduler.ram_index:  # else the worker misses it and vLLM computes the block
            self.scheduler.ram_index.move_to_end(key)
        self.scheduler.meta.loads.append(LoadSpec(blocks.get_block_ids()[0][j], key, TierName.RAM,
                                                  request_id=request.request_id, index=j, count=0))

    def note(self, meta: KVScopeMetadata, finished: Iterable[str]) -> dict[str, int]:
        """After a step's plan: remember the blocks it stores into RAM (and which hold wrong KV), forget those it
        evicts and the finished requests. Returns the step's borrowed blocks: request id -> index."""
        bs = self.scheduler.block_size
        if meta.reset:  # the worker empties its RAM tier before this step's stores
            self.children.clear()
            self.parent.clear()
            self.tainted.clear()
        for load in meta.loads:
            if load.key in self.tainted or self.loading.get(load.request_id) == load.index:
                self.wrong[load.request_id] = min(load.index, self.wrong.get(load.request_id, load.index))
        for spec in meta.stores:
            state, prompt = self.scheduler.reqs.get(spec.request_id), self.prompts.get(spec.request_id)
            if spec.to_ram and state is not None and prompt is not None:
                parent = state.keys[spec.index - 1] if spec.index else ""
                self.parent[spec.key] = parent
                self.children.setdefault(parent, {})[spec.key] = tuple(prompt[spec.index * bs:(spec.index + 1) * bs])
                wrong = spec.index >= self.wrong.get(spec.request_id, spec.index + 1)
                (self.tainted.add if wrong else self.tainted.discard)(spec.key)
        for key in meta.ram_evict:
            self.tainted.discard(key)
            if key in self.parent:
                self.children[self.parent.pop(key)].pop(key, None)
        for request_id in finished:
            self.prompts.pop(request_id, None)
            self.wrong.pop(request_id, None)
        loading, self.loading = self.loading, {}
        return loading


class FaultCanary(KVScopeConnector):
    worker_cls = _FaultWorker

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role, kv_cache_config)
        extra = self._kv_transfer_config.get_from_extra_config
        self.default_fault = extra("fault", "shift")
        if self.default_fault not in FAULTS:
            raise ValueError(f"kvscope canary: unknown fault {self.default_fault!r}; known: {', '.join(FAULTS)}")
        self.faults: dict[str, str] = {}  # scheduler side: request id -> fault asked for
        self.partial = _PartialBlocks(self.scheduler_side) if self.scheduler_side is not None else None
        if self.worker_side is not None:
            self.worker_side.default_fault = self.default_fault
            self.worker_side.fault_log = extra("fault_log", None)
            self.worker_side.kv_heads = vllm_config.model_config.get_num_kv_heads(vllm_config.parallel_config)
            self.worker_side.fp8 = FP8_CODES.get(str(vllm_config.cache_config.cache_dtype))
            self.worker_side.rank = rank = _tp_rank()
            if rank > 0 and (fs := self.worker_side.fs) is not None:  # rank 0's files: its fingerprint's folder
                self.worker_side.rank0 = FsTier(str(fs.root), fingerprint(**{**self.fingerprint_of, "tp_rank": 0}),
                                                None, secret=fs.secret, per_file=fs.per_file)

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        params = request.kv_transfer_params or {}
        fault = self.faults[request.request_id] = params.get("kvscope_fault", self.default_fault)
        hit, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if self.partial is not None:
            self.partial.remember(request)
            if fault == "partial":
                hit += self.partial.borrow(request, num_computed_tokens, hit)
        return hit, load_async

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if self.partial is None:
            super().update_state_after_alloc(request, blocks, num_external_tokens)
        else:
            self.partial.after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> CanaryMetadata:
        meta = super().build_connector_meta(scheduler_output)
        for request_id in scheduler_output.finished_req_ids:
            self.faults.pop(request_id, None)
        borrowed = self.partial.note(meta, scheduler_output.finished_req_ids) if self.partial is not None else {}
        faults = {spec.request_id: self.faults.get(spec.request_id, self.default_fault) for spec in meta.loads}
        return CanaryMetadata(**vars(meta), faults=faults, borrowed=borrowed)
