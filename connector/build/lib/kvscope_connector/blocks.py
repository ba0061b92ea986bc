"""A block: the KV of one block of tokens in every layer, held as one flat byte buffer whose layers lie one
after another in name order (a Layout says where), and its checksum."""

from __future__ import annotations

from typing import NamedTuple, TypeAlias

import torch
import xxhash


class CorruptBlock(ValueError):
    """A stored block that is not exactly what this server expects: never loaded."""


Block: TypeAlias = torch.Tensor  # one block: a 1-D uint8 CPU tensor laid out by a Layout


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
