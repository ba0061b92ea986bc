"""Benchmark: the connector's filesystem-tier load throughput against a raw sequential read of the same files.

A model shape with enough KV bytes per token to measure I/O (default: 32 layers x 8 KV heads x head_dim 128,
fp16, block 64 -> 8 MiB per block). The blocks of one prompt are written by WorkerSide.save twice, as files
of --file-tokens (the connector's default beside a GPU: 256) and as one block a file, then read back R
times, in turn: raw (read every file whole, sequentially) and connector (WorkerSide.load: read, verify
header, shapes and checksum, copy into the KV cache) for each layout. All run with the files in the page
cache, so the ratio to raw measures what verification and injection cost on top of the read, and the ratio
of the layouts what fewer, larger files save; with --cold, every file is dropped from the page cache
(posix_fadvise DONTNEED) before each read, so each reads the disk. With --device cuda the KV caches are on
the GPU and the worker checks blocks there (mix128, as the connector does beside a GPU); each connector load
ends with a device synchronize before its timer stops, and where KvikIO imports the files of --file-tokens are
loaded a second way, read by KvikIO straight into GPU memory (the connector's opt-in `file_reads: kvikio`)
against read into pinned host memory (its default, the other two).
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

from kvscope_connector.connector import FILE_TOKENS
from kvscope_connector.devicereads import kvikio_reads
from kvscope_connector.messages import KVScopeMetadata, LoadSpec, StoreSpec
from kvscope_connector.scheduler import placed
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
    ap.add_argument("--file-tokens", type=int, default=None, help="tokens a file holds (default: the connector's "
                    f"{FILE_TOKENS['cuda']} beside a GPU)")
    args = ap.parse_args()
    device = torch.device(args.device)
    root = Path(args.dir or tempfile.mkdtemp(prefix="kvscope-bench-"))
    fp, block = "b" * 32, args.block
    per_file = max(1, (args.file_tokens or FILE_TOKENS["cuda"]) // block)
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(args.blocks * 2, 8, block, 256, device=device).half()
              for i in range(args.layers)}
    checksum = "mix128" if device.type == "cuda" else "xxh3-128"  # the connector's choice (connector._checksum)
    keys = [f"{i:04x}" + "0" * 36 for i in range(args.blocks)]
    threads = args.threads or LOAD_THREADS[device.type]
    layouts = {f"{per_file} blocks a file": (per_file, False), "1 block a file": (1, False)}  # into pinned slots
    kvikio = device.type == "cuda" and kvikio_reads(threads) is not None
    if kvikio:
        layouts[f"{per_file} blocks a file, KvikIO"] = (per_file, True)
    workers, metas, files = {}, {}, {}
    for name, (n, to_device) in layouts.items():
        fs = FsTier(str(root / f"{n}-per-file{'-kvikio' if to_device else ''}"), fp, None, per_file=n)
        worker = workers[name] = WorkerSide(fp, block, None, fs, checksum=checksum, load_threads=args.threads,
                                            device_reads=to_device)
        worker.register(caches)
        where = placed(keys, n)
        worker.save(KVScopeMetadata(stores=[StoreSpec(i, k, False, True, file=where[i].file)
                                            for i, k in enumerate(keys)]))
        worker.flush()
        sync(device)
        files[name] = sorted({fs.path(f.file) for f in where})
        metas[name] = KVScopeMetadata(loads=[LoadSpec(args.blocks + i, k, "fs", file=f.file, offset=f.offset,
                                                      count=f.count) for i, (k, f) in enumerate(zip(keys, where))])
    total = sum(f.stat().st_size for f in files["1 block a file"])
    rates: dict[str, list[float]] = {"raw sequential read": [], **{f"connector, {name}": [] for name in layouts}}
    for _ in range(args.repeats):
        drop(files["1 block a file"], args.cold)
        t = time.perf_counter()
        for f in files["1 block a file"]:
            f.read_bytes()
        rates["raw sequential read"].append(total / (time.perf_counter() - t))
        for name, worker in workers.items():
            drop(files[name], args.cold)
            t = time.perf_counter()
            worker.load(metas[name])
            sync(device)
            rates[f"connector, {name}"].append(total / (time.perf_counter() - t))
            assert not worker.take_load_errors()
            assert all(torch.equal(kv[args.blocks:], kv[:args.blocks]) for kv in caches.values())
            for kv in caches.values():
                kv[args.blocks:].zero_()
    mib = 2**20
    cache = "cold: dropped from the page cache" if args.cold else "hot: in the page cache"
    print(f"{args.blocks} blocks x {total / args.blocks / mib:.2f} MiB under {root}, {args.repeats} rounds, {cache}, "
          f"KV caches on {device}, {threads} load threads")
    medians = {name: float(np.median(r)) for name, r in rates.items()}
    for name, r in rates.items():
        print(f"{name:<34} median {medians[name] / mib:8.0f} MiB/s (min {min(r) / mib:.0f}, max {max(r) / mib:.0f}, "
              f"n {len(r)}); {total / args.blocks / medians[name] * 1e6:.0f} µs a block")
    raw = medians["raw sequential read"]
    chunked, single = (medians[f"connector, {name}"] for name in list(layouts)[:2])
    print(f"connector / raw = {chunked / raw:.2f} with {per_file} blocks a file, {single / raw:.2f} with one  "
          "(goal >= 0.7)")
    print(f"{per_file} blocks a file / 1 block a file = {chunked / single:.2f}")
    if kvikio:
        print(f"KvikIO into GPU memory / reads into pinned memory, {per_file} blocks a file = "
              f"{medians[f'connector, {per_file} blocks a file, KvikIO'] / chunked:.2f}")
    else:
        print("KvikIO not measured" + (" (kvikio does not import)" if device.type == "cuda" else " (no GPU)"))
    if args.dir is None:
        shutil.rmtree(root)


if __name__ == "__main__":
    main()
