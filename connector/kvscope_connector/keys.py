"""Block keys: a fingerprint of everything that makes KV bytes differ, chained over token-id blocks.

Two servers share a block only when the fingerprint (model config and weights, dtypes, block size, KV
layout, tensor-parallel rank and size, the serving stack: vLLM version, platform and attention backend, the
connector format, the checksum, and which store secret signs the files) and every token before and inside the
block agree.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import json
import os
import stat
from pathlib import Path

import numpy as np

from .fileformat import FORMAT_VERSION

SECRET_ENV = "KVSCOPE_STORE_KEY"  # the store secret itself, or
SECRET_FILE_ENV = "KVSCOPE_STORE_KEY_FILE"  # a file holding it (a mounted secret)


def _file_digest(path: Path, cache_dir: Path) -> str:
    """SHA-256 of a whole file, cached by path, size, inode and modification time (hashing 8 GB of
    weights takes seconds; an in-place update changes the mtime and is hashed again)."""
    st = path.stat()
    stamp = f"{path.resolve()}:{st.st_size}:{st.st_ino}:{st.st_mtime_ns}"
    cached = cache_dir / (hashlib.sha256(stamp.encode()).hexdigest()[:32] + ".sha256")
    try:
        return cached.read_text().strip()
    except OSError:
        pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = cached.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(digest)
        os.replace(tmp, cached)
    except OSError:
        pass  # a read-only home: hash again next time
    return digest


def weights_identity(model_dir: str, cache_dir: str | None = None) -> str:
    """Identity of a local model's weights: the config and the SHA-256 of every weight file, whole. Empty
    for hub names."""
    root = Path(model_dir)
    if not root.is_dir():
        return ""
    cache = Path(cache_dir or os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvscope" / "weights"
    digest = hashlib.sha256()
    for path in sorted(list(root.glob("*.safetensors")) + list(root.glob("*.bin")) + list(root.glob("config.json"))):
        digest.update(f"{path.name}:{_file_digest(path, cache)}\n".encode())
    return digest.hexdigest()


def _read_regular(path: str) -> bytes:
    """A regular file's bytes; anything else (a FIFO, which would wait for a writer, a device, a socket, a
    folder) stops the server. Opened without blocking, checked before it is read."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError as exc:
        if exc.errno == errno.ENXIO:  # a socket
            raise ValueError(f"kvscope connector: ${SECRET_FILE_ENV} names {path}, not a regular file") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"kvscope connector: ${SECRET_FILE_ENV} names {path}, not a regular file")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read()
    finally:
        os.close(fd)


def store_secret() -> bytes | None:
    """The secret that signs the filesystem tier's files: $KVSCOPE_STORE_KEY, or the file named by
    $KVSCOPE_STORE_KEY_FILE; None when neither is set (or set to nothing). A key that is set but unusable
    (an empty file, whitespace, fewer than 16 bytes) stops the server rather than turn signing off. Never
    logged, never in the config."""
    if os.environ.get(SECRET_FILE_ENV):
        raw = _read_regular(os.environ[SECRET_FILE_ENV])
        where = f"the file ${SECRET_FILE_ENV} names"
    else:
        raw = os.environ.get(SECRET_ENV, "").encode()
        where = f"${SECRET_ENV}"
        if not raw:
            return None
    secret = raw.strip()
    if len(secret) < 16:
        raise ValueError(f"kvscope connector: the store secret in {where} has {len(secret)} bytes besides "
                         "whitespace; use at least 16")
    return secret


def secret_id(secret: bytes | None) -> str:
    """Which secret signs a store, without revealing it (servers with different secrets use different
    directories instead of quarantining each other's files)."""
    return "" if secret is None else hmac.new(secret, b"kvscope store id", hashlib.sha256).hexdigest()[:16]


def fingerprint(*, model_config: dict, weights: str, dtype: str, kv_dtype: str, block_size: int, layout: str,
                tp_rank: int, tp_size: int, stack: dict | None = None, signer: str = "",
                checksum: str = "xxh3-128", per_file: int = 1, quantization: str | None = None,
                revision: str | None = None) -> str:
    """What names a store: everything that changes KV bytes (a checkpoint quantized at load, a hub model's
    revision too), and how they are stored (the checksum, the format, blocks per file: servers that differ in
    any of it never share a directory)."""
    doc = {"model_config": model_config, "weights": weights, "quantization": quantization, "revision": revision,
           "dtype": dtype, "kv_dtype": kv_dtype,
           "block_size": block_size, "layout": layout, "tp_rank": tp_rank, "tp_size": tp_size,
           "stack": stack or {}, "signer": signer, "checksum": checksum, "format": FORMAT_VERSION,
           "per_file": per_file}
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
