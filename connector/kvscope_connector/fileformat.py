"""The on-disk format of one block: a safetensors file (no pickle, no code), one tensor per layer in the
block's Layout order, so the file's data section is the block's bytes as they are; its header names the
format, the fingerprint, the key and an XXH3-128 checksum of the bytes.

Files on shared storage are untrusted input: decode() checks every field against what this server
expects and raises CorruptBlock on anything else.
"""

from __future__ import annotations

import json
import struct
from itertools import zip_longest

import torch
from safetensors.torch import save as st_save

from .blocks import Block, CorruptBlock, Entry, Layout, checksum

FORMAT_VERSION = "3"  # 3: a block is one byte buffer, checksummed whole (2: per-layer XXH3-128; 1: CRC-32)

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def encode(block: Block, layout: Layout, fingerprint: str, key: str, digest: str) -> bytes:
    return st_save(layout.views(block), metadata={"kvscope_format": FORMAT_VERSION, "fingerprint": fingerprint,
                                                  "key": key, "checksum": digest})


def decode(data: bytearray, fingerprint: str, key: str, layout: Layout) -> tuple[Block, str]:
    """Parse and verify one stored block and return it with its verified checksum; raises CorruptBlock if
    it is not exactly what this server expects.

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
        raise CorruptBlock(f"unreadable block: {exc}") from exc
    if meta.get("kvscope_format") != FORMAT_VERSION:
        raise CorruptBlock(f"format {meta.get('kvscope_format')!r}, expected {FORMAT_VERSION}")
    if meta.get("fingerprint") != fingerprint or meta.get("key") != key:
        raise CorruptBlock("fingerprint or key mismatch (a foreign block)")
    for got, want in zip_longest(found, layout.entries):
        if got != want:
            raise CorruptBlock(f"layer {got}, expected {want}")
    if len(data) != 8 + n + layout.nbytes:
        raise CorruptBlock(f"{len(data)} bytes, expected {8 + n + layout.nbytes} (truncated or padded)")
    block = torch.frombuffer(data, dtype=torch.uint8, count=layout.nbytes, offset=8 + n)
    digest = checksum(block)
    if digest != meta.get("checksum"):
        raise CorruptBlock("checksum mismatch")
    return block, digest
