"""Benchmark: warm TTFT of kvscope's connector against a peer cache and against a cold baseline, side by side.

Needs baseline, the peer (default apc; offload-cpu, vLLM's own CPU offloading, on a GPU) and CONFIG (default
kvscope-fs) deployed (make deploy). N distinct prompts of each length in --tokens (one length, ~2.3k
tokens, by default; a sweep such as 2048,8192,16384,32768 needs a --max-model-len and a KV cache that hold
it), one request at a time: each prompt cold on baseline, then primed on the peer and CONFIG and sent to
both again REPEATS times, alternating, so a noisy moment of a shared machine falls on both sides; then, after
pushing CONFIG's RAM tier past capacity with other prompts, every prompt again ("after eviction": from
the filesystem tier where CONFIG has one). The tier hits of each phase are read from CONFIG's /metrics.
Priming right before the warm requests keeps the prompt in every cache whatever the capacity. Each
measured request waits PAUSE seconds first, so OpenMP threads still spinning in another server after its
last request do not slow this one (on 2 cores they would). Prints medians, the interquartile spread and
the ratios per length (on the CPU: <= 1.15 of apc and <= 0.35 of cold for kvscope-fs from RAM; on a GPU:
kvscope-ram <= 1.2 of offload-cpu at >= 8k tokens and <= 0.3 of cold at 16k).

    .venv/bin/python loadtests/benchmarks/connector_ttft.py [--config kvscope-fs] [--peer apc] [--tokens 2300]
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np

from kvscope import auth
from kvscope.artifacts import Deployment, Manifest, Request, read_json
from kvscope.run.metrics import delta, scrape
from kvscope.run.records import new_record, parse_stream, request_body

CHARS_PER_TOKEN = 3.9  # pydoc's English prose in the tiny model's (Qwen3's) tokenizer: 9000 chars ~ 2.3k tokens


def ttft(server: Manifest, prompt: str) -> tuple[float, int]:
    req = Request(request_id="bench", scenario="bench", phase="measure", session_id="bench", turn=0,
                  endpoint="completions", max_tokens=4, prompt=prompt)
    path, body = request_body(req, [], server.served_model_name)
    http = urllib.request.Request(f"http://{server.host}:{server.port}{path}", data=json.dumps(body).encode(),
                                  headers=auth.headers())
    rec = new_record(req, "bench", time.time())
    t0 = time.perf_counter()
    with urllib.request.urlopen(http, timeout=300) as resp:
        parse_stream(((time.perf_counter(), line) for line in resp), t0, rec, server.block_size)
    if not rec.ok:
        raise RuntimeError(f"{server.config}: {rec.error}")
    return rec.ttft_s, rec.cached_tokens or 0


def evict_ram(server: Manifest, prompts: list[str]) -> None:
    """Push a RAM tier of up to ~16 prompts' KV past capacity with other prompts, so hits come from disk."""
    for i in range(4):
        for p in prompts:
            ttft(server, f"[evict {i}] {p}")


def tier_hits(server: Manifest, before: dict[str, float]) -> str:
    d = delta(before, scrape(f"http://{server.host}:{server.port}"))
    return ", ".join(f"{t} {int(d.get(f'kvscope:connector_{t}_hits_total', 0))}" for t in ("ram", "fs"))


def spread(xs) -> str:
    q1, q2, q3 = np.percentile(xs, [25, 50, 75])
    return f"median {q2 * 1000:7.1f} ms  (IQR {q1 * 1000:.1f}-{q3 * 1000:.1f})"


def measure(args, base: Manifest, peer: Manifest, fs: Manifest, tokens: int) -> None:
    """One prompt length: cold on baseline, warm on the peer and on CONFIG, then CONFIG after eviction."""
    ram_phase, disk_phase = f"warm {args.config}", f"warm {args.config} (after eviction)"
    text = " ".join(topics[k] for k in sorted(topics))
    chars = int(tokens * CHARS_PER_TOKEN)
    text = text * (1 + chars * args.prompts // len(text))  # long prompts share text; their first block differs
    prompts = [f"[benchmark prompt {i}, {tokens} tokens] " + text[i * chars:(i + 1) * chars]
               for i in range(args.prompts)]

    def measured(server: Manifest, p: str) -> tuple[float, int]:
        time.sleep(args.pause)
        return ttft(server, p)

    phases: dict[str, list[tuple[float, int]]] = {name: [] for name in ("cold baseline", f"warm {peer.config}",
                                                                      ram_phase)}
    hits = {}
    before = scrape(f"http://{fs.host}:{fs.port}")
    for p in prompts:
        phases["cold baseline"].append(measured(base, p))
        ttft(peer, p)
        ttft(fs, p)
        for _ in range(args.repeats):
            phases[f"warm {peer.config}"].append(measured(peer, p))
            phases[ram_phase].append(measured(fs, p))
    hits[ram_phase] = tier_hits(fs, before)  # primes included
    if not args.no_eviction:
        evict_ram(fs, prompts[:4])
        before = scrape(f"http://{fs.host}:{fs.port}")
        phases[disk_phase] = [measured(fs, p) for p in prompts]
        hits[disk_phase] = tier_hits(fs, before)
    rows = {name: [t for t, _ in got] for name, got in phases.items()}
    print(f"\n== ~{tokens} tokens: {len(prompts)} prompts, {args.repeats} warm requests each")
    for name, got in phases.items():
        print(f"{name:<36} median cached tokens {int(np.median([c for _, c in got]))}"
              + (f"; connector hits by tier: {hits[name]}" if name in hits else ""))
    for name, xs in rows.items():
        print(f"{name:<36} {spread(xs)}")
    med = {k: float(np.median(v)) for k, v in rows.items()}
    for name in (n for n in (ram_phase, disk_phase) if n in med):
        print(f"{name + ' / warm ' + peer.config:<52} = {med[name] / med[f'warm {peer.config}']:.2f}")
        print(f"{name + ' / cold baseline':<52} = {med[name] / med['cold baseline']:.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deployment", default="runs/local/deployment.json")
    ap.add_argument("--config", default="kvscope-fs", help="the kvscope connector config to measure")
    ap.add_argument("--peer", default="apc", help="the cache it is set against (apc; offload-cpu on a GPU)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", default="2300", help="prompt lengths in tokens, comma-separated (a sweep)")
    ap.add_argument("--repeats", type=int, default=3, help="warm requests per prompt and server")
    ap.add_argument("--pause", type=float, default=1.5, help="seconds of quiet before each measured request")
    ap.add_argument("--no-eviction", action="store_true", help="skip the after-eviction phase")
    args = ap.parse_args()
    deployed = {s.config: s for s in read_json(Path(args.deployment), Deployment).servers}
    base, peer, fs = deployed["baseline"], deployed[args.peer], deployed[args.config]
    for server in (base, peer, fs):
        ttft(server, "warm-up " * 50)
    for tokens in (int(t) for t in args.tokens.split(",")):
        measure(args, base, peer, fs, tokens)


if __name__ == "__main__":
    main()
