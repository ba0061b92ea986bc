"""The on-disk format: a safetensors file (no pickle, no code) of one or more consecutive blocks of a prompt,
each block one tensor per layer in its Layout order, so the file's data section is the blocks' bytes as they
are, one after another; its header names the format, the fingerprint, the file's key (its last block's),
and each block's key and checksum (the platform's: blocks.CHECKSUMS), so any block of a file is checked on
its own.

Files on shared storage are untrusted input: decode() checks every field against what this server
expects and raises CorruptBlock on anything else. With a store secret (keys.store_secret) each file also
carries an HMAC-SHA256 per block of its fingerprint, key and bytes, so only holders of the secret can write a block
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

FORMAT_VERSION = "4"  # 4: a file holds several blocks (3: one block a file, a block one buffer checksummed whole;
# 2: per-layer XXH3-128; 1: CRC-32)

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


MAX_HEADER = 1 << 20  # bytes; a header names one tensor per layer and block (~100 bytes each)


def mac(secret: bytes, fingerprint: str, key: str, block: Block) -> str:
    """HMAC-SHA256 of a block's fingerprint, key and bytes under the store secret."""
    h = hmac.new(secret, f"{fingerprint}/{key}/".encode(), hashlib.sha256)
    h.update(block.numpy())
    return h.hexdigest()


def header(blocks: list[Block], layout: Layout, fingerprint: str, file: str, keys: list[str], digests: list[str],
           secret: bytes | None = None) -> bytes:
    """What a file holds before its blocks' bytes: safetensors' 8-byte length and JSON header, one tensor per
    layer and block over the blocks as they lie, in order. The file is this and then the blocks, written
    without a copy (safetensors' own writer would copy them, and order tensors of several dtypes by dtype,
    away from the blocks' bytes). `file` is the file's key, its last block's."""
    meta = {"kvscope_format": FORMAT_VERSION, "fingerprint": fingerprint, "key": file, "blocks": ",".join(keys),
            "checksums": ",".join(digests)}
    if secret is not None:
        meta["macs"] = ",".join(mac(secret, fingerprint, key, block) for key, block in zip(keys, blocks))
    text = _META.decode() + json.dumps(meta, separators=(",", ":")) + _tensors_text(layout, len(blocks))
    text += " " * (-len(text) % 8)  # as safetensors pads it: the data begins 8-byte aligned
    return struct.pack("<Q", len(text)) + text.encode()


def writable(layout: Layout, count: int = 1) -> None:
    """Raise ValueError where layout's blocks cannot be files of `count` blocks (a dtype the format does not
    name, or a header over MAX_HEADER)."""
    if len(_tensors_text(layout, count)) + 256 * count > MAX_HEADER:
        raise ValueError(f"kvscope connector: a file of {count} blocks of {len(layout.entries)} layers needs a "
                         f"header over {MAX_HEADER} bytes: fewer tokens per file (file_tokens)")


_META = b'{"__metadata__":'  # how safetensors begins a header that has metadata
_DECODER = json.JSONDecoder()


@functools.lru_cache(maxsize=16)
def _tensors_text(layout: Layout, count: int) -> str:
    """What follows the metadata object in a header that header() writes for `count` blocks of layout: the
    tensors' entries, the same bytes whatever the metadata. Raises ValueError for a dtype the format does not
    name."""
    return "," + json.dumps(_expected(layout, count), separators=(",", ":"))[1:]


def _quick_meta(json_text: bytes, layout: Layout, count: int) -> object | None:
    """The metadata of a header's JSON that is header()'s for `count` blocks of layout, parsed alone: the
    tensors' entries are compared as text, not parsed (parsing them was most of a block load's Python time).
    None for any other spelling, which the full parse then decides: this path accepts only what the full
    parse would."""
    tensors = _tensors_text(layout, count)
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


@functools.lru_cache(maxsize=16)
def _expected(layout: Layout, count: int) -> dict:
    """The tensors' entries of a header written for `count` blocks of layout, as the JSON gives them (block i's
    layer NAME is "i/NAME"): a header equal to it needs no entry-by-entry check (the fast path of every load)."""
    names = {dtype: name for name, dtype in _DTYPES.items()}
    if unnamed := sorted({str(e.dtype) for e in layout.entries if e.dtype not in names}):
        raise ValueError(f"kvscope connector: no block format for KV caches of {', '.join(unnamed)}")
    return {f"{i}/{e.name}": {"dtype": names[e.dtype], "shape": list(e.shape),
                              "data_offsets": [i * layout.nbytes + e.start, i * layout.nbytes + e.end]}
            for i in range(count) for e in layout.entries}


def _mismatch(tensors: dict, layout: Layout, count: int) -> str | None:
    """Where a header's tensors differ from `count` blocks of layout (the first differing entry), None where
    they do not."""
    found = sorted(Entry(name, _DTYPES.get(info["dtype"]), tuple(info["shape"]), *info["data_offsets"])
                   for name, info in tensors.items())
    want = sorted(Entry(f"{i}/{e.name}", e.dtype, e.shape, i * layout.nbytes + e.start, i * layout.nbytes + e.end)
                  for i in range(count) for e in layout.entries)
    return next((f"layer {got}, expected {want}" for got, want in zip_longest(found, want) if got != want), None)


def _listed(meta: dict, field: str, count: int) -> list[str]:
    """A metadata field that lists one value per block, comma-separated."""
    values = meta.get(field, "").split(",")
    if len(values) != count:
        raise CorruptBlock(f"{len(values)} {field}, expected {count} (one per block)")
    return values


def decode(header: bytes, blocks: list[Block], fingerprint: str, file: str, keys: list[str], first: int,
           count: int, layout: Layout, secret: bytes | None = None,
           checksum: Callable[[Block], str] | None = None) -> list[tuple[Block, str]]:
    """Check blocks read from a file of `count` blocks named `file`: its header (the 8-byte length and the
    JSON) and the data of its blocks first, first + 1, ..., which must be stored under `keys`. Returns each
    block with its checksum; raises CorruptBlock if the file is not exactly what this server expects (and,
    with a secret, a block is not signed with it).

    safetensors' layout is read from its JSON header, never executed, and must be this server's Layout byte
    for byte. With `checksum` the bytes are checked here; without, the header's checksums are returned for
    the caller to check (on the GPU, after the copy), and no block may be used until it has.
    """
    try:
        (n,) = struct.unpack_from("<Q", header, 0)
        if n <= MAX_HEADER and (quick := _quick_meta(header[8:8 + n], layout, count)) is not None:
            meta, wrong = _strings(quick), None
        else:
            n, meta, tensors = _header(header)
            wrong = None if tensors == _expected(layout, count) else _mismatch(tensors, layout, count)
    except (struct.error, ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise CorruptBlock(f"unreadable block file: {exc}") from exc
    if meta.get("kvscope_format") != FORMAT_VERSION:
        raise CorruptBlock(f"format {meta.get('kvscope_format')!r}, expected {FORMAT_VERSION}")
    if meta.get("fingerprint") != fingerprint or meta.get("key") != file:
        raise CorruptBlock("fingerprint or key mismatch (a foreign file)")
    if wrong:
        raise CorruptBlock(wrong)
    if len(header) != 8 + n or any(block.numel() != layout.nbytes for block in blocks):
        raise CorruptBlock(f"a header of {len(header) - 8} bytes, expected {n}, or a block not of {layout.nbytes}")
    if not 0 <= first <= first + len(blocks) <= count or len(keys) != len(blocks):
        raise ValueError(f"blocks {first}..{first + len(blocks) - 1} of a file of {count}")
    stored, digests = _listed(meta, "blocks", count), _listed(meta, "checksums", count)
    macs = _listed(meta, "macs", count) if secret is not None else []
    found = []
    for i, (block, key) in enumerate(zip(blocks, keys), start=first):
        if stored[i] != key:
            raise CorruptBlock(f"block {i} of the file is {stored[i]!r}, expected {key!r} (a foreign block)")
        if checksum is not None and checksum(block) != digests[i]:
            raise CorruptBlock(f"checksum mismatch (block {i} of the file)")
        # compared as bytes: compare_digest refuses text that is not ASCII
        if secret is not None and not hmac.compare_digest(macs[i].encode(),
                                                          mac(secret, fingerprint, key, block).encode()):
            raise CorruptBlock("unsigned, or not signed with this store's secret")
        found.append((block, digests[i]))
    return found
