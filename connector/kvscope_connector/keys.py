"""Block keys: a fingerprint of everything that makes KV bytes differ, chained over token-id blocks.

Two servers share a block only when the fingerprint (model config and weights, dtypes, block size, KV
layout, tensor-parallel rank and size, connector format) and every token before and inside the block agree.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from .fileformat import FORMAT_VERSION

_SAMPLE = 1 << 20  # bytes read from each end of a weight file for its identity


def weights_identity(model_dir: str) -> str:
    """Identity of a local model's weights without reading them whole: config, file sizes, and 1 MiB at
    each end of every weight file (random or trained weights differ there). Empty for hub names."""
    root = Path(model_dir)
    if not root.is_dir():
        return ""
    digest = hashlib.sha256()
    for path in sorted(list(root.glob("*.safetensors")) + list(root.glob("*.bin")) + list(root.glob("config.json"))):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(_SAMPLE))
            if size > _SAMPLE:
                f.seek(max(_SAMPLE, size - _SAMPLE))
                digest.update(f.read())
    return digest.hexdigest()


def fingerprint(*, model_config: dict, weights: str, dtype: str, kv_dtype: str, block_size: int, layout: str,
                tp_rank: int, tp_size: int) -> str:
    doc = {"model_config": model_config, "weights": weights, "dtype": dtype, "kv_dtype": kv_dtype,
           "block_size": block_size, "layout": layout, "tp_rank": tp_rank, "tp_size": tp_size,
           "format": FORMAT_VERSION}
    return hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).hexdigest()[:32]


def block_keys(fp: str, token_ids: list[int], block_size: int, limit: int | None = None) -> list[str]:
    """Keys of the full blocks of `token_ids` (at most `limit`), each chained on all earlier tokens: SHA-256
    over the previous block's digest and the block's ids as little-endian int64."""
    keys, prev = [], fp.encode()
    n = len(token_ids) // block_size if limit is None else min(limit, len(token_ids) // block_size)
    step = block_size * 8
    data = np.asarray(token_ids[:n * block_size], dtype="<i8").tobytes()
    for i in range(n):
        prev = hashlib.sha256(prev + data[i * step:(i + 1) * step]).digest()
        keys.append(prev.hex()[:40])
    return keys
