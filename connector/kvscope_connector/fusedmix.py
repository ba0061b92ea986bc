"""mix128 (blocks.py) in one pass over the bytes: a Triton kernel for blocks on a CUDA GPU.

blocks.mix_digests in torch ops reads and writes a batch's words about 23 times (on the H200 13.0 ms for
2.4 GB, 186 GB/s, copy_paths-512.txt of 2026-12-05), GPU time every save and load spends beside the
forward. This kernel reads each word and its position key once and writes one pair of partial sums per
BLOCK words; the partials are summed in torch (both wrap mod 2^64, as the torch ops do). blocks.py uses it
on a device only for rows of a size it has given the torch ops' digests of there.
"""

from __future__ import annotations

import contextlib

import torch

try:
    import triton
    import triton.language as tl
except Exception:  # no Triton, or one that does not load: blocks.py keeps the torch ops
    triton = None

BLOCK = 4096  # words a program reads (32 KiB)

if triton is not None:
    @triton.jit
    def _partial_sums(words, keys, parts, W, PARTS, BLOCK: tl.constexpr):
        """Program (row, part): the two lanes' sums over words [part * BLOCK, (part + 1) * BLOCK) of row."""
        row, part = tl.program_id(0).to(tl.int64), tl.program_id(1)
        offs = part * BLOCK + tl.arange(0, BLOCK)
        inside = offs < W  # a word past the row counts as 0, whose mix is 0
        w = tl.load(words + row * W + offs, mask=inside, other=0).to(tl.uint64, bitcast=True)
        k = tl.load(keys + offs, mask=inside, other=0).to(tl.uint64, bitcast=True)
        z = w * k
        z ^= z >> 32  # logical shifts: the words are unsigned here
        z *= 0x9E3779B97F4A7C15
        first = tl.sum(z, axis=0)
        z ^= z >> 29
        z *= 0xBF58476D1CE4E5B9
        out = parts + (row * PARTS + part) * 2
        tl.store(out, first.to(tl.int64, bitcast=True))
        tl.store(out + 1, tl.sum(z, axis=0).to(tl.int64, bitcast=True))


def digests(words: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """mix128 of each row of [n, W] int64 words with W position keys, on their device: [n, 2] int64. Raises
    RuntimeError without Triton, and whatever Triton raises where it cannot compile or launch."""
    if triton is None:
        raise RuntimeError("Triton does not import")
    n, width = words.shape
    parts = triton.cdiv(width, BLOCK)
    out = torch.empty((n, parts, 2), dtype=torch.int64, device=words.device)
    if n:
        with torch.cuda.device(words.device) if words.is_cuda else contextlib.nullcontext():  # Triton launches
            _partial_sums[(n, parts)](words, keys, out, width, parts, BLOCK=BLOCK)  # on the current device
    return out.sum(dim=1)
