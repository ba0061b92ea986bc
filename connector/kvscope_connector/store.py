"""Block storage: a RAM tier in front of a filesystem tier, both verified on every load.

A block is the KV of one block of tokens in every layer, held as one flat byte buffer whose layers lie
one after another in name order (a Layout says where). Files are safetensors (no pickle, no code) with
one tensor per layer, in that same order, and a header that names the fingerprint, the key and a checksum
of the bytes; writes are atomic (temp file, optional fsync, rename), so a reader on a shared directory
never sees a torn block. Anything that does not verify is a miss: counted, moved aside once, never loaded.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from itertools import zip_longest
from pathlib import Path
from typing import NamedTuple

import torch
import xxhash
from safetensors.torch import save as st_save

from .keys import FORMAT_VERSION

log = logging.getLogger("kvscope_connector")

Block = torch.Tensor  # one block: a 1-D uint8 CPU tensor laid out by a Layout


class Entry(NamedTuple):
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # byte range of this layer in the block
    end: int


class Layout:
    """Where each layer's KV lies in a block's bytes: layers in name order, each in row-major order (the
    order safetensors writes same-dtype tensors in, so a file's data is a block as it is)."""

    def __init__(self, like: dict[str, torch.Tensor]):  # one block's tensor per layer
        self.entries: list[Entry] = []
        offset = 0
        for name in sorted(like):
            t = like[name]
            size = t.numel() * t.element_size()
            self.entries.append(Entry(name, t.dtype, tuple(t.shape), offset, offset + size))
            offset += size
        self.nbytes = offset

    def views(self, block: Block) -> dict[str, torch.Tensor]:
        """Each layer's tensor, as a view into the block."""
        return {e.name: block[e.start:e.end].view(e.dtype).view(e.shape) for e in self.entries}

    def pack(self, tensors: dict[str, torch.Tensor]) -> Block:
        """A new block from one tensor per layer."""
        return torch.cat([tensors[e.name].reshape(-1).view(torch.uint8) for e in self.entries])


def checksum(block: Block) -> str:
    """XXH3-128 of the block's bytes (one pass, no copy; several times zlib's CRC-32).

    It guards against torn, truncated and bit-flipped blocks; the header's fingerprint and key guard
    against foreign ones. It is not a defence against someone who can rewrite the store.
    """
    return xxhash.xxh3_128(block.numpy()).hexdigest()


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
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    evictions: int = 0
    logged: set = field(default_factory=set)

    def add(self, other: Stats) -> None:
        for f in fields(self):
            if f.name != "logged":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def warn_once(self, kind: str, msg: str, *args) -> None:
        if kind not in self.logged:
            self.logged.add(kind)
            log.warning("kvscope connector: " + msg + " (further %s events are counted, not logged)", *args, kind)


class RamTier:
    """LRU of verified blocks in host memory, bounded in bytes; used by the forward and the save thread."""

    def __init__(self, capacity_bytes: int):
        self.capacity = capacity_bytes
        self.used = 0
        self.blocks: OrderedDict[str, tuple[Block, str]] = OrderedDict()
        self.lock = threading.Lock()

    def put(self, key: str, block: Block, digest: str) -> int:
        """Store a copy; returns how many blocks were evicted to make room."""
        size = block.numel()
        if size > self.capacity:
            return 0
        with self.lock:
            if key in self.blocks:
                self.blocks.move_to_end(key)
                return 0
            evicted = 0
            while self.used + size > self.capacity:
                self._drop(next(iter(self.blocks)))
                evicted += 1
            self.blocks[key] = (block.clone(), digest)
            self.used += size
            return evicted

    def get(self, key: str) -> tuple[Block, str] | None:
        with self.lock:
            if key not in self.blocks:
                return None
            self.blocks.move_to_end(key)
            return self.blocks[key]

    def drop(self, key: str) -> bool:
        with self.lock:
            return self._drop(key)

    def _drop(self, key: str) -> bool:
        entry = self.blocks.pop(key, None)
        if entry is not None:
            self.used -= entry[0].numel()
        return entry is not None

    def clear(self) -> None:
        with self.lock:
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
        self.lock = threading.Lock()  # the accounting is shared by the load threads and the save thread
        try:
            for path in sorted(self.dir.glob("*/*.safetensors"), key=lambda p: p.stat().st_mtime):
                self._note(path.stem, path.stat().st_size)
        except OSError:
            pass

    def _name(self, key: str) -> str:
        return f"{self.dir}/{key[:2]}/{key}.safetensors"

    def path(self, key: str) -> Path:
        return Path(self._name(key))

    def exists(self, key: str) -> bool:
        return os.path.isfile(self._name(key))  # a stat per block on the scheduler's hot path: no pathlib

    def _note(self, key: str, size: int) -> None:
        with self.lock:
            self.used += size - self.sizes.pop(key, 0)
            self.sizes[key] = size

    def write(self, key: str, layers: dict[str, torch.Tensor], digest: str) -> int:
        """Atomically write one block, given as its layers (Layout.views); returns how many files were
        evicted. Raises OSError on I/O faults."""
        data = st_save(layers, metadata={"kvscope_format": FORMAT_VERSION, "fingerprint": self.fingerprint,
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
        with self.lock:
            while self.capacity is not None and self.used > self.capacity and len(self.sizes) > 1:
                key, size = self.sizes.popitem(last=False)
                self.used -= size
                self.path(key).unlink(missing_ok=True)
                evicted += 1
        return evicted

    def read(self, key: str) -> bytearray | None:
        """The file's bytes in a writable buffer, so decode() can view tensors in place."""
        try:
            with open(self.path(key), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                data = bytearray(size)
                if f.readinto(data) != size:
                    return bytearray()  # shrank while reading: decode() rejects it
        except FileNotFoundError:
            return None
        self._note(key, size)
        return data

    def quarantine(self, key: str) -> None:
        """Move a block that failed verification aside, so it is neither loaded nor looked up again."""
        try:
            os.replace(self.path(key), self.path(key).with_suffix(".corrupt"))
        except OSError:
            pass
        with self.lock:
            self.used -= self.sizes.pop(key, 0)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def decode(data: bytearray, fingerprint: str, key: str, layout: Layout) -> tuple[Block, str]:
    """Parse and verify one stored block and return it with its verified checksum; raises ValueError if it
    is not exactly what this server expects.

    The block is a view into `data` (no copy); safetensors' layout is read from its JSON header, never
    executed, and must be this server's Layout byte for byte.
    """
    try:
        (n,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(bytes(data[8:8 + n]))
        meta = header.pop("__metadata__", {})
        found = sorted(Entry(name, _DTYPES.get(info["dtype"]), tuple(info["shape"]), *info["data_offsets"])
                       for name, info in header.items())
    except (struct.error, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"unreadable block: {exc}") from exc
    if meta.get("kvscope_format") != FORMAT_VERSION:
        raise ValueError(f"format {meta.get('kvscope_format')!r}, expected {FORMAT_VERSION}")
    if meta.get("fingerprint") != fingerprint or meta.get("key") != key:
        raise ValueError("fingerprint or key mismatch (a foreign block)")
    for got, want in zip_longest(found, layout.entries):
        if got != want:
            raise ValueError(f"layer {got}, expected {want}")
    if len(data) != 8 + n + layout.nbytes:
        raise ValueError(f"{len(data)} bytes, expected {8 + n + layout.nbytes} (truncated or padded)")
    block = torch.frombuffer(data, dtype=torch.uint8, count=layout.nbytes, offset=8 + n)
    digest = checksum(block)
    if digest != meta.get("checksum"):
        raise ValueError("checksum mismatch")
    return block, digest
