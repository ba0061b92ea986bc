"""Benchmark: where a hit's and a save's time goes on this machine's device, step by step.

A KV cache shaped like the Qwen3-4B shape (36 layers x [blocks, 2, 32 tokens, 8 KV heads, 128] bf16, 4.7 MB
per block) on the GPU (or the CPU), and one prompt's blocks (72: ~2.3k tokens; --blocks 512: ~16k). Each
time is the median of ROUNDS, after one round of warm-up:
- the limit: one pinned host-to-device copy of the same bytes;
- each checksum alone: mix128 where the KV cache is (beside a GPU its fused kernel, fusedmix.py) and in
  torch ops, XXH3-128 on one host thread;
- a RAM hit and a file hit (from the page cache, files of the connector's 256 tokens beside a GPU) through
  WorkerSide.load, into the KV cache: checked on the GPU (the connector's way beside a GPU), and the RAM hit
  also checked on the host (XXH3-128 on the four load threads, its way before);
- a save: the forward thread's part (WorkerSide.save returning; the copies run on), split into the gather
  alone and copy_out (the gather, the checksum's launch and the copies' issue; the rest is the save
  thread's hand-off), each as host time; also while the RAM tier fills (new keys each round: slots of the
  pool no block has held yet), of every other block id (each id its own run, as a busy server's blocks may lie:
  beyond MAX_RUNS, two ops per layer per chunk; the bytes stored are checked), and beside a GPU with 50 ms
  of work queued on the forward's stream first (whether save() itself waits for the GPU; the save thread
  idle and no earlier copy queued, unlike a server's), and back to back with new keys, the RAM tier full
  and evicting, more rounds than the save backlog holds (beside a GPU 50 ms behind each time, as a
  server's under load: the earlier saves' copies still queued; of it the waits for the save thread and the
  pool's growing past its reserve); and the whole save (the blocks stored in RAM).
Prints ms and GB/s per step, each load's throughput against the copy's (goal >= 0.8, issue 33) and where each
load's time went by the connector's counters (the forward thread waiting for the load threads, for the GPU,
and the rest), and checks that every load wrote the saved blocks' bytes. With --profile, the file hit's
forward thread under cProfile (the functions it spent most time in, a mean per step), the RAM hit's and the
save's: what "the rest" is.

    python loadtests/benchmarks/copy_paths.py [--blocks 72] [--layers 36] [--device cuda] [--load-threads N]
        [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kvscope_connector.blocks import checksum, fused_on, mix_digests
from kvscope_connector.connector import FILE_TOKENS
from kvscope_connector.messages import KVScopeMetadata, LoadSpec, StoreSpec
from kvscope_connector.scheduler import Filed, placed
from kvscope_connector.store import FsTier, RamTier, Stats
from kvscope_connector.worker import WorkerSide

FP = "f" * 32
BLOCK = 32  # tokens
BUSY_MS = 50  # the GPU's queue when a save is timed behind it
CALIBRATE_CYCLES = 50_000_000  # GPU clock cycles spun once to learn the rate
MAX_BACK_TO_BACK = 64  # saves at most (small blocks: a backlog's worth would be hundreds)


def timed(fn, rounds: int, sync) -> float:
    fn()
    out = []
    for _ in range(rounds):
        sync()
        t = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t)
    return float(np.median(out))


def host_time(fn, rounds: int, sync, after=lambda _: None) -> float:
    """The median time fn holds this thread, the device idle before each round (after(result) tidies up)."""
    after(fn())
    out = []
    for _ in range(rounds):
        sync()
        t = time.perf_counter()
        result = fn()
        out.append(time.perf_counter() - t)
        sync()
        after(result)
    return float(np.median(out))


def worker(args, dev, on_device: bool, fs_root: str | None = None) -> WorkerSide:
    """A worker on its own Qwen3-4B-shaped KV cache of 3 x blocks, the first third random, and one tier (files
    read on --load-threads; a RAM tier that holds every block the steps save, its slots pinned at register)."""
    n = args.blocks
    gen = torch.Generator(device=dev).manual_seed(0)
    caches = {f"model.layers.{i}.self_attn.attn":
              torch.randn(3 * n, 2, 32, 8, 128, device=dev, generator=gen).to(torch.bfloat16)
              for i in range(args.layers)}
    # no eviction before the back-to-back saves: k, s and o keys n each, the fill's (rounds + 1) x n (no slack)
    held = (args.rounds + 4) * n * args.layers * caches[next(iter(caches))][0].nbytes
    ram, fs = ((None, FsTier(fs_root, FP, None, per_file=max(1, FILE_TOKENS["cuda"] // BLOCK))) if fs_root
               else (RamTier(held), None))
    w = WorkerSide(FP, BLOCK, ram, fs, checksum="mix128" if on_device else "xxh3-128", on_device=on_device,
                   load_threads=args.load_threads)
    w.register(caches)
    w.save(KVScopeMetadata(stores=[StoreSpec(i, f"k{i}", fs is None, fs is not None, file=f.file)
                                   for i, f in enumerate(files(w, n))]))
    w.flush()
    return w


def files(w: WorkerSide, n: int) -> list[Filed]:
    """Where the prompt's blocks lie in the worker's filesystem tier (none without one)."""
    return placed([f"k{i}" for i in range(n)], w.fs.per_file) if w.fs else [Filed("", 0, 1)] * n


def loads(w: WorkerSide, n: int, tier: str) -> KVScopeMetadata:
    return KVScopeMetadata(loads=[LoadSpec(n + i, f"k{i}", tier, request_id="r", index=i, file=f.file,
                                           offset=f.offset, count=f.count) for i, f in enumerate(files(w, n))])


def check_saved(w: WorkerSide, meta: KVScopeMetadata, what: str) -> None:
    """The RAM tier holds each stored key's block as the KV cache's layers have it (Layout.pack, not the
    connector's gather)."""
    assert w.ram is not None
    for spec in meta.stores:
        found = w.ram.get(spec.key, verify=False)
        assert found is not None, f"{what}: block {spec.block_id} not in the RAM tier"
        cached = w.layout.pack({name: t[spec.block_id] for name, t in w.layers.items()})
        assert torch.equal(found[0], cached.cpu()), f"{what}: block {spec.block_id} stored other bytes"


def check(w: WorkerSide, n: int, what: str) -> None:
    assert not w.take_load_errors(), f"{what}: load errors"
    assert all(torch.equal(t[n:2 * n], t[:n]) for t in w.layers.values()), f"{what} wrote other bytes than saved"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=72)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--load-threads", type=int, default=None, help="the connector's file reads in flight "
                    "(default: its own, LOAD_THREADS)")
    ap.add_argument("--profile", action="store_true",
                    help="also profile the file hit, the RAM hit and the save by function")
    args = ap.parse_args()
    dev = torch.device(args.device)
    gpu = dev.type == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    n = args.blocks
    on_gpu = worker(args, dev, on_device=True)
    on_host = worker(args, dev, on_device=False)
    tmp = tempfile.TemporaryDirectory(prefix="kvscope-copy-paths-")
    from_file = worker(args, dev, on_device=True, fs_root=tmp.name)
    total = on_gpu.block_bytes() * n
    packed = on_gpu.device_copies.gather(list(range(n)))
    host = torch.empty(total, dtype=torch.uint8, pin_memory=gpu)
    device_copy = torch.empty(total, dtype=torch.uint8, device=dev)
    one_block = on_host.extract([0])[0]
    stores = KVScopeMetadata(stores=[StoreSpec(i, f"s{i}", True, False) for i in range(n)])

    limit = "limit: one host-to-device copy of the same bytes" + (" (pinned)" if gpu else "")
    mix = "checksum: mix128 on the device" + (" (fused kernel)" if fused_on(dev, on_gpu.block_bytes()) else "")
    mix_ops = "checksum: mix128 in torch ops"
    hits = {"load: RAM hit, checked on the GPU (mix128)": (on_gpu, "ram"),
            "load: file hit (page cache), checked on the GPU": (from_file, "fs"),
            "load: RAM hit, checked on the host (XXH3, 4 threads)": (on_host, "ram")}
    steps = {
        limit: lambda: device_copy.copy_(host, non_blocking=True),
        mix: lambda: mix_digests(packed).cpu(),
        mix_ops: lambda: mix_digests(packed, fused=False).cpu(),
        "checksum: XXH3-128 on one host thread": lambda: [checksum(one_block) for _ in range(n)],
        **{name: (lambda w=w, tier=tier: w.load(loads(w, n, tier))) for name, (w, tier) in hits.items()},
        "save: until stored in RAM": lambda: on_gpu.save(stores) or on_gpu.flush(),
    }
    print(f"{n} blocks x {on_gpu.block_bytes() / 1e6:.1f} MB = {total / 1e6:.0f} MB on {dev}"
          + (f" ({torch.cuda.get_device_name(dev)})" if gpu else "") + f"; median of {args.rounds} rounds")
    took, split = {}, {}
    for name, fn in steps.items():
        w = hits[name][0] if name in hits else None
        if w is not None:
            w.take_stats()
        took[name] = timed(fn, args.rounds, sync)
        if w is not None:
            split[name] = load_split(w.take_stats(), args.rounds + 1)
    took["save: the forward thread's part"] = forward_part(on_gpu, lambda _: stores, args.rounds)
    took["save: the forward thread's part, the RAM tier filling"] = forward_part(
        on_gpu, lambda r: KVScopeMetadata(stores=[StoreSpec(i, f"fill{r}-{i}", True, False) for i in range(n)]),
        args.rounds)
    scattered = KVScopeMetadata(stores=[StoreSpec(2 * i, f"o{i}", True, False) for i in range(n)])
    took["save: the forward thread's part, every other block id"] = forward_part(
        on_gpu, lambda _: scattered, args.rounds)
    check_saved(on_gpu, scattered, "every other block id")
    if gpu:
        took[f"save: the forward thread's part, the GPU {BUSY_MS} ms behind"] = forward_part(
            on_gpu, lambda _: stores, args.rounds, gpu_busy(BUSY_MS))
    paths, ids = on_gpu.device_copies, list(range(n))
    took["save, forward thread: the gather alone"] = host_time(lambda: paths.gather(ids), args.rounds, sync)
    took["save, forward thread: copy_out (gather, checksum, copies)"] = host_time(
        lambda: paths.copy_out(ids), args.rounds, sync, lambda saved: [paths.pool.give_back(b) for b in saved.blocks])
    for name, seconds in took.items():
        print(row(name, seconds, total))
    for name, (w, _) in hits.items():
        check(w, n, name)
    print()
    for name in hits:
        print(f"{name + ': throughput / the copy':<72} = {took[limit] / took[name]:.2f}  (goal >= 0.8)")
    print(f"{'checksum: mix128 in torch ops / on the device':<72} = {took[mix_ops] / took[mix]:.2f}")
    print()
    for name, line in split.items():
        print(f"{name}: {line}")
    if args.profile:
        for name, fn in {"file hit": lambda: from_file.load(loads(from_file, n, "fs")),
                         "RAM hit": lambda: on_gpu.load(loads(on_gpu, n, "ram")),
                         "save": lambda: on_gpu.save(stores)}.items():
            print()
            print(profiled(name, fn, args.rounds, sync, on_gpu.flush))
    print()
    print(back_to_back(on_gpu, n, args.rounds, gpu, total))
    tmp.cleanup()


def back_to_back(w: WorkerSide, n: int, rounds: int, gpu: bool, total: int) -> str:
    """The save's forward-thread part back to back with new keys, the RAM tier full and evicting (last: it
    evicts what the steps before saved), beside a GPU BUSY_MS behind each time; rounds more than the save
    backlog holds, so it fills (at most MAX_BACK_TO_BACK); of it (means after the warm-up) the waits for the
    save thread and the pool's growing past its reserve, and the blocks evicted."""
    name = "save: the forward thread's part, back to back, evicting"
    saves = min(rounds + w.backlog // (n * w.block_bytes()) + 2, MAX_BACK_TO_BACK)
    seconds = forward_part(w, lambda r: KVScopeMetadata(stores=[StoreSpec(i, f"b{r}-{i}", True, False)
                                                                for i in range(n)]),
                           saves, gpu_busy(BUSY_MS) if gpu else lambda: None, settle=False, warmed=w.take_stats)
    stats = w.take_stats()
    return (f"{row(name, seconds, total)}\n"
            f"{name}{f', the GPU {BUSY_MS} ms behind each' if gpu else ''}: of it waiting for the save thread "
            f"{stats.save_wait_seconds / saves * 1e3:.1f} ms, the pool growing "
            f"{stats.pool_grow_seconds / saves * 1e3:.1f} ms (means of {saves} saves); evictions {stats.evictions}")


def row(name: str, seconds: float, total: int) -> str:
    """A step's line: its time and the GB/s of the prompt's bytes."""
    return f"{name:<56} {seconds * 1e3:8.1f} ms  {total / seconds / 1e9:6.1f} GB/s"


def profiled(name: str, step, rounds: int, sync, settle, top: int = 25) -> str:
    """The calling (forward) thread's time in a step by function, under cProfile, a mean per step, most own
    time first (waits for the load threads show as a lock's acquire; cProfile adds its own cost; from
    Python 3.12 on, cProfile sees every thread: the load threads' functions are listed too); the device and
    the save thread idle (settle) before each step, as in the timings above."""
    profile = cProfile.Profile()
    for _ in range(rounds):
        sync()
        settle()
        profile.enable()
        step()
        profile.disable()
    rows = sorted(pstats.Stats(profile).stats.items(), key=lambda item: -item[1][2])[:top]
    lines = [f"{name}, the forward thread by function (cProfile, ms per step, mean of {rounds}):",
             f"{'own':>8} {'with callees':>12} {'calls':>7}  function"]
    for (path, line, name), (_, calls, own, cumulative, _) in rows:
        where = f"{Path(path).name}:{line} {name}" if line else name
        lines.append(f"{own / rounds * 1e3:8.2f} {cumulative / rounds * 1e3:12.2f} {calls / rounds:7.0f}  {where}")
    return "\n".join(lines)


def gpu_busy(ms: float) -> Callable[[], None]:
    """Queues ms of work on the current stream: the GPU behind the host, as a server's is when vLLM calls
    save() after launching a step's forward (a save that waits for the GPU then holds the thread as long)."""
    torch.cuda._sleep(1000)  # the kernel loaded before it is timed
    torch.cuda.synchronize()
    t = time.perf_counter()
    torch.cuda._sleep(CALIBRATE_CYCLES)
    torch.cuda.synchronize()
    cycles = int(CALIBRATE_CYCLES * ms / ((time.perf_counter() - t) * 1e3))
    return lambda: torch.cuda._sleep(cycles)


def load_split(stats: Stats, loads: int) -> str:
    """The connector's counters of a step's loads (warm-up included), a mean per load: the forward thread's
    time in load(), waiting for the load threads, waiting for the GPU, and the rest (its own work and any
    contention with the load threads)."""
    reads, device = stats.load_read_wait_seconds / loads, stats.load_device_wait_seconds / loads
    total = stats.load_seconds / loads
    return (f"load {total * 1e3:.1f} ms: waiting for the load threads {reads * 1e3:.1f}, for the GPU "
            f"{device * 1e3:.1f}, the rest {(total - reads - device) * 1e3:.1f} (mean of {loads})")


def forward_part(w: WorkerSide, stores: Callable[[int], KVScopeMetadata], rounds: int,
                 before: Callable[[], None] = lambda: None, settle: bool = True,
                 warmed: Callable[[], object] = lambda: None) -> float:
    """How long save() holds the forward thread (the copies to the host and the save thread run on), saving
    stores(round): the same keys each round (the RAM tier has them: their new slots go back), or new ones
    (the tier keeps them in slots no block has held yet); before() runs just before each save, each after
    the save thread is done with the one before (with settle; else back to back); warmed() after the
    warm-up's save."""
    out = []
    for r in range(rounds + 1):
        if settle:
            w.flush()
        before()
        t = time.perf_counter()
        w.save(stores(r))
        out.append(time.perf_counter() - t)
        if r == 0:
            warmed()
    w.flush()
    return float(np.median(out[1:]))


if __name__ == "__main__":
    main()
