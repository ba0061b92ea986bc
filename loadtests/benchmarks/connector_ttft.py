"""Benchmark: warm TTFT of kvscope's connector configs against peer caches and a cold baseline, side by side
and per prompt length, and the TTFT of a miss under load against baseline's.

Needs baseline, the peers and the configs deployed (make deploy; on a GPU host
loadtests/benchmarks/gpu/connector-bench.sh). For each length in --tokens (in the served model's tokens, cut
with its tokenizer), N distinct prompts, one request at a time: each prompt is primed on every config and
peer, then sent REPEATS times to baseline (cold) and to each of them (warm), in turn, so a noisy moment falls
on all of them. Priming right
before the warm requests keeps the prompt in every cache whatever its capacity. With --eviction, CONFIG's
RAM tier is then pushed past capacity with other prompts and every prompt sent again ("after eviction":
hits from its filesystem tier). The connector's tier hits of each phase come from its /metrics, and with
them where the forward thread's time in the connector went (load: waiting for reads, for the GPU; save). Each
measured request waits PAUSE seconds first (on a 2-core CPU, OpenMP threads still spinning in another
server would slow it). Then, with --load-users U, U closed-loop streams of distinct fresh prompts (every one
a miss, every one saved) against baseline, each config and each peer in turn: what the connector's saves
cost a miss, next to what the peer's cost.

Prints medians with the interquartile range and n, the ratios, and the goals against what was measured: on
a GPU kvscope-ram <= 1.2x offload-cpu-tier at every length >= 8k and, at 16k, no more of cold than
offload-cpu-tier's own ratio; kvscope-fs (and kvscope-fs-kvikio) <= 1.3x offload-cpu-tier at >= 8k and <= 0.5x
cold at >= 16k; on the CPU kvscope-ram <= 1.15x apc, kvscope-ram and kvscope-fs (files only) <= 0.35x cold;
everywhere a miss under load <= 1.05x baseline's and no worse, against baseline's, than each peer's miss under
load (not judged, and said so, where a peer was not loaded).

    .venv/bin/python loadtests/benchmarks/connector_ttft.py [--configs kvscope-ram,kvscope-fs] [--peers apc]
"""

from __future__ import annotations

import argparse
import json
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np

from kvscope import auth
from kvscope.artifacts import Deployment, Manifest, Request, read_json
from kvscope.deploy.folder import LOCAL, DeploymentFolder
from kvscope.run.metrics import delta, scrape
from kvscope.run.records import new_record, parse_stream, request_body

CHARS_PER_TOKEN = 3.9  # pydoc's prose in the tiny model's tokenizer, where the model's tokenizer is not at hand
COLD = "cold baseline"
# (config, against, shortest length, longest length, the most the ratio may be: a number, or a peer whose own
# ratio against the same server at that length is the most): the goals of docs/benchmarks.md (issue 33)
GOALS: dict[str, list[tuple[str, str, int, int | None, float | str]]] = {
    "cuda": [("kvscope-ram", "offload-cpu-tier", 8000, None, 1.2),
             ("kvscope-ram", COLD, 16000, 17000, "offload-cpu-tier"),
             ("kvscope-fs", "offload-cpu-tier", 8000, None, 1.3), ("kvscope-fs", COLD, 16000, None, 0.5),
             ("kvscope-fs-kvikio", "offload-cpu-tier", 8000, None, 1.3), ("kvscope-fs-kvikio", COLD, 16000, None, 0.5)],
    "cpu": [("kvscope-ram", "apc", 0, None, 1.15), ("kvscope-ram", COLD, 0, None, 0.35),
            ("kvscope-fs", COLD, 0, None, 0.35)]}
MISS_GOAL = 1.05  # a miss under load against baseline's, every config; and at most each peer's own ratio


def ttft(server: Manifest, prompt: str) -> tuple[float, int]:
    req = Request(request_id="bench", scenario="bench", phase="measure", session_id="bench", turn=0,
                  endpoint="completions", max_tokens=4, prompt=prompt)
    path, body = request_body(req, [], server.served_model_name)
    http = urllib.request.Request(f"http://{server.host}:{server.port}{path}", data=json.dumps(body).encode(),
                                  headers=auth.headers())
    rec = new_record(req, "bench", time.time())
    t0 = time.perf_counter()
    with urllib.request.urlopen(http, timeout=600) as resp:
        parse_stream(((time.perf_counter(), line) for line in resp), t0, rec, server.block_size)
    if not rec.ok:
        raise RuntimeError(f"{server.config}: {rec.error}")
    return rec.ttft_s, rec.cached_tokens or 0


class Prompts:
    """Distinct prompts of an exact length in the served model's tokens (pydoc's prose, a unique first line)."""

    def __init__(self, model_path: str):
        self.text = " ".join(topics[k] for k in sorted(topics))
        tokenizer = Path(model_path) / "tokenizer.json"
        self.tok = None
        if tokenizer.is_file():
            from tokenizers import Tokenizer

            self.tok = Tokenizer.from_file(str(tokenizer))
            self.ids = self.tok.encode(self.text).ids
        self.used = 0

    def make(self, head: str, tokens: int) -> str:
        if self.tok is None:
            chars = int(tokens * CHARS_PER_TOKEN)
            start = self.used % max(1, len(self.text) - chars)
            self.used += chars
            return head + (self.text * (2 + chars // len(self.text)))[start:start + chars]
        need = tokens - len(self.tok.encode(head).ids)
        ids = (self.ids * (2 + need // len(self.ids)))
        start = self.used % len(self.ids)
        self.used += need
        return head + self.tok.decode(ids[start:start + need])


def tier_hits(server: Manifest, before: dict[str, float], loads: int, saves: int) -> str:
    return connector_line(delta(before, scrape(f"http://{server.host}:{server.port}")), loads, saves)


def connector_line(d: dict[str, float], loads: int, saves: int) -> str:
    """From a phase's counter deltas: blocks each tier served, file saves skipped while the save thread was
    behind (later misses), the seconds the forward waited for it (its backlog full) and the slot pool grew
    past its reserve (beside a GPU, on the forward thread), and the forward thread's time in the connector in
    ms a request: in load() over the `loads` requests that loaded (of it waiting for the load threads and for
    the GPU), in save() over the `saves` that stored."""
    def count(name: str) -> float:
        return d.get(f"kvscope:connector_{name}_total", 0.0)

    def ms(name: str, n: int) -> str:
        return f"{count(name) / max(n, 1) * 1000:.1f}"
    return ", ".join(f"{t} {int(count(f'{t}_hits'))}" for t in ("ram", "fs")) + \
        f"; saves skipped {int(count('saves_skipped'))}, forward waited {count('save_wait_seconds'):.2f} s for " \
        f"saves, the pool grew {count('pool_grow_seconds'):.2f} s; " \
        f"ms a request: load {ms('load_seconds', loads)} (n={loads}; waiting for reads " \
        f"{ms('load_read_wait_seconds', loads)}, for the GPU {ms('load_device_wait_seconds', loads)}), " \
        f"save {ms('save_forward_seconds', saves)} (n={saves})"


def spread(xs) -> str:
    q1, q2, q3 = np.percentile(xs, [25, 50, 75])
    return f"median {q2 * 1000:8.1f} ms  (IQR {q1 * 1000:.1f}-{q3 * 1000:.1f}, n={len(xs)})"


def measure(args, base: Manifest, peers: list[Manifest], configs: list[Manifest], prompts: Prompts,
            tokens: int) -> tuple[dict[str, float], dict[str, int]]:
    """One prompt length: cold on baseline, warm on every peer and config (and after eviction). Returns the
    median TTFT and the median cached tokens of each phase."""
    texts = [prompts.make(f"[benchmark prompt {i}, {tokens} tokens] ", tokens) for i in range(args.prompts)]
    servers = configs + peers

    def measured(server: Manifest, p: str) -> tuple[float, int]:
        time.sleep(args.pause)
        return ttft(server, p)

    phases: dict[str, list[tuple[float, int]]] = {COLD: [], **{s.config: [] for s in peers + configs}}
    before = {s.config: scrape(f"http://{s.host}:{s.port}") for s in configs}
    for p in texts:
        for s in servers:
            ttft(s, p)  # prime
        for _ in range(args.repeats):
            phases[COLD].append(measured(base, p))
            for s in servers:
                phases[s.config].append(measured(s, p))
    # primes included: misses, the phase's saves (they load nothing)
    hits = {s.config: tier_hits(s, before[s.config], len(texts) * args.repeats, len(texts)) for s in configs}
    if args.eviction:
        for s in configs:
            for i in range(4):
                for p in texts[:4]:
                    ttft(s, f"[evict {i}] {p}")
            before = {s.config: scrape(f"http://{s.host}:{s.port}")}
            phases[f"{s.config} (after eviction)"] = [measured(s, p) for p in texts]
            hits[f"{s.config} (after eviction)"] = tier_hits(s, before[s.config], len(texts), len(texts))
    print(f"\n== {tokens} tokens: {len(texts)} prompts, {args.repeats} requests each per server")
    for name, got in phases.items():
        print(f"{name:<36} {spread([t for t, _ in got])}  cached tokens {int(np.median([c for _, c in got]))}"
              + (f"; connector hits by tier: {hits[name]}" if name in hits else ""))
    med = {name: float(np.median([t for t, _ in got])) for name, got in phases.items()}
    for name in (n for n in med if n.split(" (")[0] in {c.config for c in configs}):
        for other in [p.config for p in peers] + [COLD]:
            print(f"{name + ' / ' + other:<56} = {med[name] / med[other]:.2f}")
    return med, {name: int(np.median([c for _, c in got])) for name, got in phases.items()}


def goal_lines(goals, medians: dict[int, dict[str, float]], cached: dict[int, dict[str, int]]) -> list[str]:
    """Each hit goal against the medians of each length; a config whose hit held under 90 % of the prompt
    (a partial hit: the rest recomputed) is said so beside its ratio."""
    lines = []
    for config, other, shortest, longest, most in goals:
        for tokens, med in medians.items():
            if config in med and other in med and tokens >= shortest and (longest is None or tokens <= longest):
                ratio, held = med[config] / med[other], cached[tokens][config]
                partial = f"; a partial hit: {held} of {tokens} tokens cached" if held < 0.9 * tokens else ""
                head = f"{config} / {other} at {tokens} tokens: {ratio:.2f}"
                if not isinstance(most, str):
                    limit, said = most, f"{most}"
                elif most in med:  # a peer: its own ratio against the same server is the most
                    limit = med[most] / med[other]
                    said = f"{most}'s {limit:.2f}"
                else:
                    lines.append(f"{head} (goal <= {most}'s ratio: not judged, {most} not measured{partial})")
                    continue
                lines.append(f"{head} (goal <= {said}: {'met' if ratio <= limit else 'NOT met'}{partial})")
    return lines


def under_load(args, server: Manifest, prompts: Prompts, tag: str) -> list[tuple[float, int]]:
    """TTFTs and cached tokens of --load-users closed-loop streams of fresh prompts (all misses),
    --load-requests each."""
    texts = [[prompts.make(f"[load {tag} {server.config} user {u} request {k}] ", args.load_tokens)
              for k in range(args.load_requests)] for u in range(args.load_users)]
    time.sleep(args.pause)
    with ThreadPoolExecutor(args.load_users) as pool:
        return [got for stream in pool.map(lambda ps: [ttft(server, p) for p in ps], texts) for got in stream]


def miss_verdicts(miss: dict[str, float], base: str, peers: list[str]) -> list[str]:
    """The miss-under-load goals, from each server's median miss TTFT (baseline's, the peers' and the configs'
    that were loaded): every config's ratio to baseline's <= MISS_GOAL and <= each peer's own ratio."""
    if base not in miss:
        return []
    ratio = {name: t / miss[base] for name, t in miss.items() if name != base}
    lines = [f"{peer} miss under load / baseline's: {ratio[peer]:.2f} (a peer: no goal)" for peer in peers
             if peer in ratio]
    for name in (n for n in ratio if n not in peers):
        lines.append(f"{name} miss under load / baseline's: {ratio[name]:.2f} (goal <= {MISS_GOAL}: "
                     f"{'met' if ratio[name] <= MISS_GOAL else 'NOT met'})")
        for peer in peers or ["a peer"]:
            got = (f"{'met' if ratio[name] <= ratio[peer] else 'NOT met'} against {ratio[peer]:.2f}"
                   if peer in ratio else "peer not measured")
            lines.append(f"{name} miss under load / baseline's <= {peer}'s: {got}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deployment", default=str(DeploymentFolder(LOCAL).deployment))
    ap.add_argument("--configs", default="kvscope-ram,kvscope-fs",
                    help="kvscope connector configs to measure, comma-separated")
    ap.add_argument("--peers", default="apc", help="caches to set them against (on a GPU: offload-cpu-tier,apc)")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", default="2300", help="prompt lengths in tokens, comma-separated (a sweep)")
    ap.add_argument("--repeats", type=int, default=3, help="requests per prompt and server")
    ap.add_argument("--pause", type=float, default=1.5, help="seconds of quiet before each measured request")
    ap.add_argument("--eviction", action="store_true", help="also measure each config after evicting its RAM tier "
                    "(a config with a RAM tier in front of files, e.g. kvscope-shared; kvscope-fs has none)")
    ap.add_argument("--load-users", type=int, default=0, help="concurrent streams of misses (0: no load phase)")
    ap.add_argument("--load-requests", type=int, default=4, help="misses per stream")
    ap.add_argument("--load-tokens", type=int, default=8192)
    ap.add_argument("--load-rounds", type=int, default=2)
    ap.add_argument("--load-configs", default=None, help="configs measured under load (default: --configs)")
    ap.add_argument("--load-peers", default=None, help="peers measured under load (default: --peers)")
    args = ap.parse_args()
    deployed = {s.config: s for s in read_json(Path(args.deployment), Deployment).servers}
    base = deployed["baseline"]
    peers = [deployed[name] for name in args.peers.split(",") if name]
    configs = [deployed[name] for name in args.configs.split(",")]
    prompts = Prompts(base.model_path)
    for server in [base, *peers, *configs]:
        ttft(server, "warm-up " * 50)
    lengths = [int(t) for t in args.tokens.split(",")]
    medians, cached = {}, {}
    for tokens in lengths:
        medians[tokens], cached[tokens] = measure(args, base, peers, configs, prompts, tokens)
    misses: dict[str, list[tuple[float, int]]] = {}
    load_peers = [name for name in (args.peers if args.load_peers is None else args.load_peers).split(",") if name]
    if args.load_users:
        print(f"\n== misses under load: {args.load_users} streams x {args.load_requests} fresh prompts of "
              f"{args.load_tokens} tokens, {args.load_rounds} rounds, servers in turn (each round starting one later)")
        names = (args.load_configs or args.configs).split(",")
        loaded = [base] + [deployed[name] for name in names + load_peers]
        before = {name: scrape(f"http://{deployed[name].host}:{deployed[name].port}") for name in names}
        for r in range(args.load_rounds):
            for server in loaded[r % len(loaded):] + loaded[:r % len(loaded)]:
                misses.setdefault(server.config, []).extend(under_load(args, server, prompts, f"round {r}"))
        for name, got in misses.items():
            n = len(got)
            hits = f"; connector: {tier_hits(deployed[name], before[name], n, n)}" if name in before else ""
            print(f"{name:<36} {spread([t for t, _ in got])}  cached tokens {int(np.median([c for _, c in got]))}"
                  f"{hits}")
    print("\n== goals (measured in this run)")
    for line in goal_lines(GOALS.get(base.platform, []), medians, cached):
        print(line)
    miss = {name: float(np.median([t for t, _ in got])) for name, got in misses.items()}
    for line in miss_verdicts(miss, base.config, load_peers):
        print(line)


if __name__ == "__main__":
    main()
