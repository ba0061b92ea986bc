"""Benchmark: the connector's filesystem-tier load throughput against a raw sequential read of the same files.

A model shape with enough KV bytes per token to measure I/O (default: 32 layers x 8 KV heads x head_dim 128,
fp16, block 64 -> 8 MiB per block). Blocks are written by WorkerSide.save, then read back R times, in
alternation: raw (read every file whole, sequentially) and connector (WorkerSide.load: read, verify
header, shapes and checksum, copy into the KV cache). Both run with the files in the page cache, so the
ratio measures what verification and injection cost on top of the read; with --cold, every file is
dropped from the page cache (posix_fadvise DONTNEED) before each read, so both read the disk. With
--device cuda the KV caches are on the GPU and the worker checks blocks there (mix128, as the connector
does beside a GPU); each connector load ends with a device synchronize before its timer stops.
Goal (issue 5): >= 0.7.

    .venv-vllm/bin/python loadtests/benchmarks/load_throughput.py [--dir /path/on/the/fs/under/test] [--device cuda]
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvscope_connector.messages import KVScopeMetadata, LoadSpec, StoreSpec
from kvscope_connector.store import FsTier
from kvscope_connector.worker import LOAD_THREADS, WorkerSide


def drop(files: list[Path], cold: bool) -> None:
    if cold:
        for f in files:
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())  # DONTNEED leaves dirty pages (files just saved) in the page cache
                os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=None, help="directory on the filesystem to measure (default: a temp dir)")
    ap.add_argument("--blocks", type=int, default=48)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--block", type=int, default=64, help="tokens per block (16 with --layers 36: the 2.25 MiB "
                    "blocks of the Qwen3-4B shape in bf16)")
    ap.add_argument("--threads", type=int, default=None, help="load threads (default: the connector's)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="drop each file from the page cache before reading")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where the KV caches are")
    args = ap.parse_args()
    device = torch.device(args.device)
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvscope-bench-"))
    fp, block = "b" * 32, args.block
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(args.blocks * 2, 8, block, 256, device=device).half()
              for i in range(args.layers)}
    checksum = "mix128" if device.type == "cuda" else "xxh3-128"  # the connector's choice (connector._checksum)
    worker = WorkerSide(fp, block, None, FsTier(str(root), fp, None), checksum=checksum, load_threads=args.threads)
    worker.register(caches)
    keys = [f"{i:04x}" + "0" * 36 for i in range(args.blocks)]
    worker.save(KVScopeMetadata(stores=[StoreSpec(i, k, False, True) for i, k in enumerate(keys)]))
    worker.flush()
    sync(device)
    files = [worker.fs.path(k) for k in keys]
    total = sum(f.stat().st_size for f in files)
    meta = KVScopeMetadata(loads=[LoadSpec(args.blocks + i, k, "fs") for i, k in enumerate(keys)])
    raw, conn = [], []
    for _ in range(args.repeats):
        drop(files, args.cold)
        t = time.perf_counter()
        for f in files:
            f.read_bytes()
        raw.append(total / (time.perf_counter() - t))
        drop(files, args.cold)
        t = time.perf_counter()
        worker.load(meta)
        sync(device)
        conn.append(total / (time.perf_counter() - t))
        assert not worker.take_load_errors()
    assert all(torch.equal(t[args.blocks], t[0]) for t in caches.values())
    mib = 2**20
    cache = "cold: dropped from the page cache" if args.cold else "hot: in the page cache"
    threads, per_block = args.threads or LOAD_THREADS[device.type], total / args.blocks / np.median(conn)
    print(f"{args.blocks} blocks x {total / args.blocks / mib:.2f} MiB under {root}, {args.repeats} rounds, {cache}, "
          f"KV caches on {device}, {threads} load threads; {per_block * 1e6:.0f} µs a block (median load / blocks)")
    for name, rates in (("raw sequential read", raw), ("connector load", conn)):
        print(f"{name:<20} median {np.median(rates) / mib:8.0f} MiB/s "
              f"(min {min(rates) / mib:.0f}, max {max(rates) / mib:.0f})")
    print(f"connector / raw = {np.median(conn) / np.median(raw):.2f}  (goal >= 0.7)")
    if args.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
