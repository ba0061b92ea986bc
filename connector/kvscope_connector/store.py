"""Block storage: a RAM tier in front of a filesystem tier, both verified on every load.

A block is the KV of one block of tokens in every layer, {layer name: tensor}. Files are safetensors (no
pickle, no code) with a header that names the fingerprint, the key and a checksum of the tensor bytes;
writes are atomic (temp file, optional fsync, rename), so a reader on a shared directory never sees a torn
block. Anything that does not verify is a miss: counted, moved aside once, never loaded.
"""

from __future__ import annotations

import json
import struct
import logging
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch
import xxhash
from safetensors.torch import save as st_save

from .keys import FORMAT_VERSION

log = logging.getLogger("kvscope_connector")

Block = dict[str, torch.Tensor]


def checksum(block: Block) -> str:
    """XXH3-128 over the layer names and tensor bytes in name order (several times zlib's CRC-32; no copies).

    It guards against torn, truncated and bit-flipped blocks; the header's fingerprint and key guard
    against foreign ones. It is not a defence against someone who can rewrite the store.
    """
    h = xxhash.xxh3_128()
    for name in sorted(block):
        h.update(name.encode())
        h.update(block[name].contiguous().view(torch.uint8).numpy())
    return h.hexdigest()


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
    load_seconds: float = 0.0
    save_seconds: float = 0.0
    evictions: int = 0
    logged: set = field(default_factory=set)

    def add(self, other: "Stats") -> None:
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
        size = nbytes(block)
        if size > self.capacity:
            return 0
        copy = {k: v.clone() for k, v in block.items()}
        with self.lock:
            if key in self.blocks:
                self.blocks.move_to_end(key)
                return 0
            evicted = 0
            while self.used + size > self.capacity:
                self._drop(next(iter(self.blocks)))
                evicted += 1
            self.blocks[key] = (copy, digest)
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
            self.used -= nbytes(entry[0])
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


def decode(data: bytearray, fingerprint: str, key: str, like: Block) -> tuple[Block, str]:
    """Parse and verify one stored block and return it with its verified checksum; raises ValueError if it
    is not exactly what this server expects.

    Tensors are views into `data` (no copy); safetensors' layout is read from its JSON header, never
    executed.
    """
    try:
        (n,) = struct.unpack_from("<Q", data, 0)
        header = json.loads(bytes(data[8:8 + n]))
        meta = header.pop("__metadata__", {})
        block = {}
        for name, info in header.items():
            start, end = info["data_offsets"]
            dtype = _DTYPES[info["dtype"]]
            if 8 + n + end > len(data):
                raise ValueError("truncated")
            count = (end - start) // torch.tensor([], dtype=dtype).element_size()
            block[name] = torch.frombuffer(data, dtype=dtype, count=count, offset=8 + n + start).view(info["shape"])
    except (struct.error, ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise ValueError(f"unreadable block: {exc}") from exc
    if meta.get("kvscope_format") != FORMAT_VERSION:
        raise ValueError(f"format {meta.get('kvscope_format')!r}, expected {FORMAT_VERSION}")
    if meta.get("fingerprint") != fingerprint or meta.get("key") != key:
        raise ValueError("fingerprint or key mismatch (a foreign block)")
    if set(block) != set(like):
        raise ValueError("layer names differ")
    for name, t in block.items():
        if t.shape != like[name].shape or t.dtype != like[name].dtype:
            raise ValueError(f"{name}: {tuple(t.shape)} {t.dtype}, expected {tuple(like[name].shape)} {like[name].dtype}")
    digest = checksum(block)
    if digest != meta.get("checksum"):
        raise ValueError("checksum mismatch")
    return block, digest
