"""Benchmark: ways to read one prompt's KV blocks from files, on this machine, the same bytes each way.

The blocks of a Qwen3-4B-shaped prompt (--blocks of --block-mb each, random bytes) are written once as one
file per block (the connector's layout today) and once as one segment file. Each way reads all of them into
pinned host memory (or GPU memory, for KvikIO), from the page cache ("warm") and after dropping the files'
pages ("cold": posix_fadvise DONTNEED on clean pages; no root needed):
- raw: one thread, one sequential read of the segment: the disk's own rate, the cold-disk reference;
- per-file: open + readinto per block file on --threads threads (the connector's pattern);
- preadv: os.preadv of --chunk blocks per call from the segment on --threads threads;
- connector: the connector's own file read on --threads threads (FsTier.get_file without the host checksum,
  into its slot pool: the host's half of a load beside a GPU, whose checksum runs on the GPU), from files in
  its format (a header per file) of --chunk blocks each, written by FsTier.put_file, when kvscope_connector
  imports; connector-1 the same with one block a file; against per-file and preadv, what the connector's
  work costs;
- kvikio: KvikIO's pread of the segment into GPU memory (GDS where the host has it, its threaded POSIX path
  where not) and into pinned host memory, when kvikio imports; kvikio-files: the connector's files of --chunk
  blocks the way a load straight into GPU staging would read them (each header into host memory with
  os.pread, each file's blocks with KvikIO into GPU memory, all files' reads in flight at once); KvikIO reads
  on its own threads, as many as KVIKIO_NTHREADS says (its default: one), not --threads;
- h2d: one pinned host-to-device copy of the same bytes, the limit beside a GPU.
Prints the median of --rounds per way in GB/s and against raw, with n and spread, and checks every way read
the bytes that were written.

    python loadtests/benchmarks/read_paths.py [--blocks 512] [--block-mb 4.5] [--threads 8] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch


def filesystem(path: str) -> str:
    """The device and type of the filesystem holding path, from /proc/mounts (longest mount point)."""
    best, where = ("?", "?", ""), os.path.realpath(path).rstrip("/") + "/"
    for line in open("/proc/mounts"):
        dev, mount, kind = line.split()[:3]
        if where.startswith(mount.rstrip("/") + "/") and len(mount) > len(best[2]):
            best = (dev, kind, mount)
    return f"{best[0]} ({best[1]})"


def drop(paths: list[str]) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def exactly(got: int, want: int) -> None:
    if got != want:
        raise OSError(f"short read: {got} of {want} bytes")


def per_file(files, dst, size, pool):
    def one(i):
        with open(files[i], "rb", buffering=0) as f:
            exactly(f.readinto(dst[i * size:(i + 1) * size].numpy()), size)
    list(pool.map(one, range(len(files))))


def preadv(segment, dst, size, n, chunk, pool):
    fd = os.open(segment, os.O_RDONLY)
    try:
        def one(start):
            stop = min(n, start + chunk)
            views = [dst[i * size:(i + 1) * size].numpy() for i in range(start, stop)]
            exactly(os.preadv(fd, views, start * size), (stop - start) * size)
        list(pool.map(one, range(0, n, chunk)))
    finally:
        os.close(fd)


def connector_files(work, src, n, size, pinned, per_file):
    """The blocks as the connector stores them, files of per_file blocks, and a read of them all the way a load
    beside a GPU reads them; None where kvscope_connector does not import."""
    try:
        from kvscope_connector.blocks import Layout
        from kvscope_connector.store import FsTier
        from kvscope_connector.transfer import Side, SlotPool
    except ImportError as e:
        print(f"connector not measured: {e}")
        return None
    layers = size // (8 * 16 * 128 * 2 * 2)  # the Qwen3-4B shape's layer in a 16-token block: 8 KV heads x 128
    layout = Layout({f"model.layers.{i:02d}.self_attn.attn": torch.empty(2, 8, 16, 128, dtype=torch.bfloat16)
                     for i in range(layers)})
    if layout.nbytes != size:
        print(f"connector not measured: {size} bytes is not a whole number of the Qwen3-4B shape's layers")
        return None
    fs = FsTier(os.path.join(work, f"connector-{per_file}"), "f" * 32, None, layout=layout, per_file=per_file)
    fs.pool = SlotPool(size, Side(torch.device("cpu")), pinned=pinned)
    keys = [f"{i:040x}" for i in range(n)]
    runs = [keys[i:i + per_file] for i in range(0, n, per_file)]
    for i, run in zip(range(0, n, per_file), runs):  # a checksum nobody checks here (the GPU would)
        fs.put_file(run[-1], [(key, src[j * size:(j + 1) * size], "0" * 32) for j, key in enumerate(run, start=i)])

    def read(pool, dst=None):
        """Every block into a slot of its own (as a load holds ~2 chunks' worth, hundreds of MB, until the
        GPU has them), then every slot back to the pool; with dst, the blocks copied there too, for the check
        of the bytes (beside a GPU the side stream copies a slot, not this thread)."""
        found = pool.map(lambda run: fs.get_file(run[-1], run, 0, len(run), verify=False), runs)
        blocks = [block for got in found for block, _ in got]
        if dst is not None:
            torch.cat(blocks, out=dst)
        for block in blocks:
            fs.pool.give_back(block)
    return read, [fs._name(run[-1]) for run in runs]


def kvikio_files(kvikio, paths, dev, per_file):
    """Each file's header into host memory, its blocks (the file's last bytes, at most per_file of them, in
    order) with KvikIO into dev after the files before it; every read in flight before any is waited for."""
    files, reads, at = [], [], 0
    try:
        for path in paths:
            files.append(kvikio.CuFile(path, "r"))
            size = os.path.getsize(path)
            body = min(per_file, dev.numel() - at)
            fd = os.open(path, os.O_RDONLY)
            try:
                exactly(len(os.pread(fd, size - body, 0)), size - body)
            finally:
                os.close(fd)
            reads.append((files[-1].pread(dev[at:at + body], body, size - body), body))
            at += body
        for read, body in reads:
            exactly(read.get(), body)
        exactly(at, dev.numel())
    finally:
        for f in files:
            f.close()


def raw(segment, dst):
    with open(segment, "rb", buffering=0) as f:
        view, got = memoryview(dst.numpy()), 0
        while got < len(view):
            step = f.readinto(view[got:got + (64 << 20)])
            if not step:
                raise OSError(f"the segment ended after {got} bytes")
            got += step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--block-mb", type=float, default=4.5)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--chunk", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    if not 1 <= args.chunk <= 256:  # the connector's most blocks a file
        ap.error("--chunk: 1 to 256 blocks")
    n, size = args.blocks, int(args.block_mb * (1 << 20)) // 4096 * 4096
    total = n * size
    gpu = torch.cuda.is_available()
    src = torch.randint(0, 256, (total,), dtype=torch.uint8)
    dst = torch.empty(total, dtype=torch.uint8, pin_memory=gpu)
    work = tempfile.mkdtemp(dir=args.dir, prefix="read-paths-")
    try:
        files = [os.path.join(work, f"b{i}") for i in range(n)]
        segment = os.path.join(work, "segment")
        for i, p in enumerate(files):
            with open(p, "wb") as f:
                f.write(src[i * size:(i + 1) * size].numpy())
        with open(segment, "wb") as f:
            f.write(src.numpy())
        pool = ThreadPoolExecutor(args.threads)
        ways = {"raw": (lambda: raw(segment, dst), [segment]),
                "per-file": (lambda: per_file(files, dst, size, pool), files),
                "preadv": (lambda: preadv(segment, dst, size, n, args.chunk, pool), [segment])}
        filled = {}  # ways whose reads leave no bytes in dst: how to fill it for the check
        for name, per in (("connector", args.chunk), ("connector-1", 1)):
            if (conn := connector_files(work, src, n, size, gpu, per)) is not None:
                ways[name] = (lambda read=conn[0]: read(pool), conn[1])
                filled[name] = lambda read=conn[0]: read(pool, dst)
        on_gpu = {}
        if gpu:
            dev = torch.empty(total, dtype=torch.uint8, device="cuda")
            ways["h2d"] = (lambda: dev.copy_(dst, non_blocking=True), [])
            try:
                import kvikio
                import kvikio.cufile_driver
                import kvikio.defaults
                print(f"kvikio {kvikio.__version__}: compat mode {kvikio.defaults.get('compat_mode')}, "
                      f"threads {kvikio.defaults.get('num_threads')}")
                try:
                    print(f"GDS available: {kvikio.cufile_driver.get('is_gds_available')}")
                except Exception as e:  # no cuFile driver: compat mode only
                    print(f"GDS not available: {type(e).__name__}: {e}")

                def kv(buf):
                    with kvikio.CuFile(segment, "r") as f:
                        exactly(f.pread(buf, total).get(), total)
                ways["kvikio-gpu"] = (lambda: kv(dev), [segment])
                ways["kvikio-host"] = (lambda: kv(dst.numpy()), [segment])
                on_gpu["kvikio-gpu"] = dev
                if "connector" in ways:
                    chunked = ways["connector"][1]
                    ways["kvikio-files"] = (lambda: kvikio_files(kvikio, chunked, dev, size * args.chunk), chunked)
                    on_gpu["kvikio-files"] = dev
            except Exception as e:
                print(f"kvikio not measured: {type(e).__name__}: {e}")
        sync = torch.cuda.synchronize if gpu else (lambda: None)
        print(f"machine: {os.cpu_count()} cores {platform.machine()}, "
              f"{torch.cuda.get_device_name() if gpu else 'no GPU'}, torch {torch.__version__}; "
              f"{args.dir} on {filesystem(args.dir)}" + (" (tmpfs: its cold reads are not cold)"
                                                    if "(tmpfs)" in filesystem(args.dir) else ""))
        print(f"{n} blocks of {size / (1 << 20):.2f} MiB ({total / 1e9:.2f} GB), {args.threads} threads, "
              f"preadv {args.chunk} blocks a call, median of {args.rounds}; dir {args.dir}")
        rates = {}
        for cache in ("warm", "cold"):
            for name, (fn, paths) in ways.items():
                if cache == "cold" and not paths:
                    continue
                times = []
                try:  # a way that fails is reported; the others still run
                    for _ in range(args.rounds):
                        dst.zero_()
                        if name in on_gpu:
                            on_gpu[name].zero_()
                        if cache == "cold":
                            drop(paths)
                        elif not times:
                            fn()  # warm-up: the files in the page cache
                        sync()
                        t = time.perf_counter()
                        fn()
                        sync()
                        times.append(time.perf_counter() - t)
                except Exception as e:
                    print(f"{cache:4} {name:11} failed: {type(e).__name__}: {e}")
                    continue
                if name in filled:
                    filled[name]()
                got = on_gpu[name].cpu() if name in on_gpu else dst
                ok = "(not checked)" if name == "h2d" else "ok" if torch.equal(got, src) else "WRONG BYTES"
                gbs = [total / t / 1e9 for t in times]
                rates[cache, name] = float(np.median(gbs))
                print(f"{cache:4} {name:11} {rates[cache, name]:6.2f} GB/s (min {min(gbs):.2f}, max {max(gbs):.2f}, "
                      f"n {len(gbs)}) {ok}")
        for cache in ("warm", "cold"):
            base = rates[cache, "raw"]
            print(f"{cache}: " + ", ".join(f"{name} / raw {r / base:.2f}" for (c, name), r in rates.items()
                                           if c == cache and name != "raw"))
            if (cache, "connector") in rates:
                print(f"{cache}: connector / per-file {rates[cache, 'connector'] / rates[cache, 'per-file']:.2f}, "
                      f"/ preadv {rates[cache, 'connector'] / rates[cache, 'preadv']:.2f}, "
                      f"/ connector-1 {rates[cache, 'connector'] / rates[cache, 'connector-1']:.2f}"
                      + (f"; kvikio-files / connector {rates[cache, 'kvikio-files'] / rates[cache, 'connector']:.2f}"
                         if (cache, "kvikio-files") in rates else ""))
    finally:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
