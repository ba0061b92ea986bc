"""Benchmark: where a hit's and a save's time goes on this machine's device, step by step.

A KV cache shaped like the Qwen3-4B shape (36 layers x [blocks, 2, 32 tokens, 8 KV heads, 128] bf16, 4.7 MB
per block) on the GPU (or the CPU), and a 2.3k-token prompt's 72 blocks. Times, each the median of ROUNDS:
the save path's copy out of the KV cache (WorkerSide.extract: gather per layer into one packed buffer,
one device-to-host copy), the checksum of every block, the RAM tier's put (a clone); the load path's
RAM-tier get + checksum (WorkerSide.fetch_all: on the load threads beside a GPU), its write into the
KV cache (WorkerSide.inject: one host-to-device copy per block from the pinned RAM tier, index_copy_ per
layer; numpy row copies on the CPU), and both as one hit. Beside them the physical limit: one pinned
host-to-device copy of the same bytes; the ratio of the two is the load-throughput goal (>= 0.7). Prints ms
and GB/s per step: what to make faster next. Checks that the injected blocks equal the extracted ones.

    python loadtests/benchmarks/copy_paths.py [--blocks 72] [--layers 36] [--device cuda]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kvscope_connector.blocks import checksum
from kvscope_connector.messages import LoadSpec
from kvscope_connector.store import RamTier
from kvscope_connector.worker import WorkerSide


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=72)
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    n = args.blocks
    caches = {f"model.layers.{i}.self_attn.attn": torch.randn(3 * n, 2, 32, 8, 128, device=dev).to(torch.bfloat16)
              for i in range(args.layers)}
    worker = WorkerSide("f" * 32, 32, RamTier(1 << 40), None)
    worker.register(caches)
    src, dst = list(range(n)), list(range(n, 2 * n))
    blocks = worker.extract(src)
    digests = [checksum(b) for b in blocks]
    for i, (b, d) in enumerate(zip(blocks, digests)):
        worker.ram.put(f"k{i}", b, d)
    held = [worker.ram.get(f"k{i}")[0] for i in range(n)]
    loads = [LoadSpec(d, f"k{i}", "ram") for i, d in enumerate(dst)]
    total = worker.block_bytes() * n

    pinned_ram = RamTier(1 << 40)
    pinned_ram.pin = worker.ram.pin  # as the connector's own tier: pinned beside a GPU
    host = torch.empty(total, dtype=torch.uint8, pin_memory=dev.type == "cuda")
    device_copy = torch.empty(total, dtype=torch.uint8, device=dev)
    limit = "limit: one host-to-device copy of the same bytes" + (" (pinned)" if dev.type == "cuda" else "")
    whole = "load: a whole RAM hit (fetch_all + inject)"
    steps = {
        "save: extract (gather + device-to-host)": lambda: worker.extract(src),
        "save: checksum (XXH3-128)": lambda: [checksum(b) for b in blocks],
        "save: RAM tier put (copy)": lambda: [pinned_ram.put(f"p{i}", b, d) or pinned_ram.drop(f"p{i}")
                                              for i, (b, d) in enumerate(zip(blocks, digests))],
        "load: RAM get (checksum included), on this thread": lambda: [worker.ram.get(f"k{i}") for i in range(n)],
        "load: the same through fetch_all": lambda: list(worker.fetch_all(loads)),
        "load: inject": lambda: worker.inject(list(zip(dst, held))),
        whole: lambda: worker.inject((spec.block_id, b) for spec, b in worker.fetch_all(loads)),
        limit: lambda: device_copy.copy_(host, non_blocking=True),
    }
    print(f"{n} blocks x {worker.block_bytes() / 1e6:.1f} MB = {total / 1e6:.0f} MB on {dev}"
          + (f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else "")
          + f"; RAM tier {'pinned' if worker.ram.pin else 'pageable'}; median of {args.rounds} rounds")
    took = {}
    for name, fn in steps.items():
        took[name] = timed(fn, args.rounds, sync)
        print(f"{name:<52} {took[name] * 1e3:8.1f} ms  {total / took[name] / 1e9:6.1f} GB/s")
    print(f"\nload throughput / the copy's = {took[limit] / took[whole]:.2f}  (goal >= 0.7)")
    assert all(torch.equal(t[n:2 * n], t[:n]) for t in caches.values()), "inject wrote other bytes than extract read"


if __name__ == "__main__":
    main()
