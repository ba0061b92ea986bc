"""What the scheduler side tells the worker side, once per step, and the names both sides use for tiers
and load outcomes. The scheduler builds a KVScopeMetadata; vLLM hands it to every worker."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


class TierName(StrEnum):
    RAM = "ram"
    FS = "fs"


class Outcome(StrEnum):
    """What a load found under a key."""

    RAM_HIT = "ram"
    FS_HIT = "fs"
    MISS = "miss"  # not stored (or gone since the lookup)
    IO = "io"  # the tier could not be read
    CORRUPT = "corrupt"  # stored, but it failed verification: never loaded


@dataclass
class LoadSpec:
    block_id: int
    key: str
    tier: TierName
    promote: bool = False  # a filesystem hit that also enters the RAM tier
    request_id: str = ""
    index: int = 0  # the block's position in its request
    file: str = ""  # the file holding the block, named by its last block's key ("": the block's own key)
    offset: int = 0  # the block's position in that file
    count: int = 1  # blocks in that file; 0: the block is in no file (a RAM hit has none to fall back on)

    @property
    def file_key(self) -> str:
        return self.file or self.key


@dataclass
class StoreSpec:
    block_id: int
    key: str
    to_ram: bool
    to_fs: bool
    request_id: str = ""  # the request whose prefill computed the block
    index: int = 0  # the block's position in that request
    file: str = ""  # with to_fs, the file it goes into, with the blocks before it of the same file in this
    # step's stores ("": a file of its own, named by its key)

    @property
    def file_key(self) -> str:
        return self.file or self.key


@dataclass
class KVScopeMetadata(KVConnectorMetadata):
    """Scheduler -> worker, once per step."""

    loads: list[LoadSpec] = field(default_factory=list)
    stores: list[StoreSpec] = field(default_factory=list)
    ram_evict: list[str] = field(default_factory=list)
    reset: bool = False
    failures: int = 0  # failed steps the scheduler had heard of when it planned this one (worker.save)
