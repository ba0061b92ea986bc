"""KVScopeConnector: vLLM V1 KV connector over a verified RAM + filesystem block store.

Scheduler-side (engine core process), see scheduler.py:
- get_num_new_matched_tokens: leading run of stored blocks after the local hits; side-effect free.
- update_state_after_alloc:    plan loads into the blocks vLLM allocated.
- build_connector_meta:        add stores of newly completed prompt blocks and RAM evictions; resets state.
- get_external_cache_hit_sources, update_connector_output, request_finished, reset_cache.
Worker-side (each worker process), see worker.py:
- register_kv_caches, start_load_kv (verified loads), wait_for_save (hands the step's new blocks to the
  save thread), get_block_ids_with_load_errors (misses vLLM recomputes), get_kv_connector_stats, shutdown.

kv_connector_extra_config keys:
- ram_bytes (int, default 268435456): RAM tier capacity; 0 turns the tier off. Beside a GPU its slots and
  the save backlog's are pinned at start (more than the host's memory is refused).
- fs_path (str, optional): filesystem tier directory (local, or NFS shared by several servers).
- fs_bytes (int, optional): filesystem tier capacity; unbounded when absent.
- fsync (bool, default false): fsync each file before its atomic rename.
- file_tokens (int, optional): the tokens of a prompt each file of the filesystem tier holds, a multiple of
  the block size (default: 256 beside a CUDA GPU, one block elsewhere); fewer, larger files read faster,
  and a prompt that shares only part of a file's run with a stored one loads none of that file.
- file_reads (str, default "host"): "kvikio" reads the filesystem tier's files with NVIDIA's KvikIO straight
  into GPU memory (beside a CUDA GPU, with kvikio installed, ram_bytes 0 and no store secret: refused at start
  otherwise), "host" into pinned host memory first.
- save_backlog_bytes (int, optional): host copies of saved blocks that may wait for the save thread (1 GiB on
  the CPU, 4 GiB beside a GPU); beyond it, file-only saves are skipped and RAM saves waited for (with
  several tensor-parallel ranks nothing is skipped: every save waits).
- model_id (str, optional): weights identity to use instead of hashing the model's files.
- load_log (str, optional): a JSONL file; each step appends, per request that loaded, the blocks each tier
  served ({"request": vLLM's request id, "ram": n, "disk": n, "missed": n}): kvscope's per-tier verdict.
The store secret comes from the environment only ($KVSCOPE_STORE_KEY or $KVSCOPE_STORE_KEY_FILE, see
keys.store_secret): with it every file is signed and a file that is not is never loaded.
Use it with "kv_load_failure_policy": "recompute", so blocks that fail verification are recomputed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

from .keys import fingerprint, secret_id, store_secret, weights_identity
from .messages import KVScopeMetadata
from .scheduler import SchedulerSide
from .store import FsTier, RamTier, Stats
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

COUNTERS = tuple(f.name for f in fields(Stats) if f.name != "logged")  # each a counter on /metrics


@dataclass
class KVScopeStats(KVConnectorStats):
    """Counters since the last report, summed across workers; vLLM logs them as 'KV Transfer metrics'."""

    data: dict[str, Any] = field(default_factory=lambda: {k: 0 for k in COUNTERS})

    def reset(self):
        self.data = {k: 0 for k in COUNTERS}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k in COUNTERS:
            self.data[k] = self.data.get(k, 0) + other.data.get(k, 0)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: round(v, 4) if isinstance(v, float) else v for k, v in self.data.items()}

    def is_empty(self) -> bool:
        return not any(self.data.get(k) for k in COUNTERS)


class KVScopePromMetrics(KVConnectorPromMetrics):
    """Each counter as a Prometheus counter `kvscope:connector_<name>_total` on /metrics, per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {}
        for name in COUNTERS:
            counter = self._counter_cls(name=f"kvscope:connector_{name}",
                                        documentation=f"kvscope connector: {name.replace('_', ' ')}",
                                        labelnames=labelnames)
            self.counters[name] = {idx: counter.labels(*values) for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0):
        for name, per_engine in self.counters.items():
            value = transfer_stats_data.get(name, 0)
            if value:
                per_engine[engine_idx].inc(value)


def _layout() -> str:
    try:
        from vllm.distributed.kv_transfer.kv_connector.utils import get_kv_cache_layout

        return str(get_kv_cache_layout())
    except Exception:  # the layout helper moved between vLLM versions; the shape check still guards loads
        return "unknown"


def _stack(vllm_config: VllmConfig) -> dict:
    """What besides the model changes KV bytes: vLLM's version, the platform and the attention backend."""
    import vllm
    from vllm.platforms import current_platform

    attention = getattr(vllm_config, "attention_config", None)
    backend = getattr(attention, "backend", None) or os.environ.get("VLLM_ATTENTION_BACKEND") or "auto"
    try:
        capability = current_platform.get_device_capability()
    except Exception:  # not every platform reports one
        capability = None
    return {"vllm": vllm.__version__, "platform": current_platform.device_type, "device_capability": capability,
            "attention_backend": str(backend)}


def _platform() -> str:
    from vllm.platforms import current_platform

    return current_platform.device_type


def _checksum(platform: str) -> str:
    """The platform's block checksum: mix128 beside a CUDA GPU (computed there), XXH3-128 elsewhere."""
    return "mix128" if platform == "cuda" else "xxh3-128"


FILE_TOKENS = {"cuda": 256}  # a prompt's tokens a file holds by default, by platform (elsewhere one block):
# beside a GPU, files of one 2.25 MiB block loaded at 12-13 GB/s on the H200, bound by each file's Python, where
# plain reads of larger stretches reached ~25 (docs/gpu.md); on the CPU, one block a file keeps reuse block-fine


def _per_file(file_tokens: object, block_size: int, platform: str) -> int:
    """Blocks per file from the file_tokens extra config (absent: the platform's FILE_TOKENS, at least one
    block)."""
    if file_tokens is None:
        return max(1, FILE_TOKENS.get(platform, 0) // block_size)
    if type(file_tokens) is not int or file_tokens < block_size or file_tokens % block_size:
        raise ValueError(f"kvscope connector: file_tokens {file_tokens!r} is not a multiple of the block size "
                         f"({block_size} tokens)")
    return file_tokens // block_size


FILE_READS = {"host": False, "kvikio": True}  # the file_reads extra config: files read into GPU memory?


def _file_reads(value: object) -> bool:
    """Whether the file_reads extra config asks for reads straight into GPU memory (absent: host)."""
    if value is None:
        return False
    if not isinstance(value, str) or value not in FILE_READS:
        raise ValueError(f"kvscope connector: file_reads {value!r}, not one of {', '.join(FILE_READS)}")
    return FILE_READS[value]


def _unsupported(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig | None) -> str | None:
    """Why this server cannot use the connector, if it cannot: with pipeline parallelism every stage would
    store under one name; a KV cache of sliding-window or chunked local attention frees a running request's
    blocks (vLLM puts its null block in their place), which would be stored as the prompt's KV. Models that
    interleave such layers with full attention get full-attention caches here (the connector does not
    support vLLM's hybrid KV cache manager)."""
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        return "pipeline parallelism is not supported"
    for group in kv_cache_config.kv_cache_groups if kv_cache_config is not None else []:
        kinds = {cls.__name__ for cls in type(group.kv_cache_spec).__mro__}
        if kinds & {"SlidingWindowSpec", "ChunkedLocalAttentionSpec"}:
            return f"a KV cache of {type(group.kv_cache_spec).__name__} frees a running request's blocks"
    return None


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return get_tensor_model_parallel_rank()
    except Exception:  # the scheduler process has no model-parallel group: it looks up rank 0's blocks
        return 0


class KVScopeConnector(KVConnectorBase_V1):
    worker_cls = WorkerSide

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.get_from_extra_config
        model = vllm_config.model_config
        self.block_size = vllm_config.cache_config.block_size
        rank = _tp_rank() if role == KVConnectorRole.WORKER else 0
        secret = store_secret()
        platform = _platform()
        checksum = _checksum(platform)
        if (why := _unsupported(vllm_config, kv_cache_config)) is not None:
            raise ValueError(f"kvscope connector: {why}")
        per_file = _per_file(extra("file_tokens", None), self.block_size, platform)
        self.fingerprint_of = dict(  # what names this rank's store (the canary names rank 0's from it)
            model_config=json.loads(json.dumps(model.hf_config.to_dict(), sort_keys=True, default=str)),
            weights=extra("model_id", None) or weights_identity(model.model),
            quantization=getattr(model, "quantization", None), revision=getattr(model, "revision", None),
            dtype=str(model.dtype), kv_dtype=str(vllm_config.cache_config.cache_dtype), block_size=self.block_size,
            layout=_layout(), tp_rank=rank, tp_size=vllm_config.parallel_config.tensor_parallel_size,
            stack=_stack(vllm_config), signer=secret_id(secret), checksum=checksum, per_file=per_file)
        self.fp = fingerprint(**self.fingerprint_of)
        self.ram_bytes = int(extra("ram_bytes", 256 * 2**20))
        fs_path = extra("fs_path", None)
        fs = (FsTier(fs_path, self.fp, extra("fs_bytes", None), bool(extra("fsync", False)), secret=secret,
                     per_file=per_file) if fs_path else None)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            group = kv_cache_config.kv_cache_groups[0]
            block_bytes = group.kv_cache_spec.page_size_bytes * len(group.layer_names)
            self.scheduler_side = SchedulerSide(self.fp, self.block_size, self.ram_bytes // block_bytes, fs)
        else:
            # the scheduler decides evictions; the slack covers blocks still in flight
            ram = RamTier(int(self.ram_bytes * 1.1)) if self.ram_bytes > 0 else None
            self.worker_side = self.worker_cls(self.fp, self.block_size, ram, fs, checksum,
                                               backlog=extra("save_backlog_bytes", None),
                                               device_reads=_file_reads(extra("file_reads", None)))
            self.worker_side.load_log = extra("load_log", None)
            self.worker_side.may_skip_files = vllm_config.parallel_config.tensor_parallel_size == 1

    @classmethod
    def kv_cache_access(cls, kv_transfer_config):
        """How the workers reach the device KV cache (vLLM >= 0.34 allocates it by this): torch copies in this
        process, into and out of pinned host slots; with file_reads kvikio, cuFile reads straight into it,
        which registers GPU memory where GPUDirect Storage serves (one physical allocation per segment)."""
        from vllm.config.kv_transfer import KVCacheAccess  # vLLM >= 0.34; older releases never call this

        reads = (kv_transfer_config.kv_connector_extra_config or {}).get("file_reads")
        return KVCacheAccess.REGISTERS if _file_reads(reads) else KVCacheAccess.IN_PROCESS

    # Worker-side methods

    def register_kv_caches(self, kv_caches):
        assert self.worker_side is not None
        self.worker_side.register(kv_caches)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        assert self.worker_side is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVScopeMetadata)
        self.worker_side.load(meta)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are synchronous, done in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        return  # stores start in wait_for_save, after the step computed the blocks

    def wait_for_save(self):
        assert self.worker_side is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVScopeMetadata)
        self.worker_side.save(meta)

    def shutdown(self):
        if self.worker_side is not None:
            self.worker_side.flush()  # pending saves are written before the server exits

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors() if self.worker_side else set()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self.worker_side is None:
            return None
        stats = self.worker_side.take_stats()
        out = KVScopeStats(data={k: getattr(stats, k) for k in COUNTERS})
        return None if out.is_empty() else out

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KVScopeStats(data=data) if data is not None else KVScopeStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        return KVScopePromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # Scheduler-side methods

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler_side is not None
        return self.scheduler_side.lookup(request, num_computed_tokens)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        assert self.scheduler_side is not None
        self.scheduler_side.after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(self, request, num_external_tokens: int):
        assert self.scheduler_side is not None
        return self.scheduler_side.hit_sources(request, num_external_tokens)

    def build_connector_meta(self, scheduler_output) -> KVScopeMetadata:
        assert self.scheduler_side is not None
        return self.scheduler_side.build_meta(scheduler_output)

    def update_connector_output(self, connector_output):
        if self.scheduler_side is not None and connector_output.invalid_block_ids:
            self.scheduler_side.load_failed(connector_output.invalid_block_ids)

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler_side is not None:
            self.scheduler_side.finished(request.request_id)
        return False, None

    def reset_cache(self) -> bool | None:
        return self.scheduler_side.reset() if self.scheduler_side is not None else None
