"""Fault-injection canaries, for tests and demos only: connectors that load wrong KV on purpose.

kvscope must flag both as fidelity FAIL on every run. They store and verify exactly like
KVScopeConnector and break only what they write into vLLM's KV cache:
- ShiftedBlockCanary: the misalignment class of UCM #867. The blocks a request loads are written one
  block later (block j receives block j-1's KV, the first receives the last's); a request that loads a
  single block gets its tokens' KV one position late instead.
- PerturbedCanary: each loaded value gets Gaussian noise with the block's own standard deviation.
"""

from __future__ import annotations

import torch

from .connector import KVScopeConnector
from .scheduler import KVScopeMetadata
from .store import Block
from .worker import WorkerSide


class _ShiftedWorker(WorkerSide):
    def load(self, meta: KVScopeMetadata) -> None:
        self.begin_step(meta)
        verified = list(self.fetch_all(meta.loads))
        good = [(spec, block) for spec, block in verified if block is not None]
        self.load_errors |= {spec.block_id for spec, block in verified if block is None}
        if len(good) == 1:
            good = [(spec, self.layout.pack({name: torch.roll(t, 1, dims=_token_dim(t, self.block_size))
                                             for name, t in self.layout.views(block).items()}))
                    for spec, block in good]
        # each block gets its predecessor's KV (the first takes the last's): a rotation by one block
        self.inject([(spec.block_id, good[i - 1][1]) for i, (spec, _) in enumerate(good)])


def _token_dim(t: torch.Tensor, block_size: int) -> int:
    """The first axis of one block's tensor that is block_size long: (H, B, C) on CPU, (2, B, H, D) on GPU."""
    return next(d for d in range(t.dim()) if t.shape[d] == block_size)


class _PerturbedWorker(WorkerSide):
    def transform(self, spec, block: Block, meta) -> Block:
        gen = torch.Generator().manual_seed(spec.block_id)
        return self.layout.pack({name: t + torch.randn(t.shape, generator=gen, dtype=t.dtype) * t.std()
                                 for name, t in self.layout.views(block).items()})


class ShiftedBlockCanary(KVScopeConnector):
    worker_cls = _ShiftedWorker


class PerturbedCanary(KVScopeConnector):
    worker_cls = _PerturbedWorker
