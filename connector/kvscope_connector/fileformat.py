"""The on-disk format of one block: a safetensors file (no pickle, no code), one tensor per layer in the
block's Layout order, so the file's data section is the block's bytes as they are; its header names the
format, the fingerprint, the key and the checksum of the bytes (the platform's: blocks.CHECKSUMS).

Files on shared storage are untrusted input: decode() checks every field against what this server
expects and raises CorruptBlock on anything else. With a store secret (keys.store_secret) each file also
carries an HMAC-SHA256 of its fingerprint, key and bytes, so only holders of the secret can write a block
that loads; without one, the checksum is not a defence against a host that can write the store.
"""

from __future__ import annotations

import functools
import hashlib
import hmac
import json
import struct
from collections.abc import Callable
from itertools import zip_longest

import torch

from .blocks import Block, CorruptBlock, Entry, Layout

FORMAT_VERSION = "3"  # 3: a block is one byte buffer, checksummed whole (2: per-layer XXH3-128; 1: CRC-32)

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


MAX_HEADER = 1 << 20  # bytes; a block's header names one tensor per layer (a few KiB)


def mac(secret: bytes, fingerprint: str, key: str, block: Block) -> str:
    """HMAC-SHA256 of a block's fingerprint, key and bytes under the store secret."""
    h = hmac.new(secret, f"{fingerprint}/{key}/".encode(), hashlib.sha256)
    h.update(block.numpy())
    return h.hexdigest()


def header(block: Block, layout: Layout, fingerprint: str, key: str, digest: str,
           secret: bytes | None = None) -> bytes:
    """What a block's file holds before the block's bytes: safetensors' 8-byte length and JSON header, one
    tensor per layer over the block as it lies, in the layout's order. The file is this and then the block,
    written without a copy (safetensors' own writer would copy it, and order tensors of several dtypes by
    dtype, away from the block's bytes)."""
    meta = {"kvscope_format": FORMAT_VERSION, "fingerprint": fingerprint, "key": key, "checksum": digest}
    if secret is not None:
        meta["mac"] = mac(secret, fingerprint, key, block)
    text = _META.decode() + json.dumps(meta, separators=(",", ":")) + _tensors_text(layout)
    text += " " * (-len(text) % 8)  # as safetensors pads it: the data begins 8-byte aligned
    return struct.pack("<Q", len(text)) + text.encode()


def writable(layout: Layout) -> None:
    """Raise ValueError where layout's blocks cannot be files (a dtype the format does not name)."""
    _tensors_text(layout)


_META = b'{"__metadata__":'  # how safetensors begins a header that has metadata
_DECODER = json.JSONDecoder()


@functools.lru_cache(maxsize=8)
def _tensors_text(layout: Layout) -> str:
    """What follows the metadata object in a header that header() writes for layout: the tensors' entries,
    the same bytes whatever the metadata. Raises ValueError for a dtype the format does not name."""
    return "," + json.dumps(_expected(layout), separators=(",", ":"))[1:]


def _quick_meta(json_text: bytes, layout: Layout) -> object | None:
    """The metadata of a header's JSON that is header()'s for layout, parsed alone: the tensors' entries are
    compared as text, not parsed (parsing them was most of a block load's Python time). None for any other
    spelling, which the full parse then decides: this path accepts only what the full parse would."""
    tensors = _tensors_text(layout)
    if not json_text.startswith(_META) or not json_text.isascii():
        return None
    text = json_text.decode("ascii")
    try:
        meta, end = _DECODER.raw_decode(text, len(_META))
    except (ValueError, RecursionError):
        return None
    return meta if text[end:].rstrip(" ") == tensors else None


def _header(data: bytes) -> tuple[int, dict, dict]:
    """The header's length, its metadata and its tensors' entries as the JSON gives them."""
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > MAX_HEADER:
        raise ValueError(f"a {n}-byte header")
    header = json.loads(bytes(data[8:8 + n]))
    if not isinstance(header, dict):
        raise TypeError(f"the header is a JSON {type(header).__name__}, not an object")
    return n, _strings(header.pop("__metadata__", {})), header


def _strings(meta: object) -> dict:
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise TypeError("__metadata__ is not a map of strings")
    return meta


@functools.lru_cache(maxsize=8)
def _expected(layout: Layout) -> dict:
    """The tensors' entries of a header written for layout, as the JSON gives them: a header equal to it
    needs no entry-by-entry check (the fast path of every load)."""
    names = {dtype: name for name, dtype in _DTYPES.items()}
    if unnamed := sorted({str(e.dtype) for e in layout.entries if e.dtype not in names}):
        raise ValueError(f"kvscope connector: no block format for KV caches of {', '.join(unnamed)}")
    return {e.name: {"dtype": names[e.dtype], "shape": list(e.shape), "data_offsets": [e.start, e.end]}
            for e in layout.entries}


def _mismatch(tensors: dict, layout: Layout) -> str | None:
    """Where a header's tensors differ from layout (the first differing entry), None where they do not."""
    found = sorted(Entry(name, _DTYPES.get(info["dtype"]), tuple(info["shape"]), *info["data_offsets"])
                   for name, info in tensors.items())
    return next((f"layer {got}, expected {want}" for got, want in zip_longest(found, layout.entries)
                 if got != want), None)


def decode(header: bytes, block: Block, fingerprint: str, key: str, layout: Layout, secret: bytes | None = None,
           checksum: Callable[[Block], str] | None = None) -> tuple[Block, str]:
    """Check one stored block, read as its header (the 8-byte length and the JSON) and its data, and return
    the block with its checksum; raises CorruptBlock if it is not exactly what this server expects (and,
    with a secret, not signed with it).

    safetensors' layout is read from its JSON header, never executed, and must be this server's Layout byte
    for byte. With `checksum` the bytes are checked here; without, the header's checksum is returned for
    the caller to check (on the GPU, after the copy), and the block must not be used until it has.
    """
    try:
        (n,) = struct.unpack_from("<Q", header, 0)
        if n <= MAX_HEADER and (quick := _quick_meta(header[8:8 + n], layout)) is not None:
            meta, wrong = _strings(quick), None
        else:
            n, meta, tensors = _header(header)
            wrong = None if tensors == _expected(layout) else _mismatch(tensors, layout)
    except (struct.error, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CorruptBlock(f"unreadable block: {exc}") from exc
    if meta.get("kvscope_format") != FORMAT_VERSION:
        raise CorruptBlock(f"format {meta.get('kvscope_format')!r}, expected {FORMAT_VERSION}")
    if meta.get("fingerprint") != fingerprint or meta.get("key") != key:
        raise CorruptBlock("fingerprint or key mismatch (a foreign block)")
    if wrong:
        raise CorruptBlock(wrong)
    if len(header) != 8 + n or block.numel() != layout.nbytes:
        size = len(header) + block.numel()
        raise CorruptBlock(f"{size} bytes, expected {8 + n + layout.nbytes} (truncated or padded)")
    digest = meta.get("checksum", "")
    if checksum is not None and checksum(block) != digest:
        raise CorruptBlock("checksum mismatch")
    # compared as bytes: compare_digest refuses text that is not ASCII
    if secret is not None and not hmac.compare_digest(meta.get("mac", "").encode(),
                                                      mac(secret, fingerprint, key, block).encode()):
        raise CorruptBlock("unsigned, or not signed with this store's secret")
    return block, digest
