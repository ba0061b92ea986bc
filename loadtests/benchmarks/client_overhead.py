"""Benchmark the load generator: the client's own share of TTFT, and streamed tokens/s per core.

1. The client's share of TTFT, measured sharply: kvscope's Locust user against sse_server.py, which logs
   when each request's headers arrived and when its first token left (by X-Request-Id). The client's share
   of a request's TTFT is its measured TTFT minus that server time; p50 and p90 at 1, 16 and 64 concurrent
   streams of 16-token answers. `vllm bench serve` at the same concurrency against the same server: its
   TTFT p50 minus the server's p50 over its run (it sends no request id). Goal: < 2 ms at 64 streams.
   Two servers: paced like a GPU server (first token 20 ms after the request, then one every 10 ms, so
   64 streams are 6,400 tokens/s), and back to back (every token at once: a closed loop in which the client
   is the bottleneck, so its share is queueing behind the other streams, ~ streams x its CPU per request).
   The floor of this machine: the same measure for a bare blocking socket that writes the request by hand
   and stops at the first token's bytes (loopback, wake-up and clocks; no HTTP library).
2. Generator capacity: the same user against sse_server.py (first token at once, then as fast as the
   socket takes them) at rising concurrency, one Locust process = one core. Streamed tokens/s and the TTFT
   the client measures; capacity = the highest tokens/s while that p50 stays under 5 ms. Goal: >= 20k
   tokens/s/core. In the same run, `vllm bench serve` against the same server, for comparison.

No vLLM server is needed; the tokenizer of --model-dir sizes vllm bench's prompts. With two cores or
more, the synthetic server runs on the last core and the clients on the others, so the measure is the
client's, not the two processes' contention for one core (which a real deployment does not have).

    .venv/bin/python loadtests/benchmarks/client_overhead.py [--model-dir models/tiny-qwen3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from kvscope.artifacts import Manifest, Request, Treatment
from kvscope.run.records import read, request_key
from kvscope.run.treatments import run_locust
from kvscope.run.workload import write_jsonl

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
SHARE_PORT, CAPACITY_PORT = 8186, 8189
CORES = sorted(os.sched_getaffinity(0))


PACED = ["--first-ms", "20", "--token-ms", "10"]


def locust_round(server: Treatment, reqs: list[Request], users: int, folder: Path, name: str,
                 processes: int = 1) -> list:
    workload, records = folder / f"{name}.workload.jsonl", folder / f"{name}.records.jsonl"
    write_jsonl(reqs, workload)
    run_locust(server, workload, records, users, processes, 0.0, 600)
    return read(records)


def streaming_span(recs) -> float:
    """Seconds from the first request's start to the last stream's end (Locust's start-up excluded)."""
    return max(r.start_unix_s + r.e2e_s for r in recs) - min(r.start_unix_s for r in recs)


def _sse_server(port: int, tokens: int, log: Path | None = None, pace: list[str] | None = None,
                ) -> tuple[subprocess.Popen, Treatment]:
    args = [sys.executable, str(HERE / "sse_server.py"), str(port), str(tokens)] + ([str(log)] if log else [])
    args += pace or []
    proc = subprocess.Popen(args)
    if len(CORES) > 1:
        os.sched_setaffinity(proc.pid, CORES[-1:])
    time.sleep(1.0)
    server = Manifest.model_construct(config="sse-server", role="candidate", host="127.0.0.1", port=port, block_size=64,
                                      served_model_name="tiny")  # a synthetic server
    return proc, Treatment.model_construct(config="sse-server", manifest=server)


def _requests(n: int, tokens: int, tag: str) -> list[Request]:
    return [Request(request_id=f"{tag}-{i}", scenario=tag, phase="measure", session_id=f"{tag}-{i}", turn=0,
                    endpoint="completions", max_tokens=tokens, prompt="x") for i in range(n)]


def _server_times(log: Path) -> dict[str, float]:
    """Request id -> seconds from its headers' arrival to its first token leaving the server."""
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    return {r["id"]: r["first_sent"] - r["received"] for r in rows}


def client_share(folder: Path, model_dir: str, pace: list[str] | None, processes: int, tokens: int = 16) -> None:
    log = folder / "sse-times.jsonl"
    proc, server = _sse_server(SHARE_PORT, tokens, log, pace)
    kind = "paced like a GPU server: " + " ".join(pace) if pace else "back to back"
    print(f"\n1. the client's own share of TTFT ({tokens}-token answers from sse_server.py, {kind}; "
          f"{processes} Locust process{'es' if processes > 1 else ''})")
    try:
        for users in (1, 16, 64):
            name = f"{'paced' if pace else 'b2b'}{users}"
            recs = locust_round(server, _requests(users * 16, tokens, name), users, folder, name, processes)
            served = _server_times(log)
            share = [r.ttft_s - served[key] for r in recs if r.ok and r.ttft_s is not None
                     and (key := request_key(r.request_id, r.phase)) in served]
            server_p50 = float(np.median([served[request_key(r.request_id, r.phase)] for r in recs
                                          if request_key(r.request_id, r.phase) in served])) * 1000
            log.write_text("")
            bench = vllm_bench(SHARE_PORT, users, tokens, model_dir)
            theirs = _server_times(log)
            log.write_text("")
            theirs_ms = (f"vllm bench serve: TTFT p50 {bench[1]:6.2f} ms - server p50 "
                         f"{np.median(list(theirs.values())) * 1000:5.2f} ms = "
                         f"{bench[1] - np.median(list(theirs.values())) * 1000:6.2f} ms"
                         if bench and theirs else "vllm bench serve: no result")
            print(f"   {users:>3} streams: kvscope client share p50 {np.median(share) * 1000:6.2f} ms, p90 "
                  f"{np.percentile(share, 90) * 1000:6.2f} ms (n {len(share)}; server p50 {server_p50:5.2f} ms) | "
                  f"{theirs_ms}", flush=True)
        print("   goal: kvscope's share < 2 ms at 64 streams")
    finally:
        proc.terminate()


def socket_floor(folder: Path, n: int = 40) -> None:
    """The client share of a bare socket against the paced server: what no client on this machine can beat."""
    log = folder / "floor-times.jsonl"
    proc, _ = _sse_server(SHARE_PORT + 1, 16, log, PACED)
    shares, starts = [], {}
    try:
        with socket.create_connection(("127.0.0.1", SHARE_PORT + 1)) as sock:
            for i in range(n):
                body = b'{"prompt": "x", "max_tokens": 16, "stream": true}'
                head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: f{i}\r\n"
                        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
                t0 = time.perf_counter()
                sock.sendall(head + body)
                seen = b""
                while b"data:" not in seen:
                    seen += sock.recv(65536)
                starts[f"f{i}"] = time.perf_counter() - t0
                while not seen.endswith(b"0\r\n\r\n"):
                    seen += sock.recv(65536)
        served = _server_times(log)
        shares = [starts[k] - served[k] for k in starts if k in served]
    finally:
        proc.terminate()
    print(f"\n0. this machine's floor: a bare socket against the paced server, client share p50 "
          f"{np.median(shares) * 1000:5.2f} ms, p90 {np.percentile(shares, 90) * 1000:5.2f} ms (n {len(shares)})")


def vllm_bench(port: int, users: int, tokens: int, model_dir: str) -> tuple[float, float] | None:
    """`vllm bench serve` against the same server at the same concurrency: (output tokens/s, TTFT p50 ms)."""
    cmd = [str(REPO / ".venv-vllm" / "bin" / "python"), str(HERE / "vllm_bench_shim.py"), "bench", "serve",
           "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
           "--model", Path(model_dir).name, "--tokenizer", model_dir, "--dataset-name", "random",
           "--random-input-len", "16", "--random-output-len", str(tokens), "--num-prompts", str(users * 16),
           "--max-concurrency", str(users),
           "--ignore-eos"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    found = dict(re.findall(r"^(Output token throughput \(tok/s\)|Median TTFT \(ms\)):\s+([\d.]+)", out, re.M))
    if len(found) < 2:
        return None
    return float(found["Output token throughput (tok/s)"]), float(found["Median TTFT (ms)"])


def capacity(folder: Path, tokens: int, model_dir: str) -> None:
    port = CAPACITY_PORT
    proc, server = _sse_server(port, tokens)
    try:
        print(f"\n2. generator capacity against sse_server.py ({tokens} tokens per request, one Locust process)")
        best = 0.0
        for users in (1, 4, 16, 64):
            reqs = [Request(request_id=f"r{i}", scenario="cap", phase="measure", session_id=f"r{i}", turn=0,
                            endpoint="completions", max_tokens=tokens, prompt="x")
                    for i in range(users * 16)]
            recs = locust_round(server, reqs, users, folder, f"cap{users}")
            ok = [r for r in recs if r.ok]
            rate = sum(len(r.output_token_ids) for r in ok) / streaming_span(ok)
            ttft = float(np.median([r.ttft_s for r in ok])) * 1000
            if ttft < 5:
                best = max(best, rate)
            theirs = vllm_bench(port, users, tokens, model_dir)
            other = (f"vllm bench serve {theirs[0]:9.0f} tokens/s, TTFT p50 {theirs[1]:6.2f} ms" if theirs
                     else "vllm bench serve: no result")
            print(f"   {users:>3} streams: kvscope {rate:9.0f} tokens/s, TTFT p50 {ttft:6.2f} ms, "
                  f"{len(ok)}/{len(recs)} ok | {other}", flush=True)
        print(f"   capacity while the TTFT error stays under 5 ms: {best:.0f} tokens/s/core (goal >= 20000)")
    finally:
        proc.terminate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", default=str(REPO / "models" / "tiny-qwen3"))
    ap.add_argument("--tokens", type=int, default=256, help="tokens per answer in the capacity rounds")
    ap.add_argument("--processes", type=int, default=1, help="Locust processes in the client-share rounds")
    args = ap.parse_args()
    if len(CORES) > 1:  # the clients (Locust, vllm bench) inherit this
        os.sched_setaffinity(0, CORES[:-1])
        print(f"clients on cores {CORES[:-1]}, the synthetic server on core {CORES[-1]}")
    with tempfile.TemporaryDirectory() as tmp:
        socket_floor(Path(tmp))
        client_share(Path(tmp), args.model_dir, PACED, args.processes)
        client_share(Path(tmp), args.model_dir, None, args.processes)
        capacity(Path(tmp), args.tokens, args.model_dir)


if __name__ == "__main__":
    main()
