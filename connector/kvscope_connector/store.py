"""Block storage: a RAM tier in front of a filesystem tier, both verified on every load.

A block is the KV of one block of tokens in every layer, {layer name: tensor}. Files are safetensors (no
pickle, no code) with a header that names the fingerprint, the key and a checksum of the tensor bytes;
writes are atomic (temp file, optional fsync, rename), so a reader on a shared directory never sees a torn
block. Anything that does not verify is a miss: counted, moved aside once, never loaded.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save

from .keys import FORMAT_VERSION

log = logging.getLogger("kvscope_connector")

Block = dict[str, torch.Tensor]


def checksum(block: Block) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(block):
        digest.update(name.encode())
        digest.update(block[name].contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def nbytes(block: Block) -> int:
    return sum(t.numel() * t.element_size() for t in block.values())


@dataclass
class Stats:
    """Counters of one worker since the last report; see connector.KVScopeStats."""

    ram_hits: int = 0
    fs_hits: int = 0
    misses: int = 0
    corrupt: int = 0  # checksum, header, shape/dtype, fingerprint or truncation failures
    io_errors: int = 0
    saves: int = 0
    save_errors: int = 0
    load_bytes: int = 0
    save_bytes: int = 0
    load_s: float = 0.0
    save_s: float = 0.0
    evictions: int = 0
    logged: set = field(default_factory=set)

    def warn_once(self, kind: str, msg: str, *args) -> None:
        if kind not in self.logged:
            self.logged.add(kind)
            log.warning("kvscope connector: " + msg + " (further %s events are counted, not logged)", *args, kind)


class RamTier:
    """LRU of verified blocks in host memory, bounded in bytes."""

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.used = 0
        self.blocks: OrderedDict[str, tuple[Block, str]] = OrderedDict()

    def put(self, key: str, block: Block, digest: str) -> int:
        """Store a copy; returns how many blocks were evicted to make room."""
        size = nbytes(block)
        if size > self.capacity:
            return 0
        if key in self.blocks:
            self.blocks.move_to_end(key)
            return 0
        evicted = 0
        while self.used + size > self.capacity:
            self.drop(next(iter(self.blocks)))
            evicted += 1
        self.blocks[key] = ({k: v.clone() for k, v in block.items()}, digest)
        self.used += size
        return evicted

    def get(self, key: str) -> tuple[Block, str] | None:
        if key not in self.blocks:
            return None
        self.blocks.move_to_end(key)
        return self.blocks[key]

    def drop(self, key: str) -> None:
        block, _ = self.blocks.pop(key)
        self.used -= nbytes(block)

    def clear(self) -> None:
        self.blocks.clear()
        self.used = 0


class FsTier:
    """Blocks as files under root/<fingerprint>/<key[:2]>/<key>.safetensors; LRU by access within a byte cap."""

    def __init__(self, root: str, fingerprint: str, capacity_bytes: int | None, fsync: bool = False):
        self.dir = Path(root) / fingerprint
        self.fingerprint = fingerprint
        self.capacity = capacity_bytes
        self.fsync = fsync
        self.sizes: OrderedDict[str, int] = OrderedDict()  # what this process knows is on disk, LRU order
        self.used = 0
        try:
            for path in sorted(self.dir.glob("*/*.safetensors"), key=lambda p: p.stat().st_mtime):
                self._note(path.stem, path.stat().st_size)
        except OSError:
            pass

    def path(self, key: str) -> Path:
        return self.dir / key[:2] / f"{key}.safetensors"

    def exists(self, key: str) -> bool:
        try:
            return self.path(key).is_file()
        except OSError:
            return False

    def _note(self, key: str, size: int) -> None:
        self.used += size - self.sizes.pop(key, 0)
        self.sizes[key] = size

    def write(self, key: str, block: Block, digest: str) -> int:
        """Atomically write one block; returns how many files were evicted. Raises OSError on I/O faults."""
        data = st_save(block, metadata={"kvscope_format": FORMAT_VERSION, "fingerprint": self.fingerprint,
                                        "key": key, "checksum": digest})
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                f.write(data)
                if self.fsync:
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, final)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
        self._note(key, len(data))
        return self._evict()

    def _evict(self) -> int:
        evicted = 0
        while self.capacity is not None and self.used > self.capacity and len(self.sizes) > 1:
            key, size = self.sizes.popitem(last=False)
            self.used -= size
            self.path(key).unlink(missing_ok=True)
            evicted += 1
        return evicted

    def read(self, key: str) -> bytes | None:
        try:
            data = self.path(key).read_bytes()
        except FileNotFoundError:
            return None
        self._note(key, len(data))
        return data

    def quarantine(self, key: str) -> None:
        """Move a block that failed verification aside, so it is neither loaded nor looked up again."""
        try:
            os.replace(self.path(key), self.path(key).with_suffix(".corrupt"))
        except OSError:
            pass
        self.used -= self.sizes.pop(key, 0)


def decode(data: bytes, fingerprint: str, key: str, like: Block) -> Block:
    """Parse and verify one stored block against what this server expects; raises ValueError if it differs."""
    try:
        block = st_load(data)
        meta = _metadata(data)
    except Exception as exc:  # truncated or not safetensors at all
        raise ValueError(f"unreadable block: {type(exc).__name__}") from exc
    if meta.get("kvscope_format") != FORMAT_VERSION:
        raise ValueError(f"format {meta.get('kvscope_format')!r}, expected {FORMAT_VERSION}")
    if meta.get("fingerprint") != fingerprint or meta.get("key") != key:
        raise ValueError("fingerprint or key mismatch (a foreign block)")
    if set(block) != set(like):
        raise ValueError("layer names differ")
    for name, t in block.items():
        if t.shape != like[name].shape or t.dtype != like[name].dtype:
            raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype}, expected {tuple(like[name].shape)} {like[name].dtype}")
    if checksum(block) != meta.get("checksum"):
        raise ValueError("checksum mismatch")
    return block


def _metadata(data: bytes) -> dict:
    import json
    import struct

    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8:8 + n]).get("__metadata__", {})
