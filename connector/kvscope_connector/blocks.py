"""A block: the KV of one block of tokens in every layer, held as one flat byte buffer whose layers lie one
after another in name order (a Layout says where), and its checksum.

Two checksums, one per platform (the fingerprint names it, so servers that use different ones never share a
store): XXH3-128 on the host beside a CPU KV cache, and mix128 beside a GPU, computed on the GPU from the
bytes there, so a block's host bytes are touched once, by the copy. Neither is a defence against someone who
can rewrite the store (fileformat.mac is).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import NamedTuple, TypeAlias

import numpy as np
import torch
import xxhash

from . import fusedmix

log = logging.getLogger("kvscope_connector")


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


# mix128: each 64-bit word w at position i becomes z = mix(w * K[i]) (K: odd keys, one per position; mix: an
# xor-shift and an odd multiply), and the digest is two sums of such words, mod 2^64. Every step is a
# bijection of the word, so a change to any one word always changes the digest; other damage (zeroed,
# torn, stale, shifted or foreign bytes) goes unseen with a chance near 2^-64 per lane. Written in torch
# integer ops, it runs on whatever device holds the bytes, one batch of blocks at a time; wrapping int64
# arithmetic gives the same digest on every device (a test checks it against NumPy's uint64). On a CUDA GPU a
# Triton kernel computes it in one pass (fusedmix.py).
_M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9
_MASK = (1 << 64) - 1
_keys: dict[tuple[int, str], torch.Tensor] = {}


def _signed(x: int) -> int:
    return x - (1 << 64) if x >= 1 << 63 else x


def position_keys(words: int) -> np.ndarray:
    """K: an odd 64-bit key per word position (splitmix64 of the position)."""
    with np.errstate(over="ignore"):
        z = np.arange(1, words + 1, dtype=np.uint64) * np.uint64(_M1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_M2)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return (z ^ (z >> np.uint64(31))) | np.uint64(1)


def _device_keys(words: int, device: torch.device) -> torch.Tensor:
    key = (words, str(device))
    if key not in _keys:
        _keys[key] = torch.from_numpy(position_keys(words).view(np.int64)).to(device)
        if device.type == "cuda":  # once: every stream that uses the keys finds them there
            torch.cuda.synchronize(device)
    return _keys[key]


def _logical_shift(z: torch.Tensor, bits: int) -> torch.Tensor:
    """z >>> bits on int64 (torch shifts signed integers arithmetically)."""
    out = z >> bits
    return out.bitwise_and_((1 << (64 - bits)) - 1)


def mix_digests(rows: torch.Tensor, fused: bool = True) -> torch.Tensor:
    """mix128 of each row of a [n, nbytes] uint8 tensor (nbytes a multiple of 8), on the rows' device:
    [n, 2] int64, left there (reading it back is the caller's synchronisation point). On a CUDA GPU where
    fusedmix's kernel gave these torch ops' digests for rows of this size, that kernel (fused=False: the torch
    ops)."""
    words = rows.view(torch.int64)
    keys = _device_keys(words.shape[1], rows.device)
    if fused and words.is_contiguous() and words.data_ptr() % 16 == 0 and fused_on(rows.device, rows.shape[1]):
        return fusedmix.digests(words, keys)
    z = words * keys
    z ^= _logical_shift(z, 32)
    z *= _signed(_M1)
    first = z.sum(dim=1)
    z ^= _logical_shift(z, 29)
    z *= _signed(_M2)
    return torch.stack([first, z.sum(dim=1)], dim=1)


_fused: dict[tuple[str, int], bool] = {}  # (device, bytes a row) -> whether mix_digests runs fusedmix's kernel


def fused_on(device: torch.device, nbytes: int) -> bool:
    """Whether mix_digests runs fusedmix's kernel on rows of nbytes on this device: a CUDA GPU where it agreed
    with the torch ops on such rows, tried once per device and size (the worker tries its blocks' size when
    vLLM registers the KV caches)."""
    if device.type != "cuda":
        return False
    if (str(device), nbytes) not in _fused:
        _fused[str(device), nbytes] = agrees(device, nbytes)
    return _fused[str(device), nbytes]


def agrees(device: torch.device, nbytes: int) -> bool:
    """Whether fusedmix's kernel gives the torch ops' digests of random rows of nbytes on this device, freshly
    allocated as every batch mix_digests passes it is: the kernel Triton compiles for such rows (it specializes
    on a size's divisibility and a pointer's alignment). False, logged, where it gives others or fails (no
    Triton, a compile or launch error): the torch ops are then used."""
    gen = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 256, (3, nbytes), dtype=torch.uint8, generator=gen).to(device)
    words = rows.view(torch.int64)
    try:
        same = torch.equal(fusedmix.digests(words, _device_keys(words.shape[1], device)),
                           mix_digests(rows, fused=False))
    except Exception as exc:  # whatever Triton raises: the torch ops are the reference, and they still run
        log.warning("kvscope connector: mix128's fused kernel does not run on %s (%s): torch ops instead", device, exc)
        return False
    if not same:
        log.warning("kvscope connector: mix128's fused kernel gives other digests on %s: torch ops instead", device)
    return same


def digest_hex(pair: list[int]) -> str:
    """One row of mix_digests as 32 hex digits, the form every tier and file stores."""
    return f"{pair[0] & _MASK:016x}{pair[1] & _MASK:016x}"


def mix128(block: Block) -> str:
    """mix128 of one block, where it lies (the host path's form of the GPU checksum)."""
    return digest_hex(mix_digests(block.view(1, -1))[0].tolist())


CHECKSUMS: dict[str, Callable[[Block], str]] = {"xxh3-128": checksum, "mix128": mix128}
