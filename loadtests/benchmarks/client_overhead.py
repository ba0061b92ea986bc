"""Benchmark the load generator: client-added TTFT against vLLM, and streamed tokens/s per core.

1. Client-added TTFT: kvscope's Locust user against a deployed server at 1, 16 and 64 concurrent streams;
   client TTFT p50 (from the records) minus the server's TTFT p50 (from vllm:time_to_first_token_seconds
   bucket deltas; the CPU configs use 1 ms buckets up to 200 ms). Goal: < 2 ms.
2. Generator capacity: the same user against sse_server.py (first token at once, then as fast as the
   socket takes them) at rising concurrency, one Locust process = one core. Streamed tokens/s and the TTFT
   the client measures, which is its own error; capacity = the highest tokens/s while that p50 stays
   under 5 ms. Goal: >= 20k tokens/s/core. In the same run, `vllm bench serve` (random prompts,
   --ignore-eos, the same concurrency) against the same server, for comparison.

    .venv/bin/python loadtests/benchmarks/client_overhead.py [--config baseline]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from kvscope.artifacts import Request, Treatment
from kvscope.run import metrics
from kvscope.run.records import read
from kvscope.run.treatments import run_locust
from kvscope.run.workload import Scenario, generate, write_jsonl

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent


def locust_round(server: dict, reqs: list[Request], users: int, folder: Path, name: str) -> list:
    workload, records = folder / f"{name}.workload.jsonl", folder / f"{name}.records.jsonl"
    write_jsonl(reqs, workload)
    run_locust(server, workload, records, users, 1, 0.0, 600)
    return read(records)


def streaming_span(recs) -> float:
    """Seconds from the first request's start to the last stream's end (Locust's start-up excluded)."""
    return max(r.start_unix_s + r.e2e_s for r in recs) - min(r.start_unix_s for r in recs)


def client_added_ttft(server: dict, tokenizer, folder: Path) -> None:
    base = f"http://{server['host']}:{server['port']}"
    print(f"\n1. client-added TTFT against {server['config']} ({base})")
    for users in (1, 16, 64):
        sc = Scenario(name=f"c{users}", kind="rag", num_docs=16, doc_tokens_median=60, docs_per_query=2,
                      num_queries=max(32, 2 * users), system_prompt_tokens=32, max_tokens=4, seed=users)
        before = metrics.scrape(base)
        recs = locust_round(server, generate(sc, tokenizer), users, folder, f"ttft{users}")
        delta = metrics.delta(before, metrics.scrape(base))
        client = float(np.median([r.ttft_s for r in recs if r.ok]))
        srv = metrics.histogram_quantile(delta, "vllm:time_to_first_token_seconds", 0.5)
        print(f"   {users:>3} streams: client p50 {client * 1000:7.2f} ms, server p50 {srv * 1000:7.2f} ms, "
              f"client-added {(client - srv) * 1000:+6.2f} ms  (goal < 2 ms; {sum(r.ok for r in recs)} ok)")


def vllm_bench(port: int, users: int, tokens: int, model_dir: str) -> str:
    """`vllm bench serve` against the same server at the same concurrency: its throughput and median TTFT."""
    cmd = [str(REPO / ".venv-vllm" / "bin" / "python"), str(HERE / "vllm_bench_shim.py"), "bench", "serve",
           "--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions",
           "--model", Path(model_dir).name, "--tokenizer", model_dir, "--dataset-name", "random",
           "--random-input-len", "16", "--random-output-len", str(tokens), "--num-prompts", str(users * 16),
           "--max-concurrency", str(users),
           "--ignore-eos"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600).stdout
    found = dict(re.findall(r"^(Output token throughput \(tok/s\)|Median TTFT \(ms\)):\s+([\d.]+)", out, re.M))
    if len(found) < 2:
        return "vllm bench serve: no result"
    return (f"vllm bench serve {float(found['Output token throughput (tok/s)']):9.0f} tokens/s, "
            f"TTFT p50 {float(found['Median TTFT (ms)']):6.2f} ms")


def capacity(folder: Path, tokens: int, model_dir: str) -> None:
    port = 8189
    proc = subprocess.Popen([sys.executable, str(HERE / "sse_server.py"), str(port), str(tokens)])
    try:
        time.sleep(1.0)
        server = Treatment.model_construct(config="sse-server", role="candidate", host="127.0.0.1", port=port,
                                           block_size=64, served_model_name="tiny")  # no manifest: a synthetic server
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
            print(f"   {users:>3} streams: kvscope {rate:9.0f} tokens/s, TTFT p50 {ttft:6.2f} ms, "
                  f"{len(ok)}/{len(recs)} ok | {vllm_bench(port, users, tokens, model_dir)}", flush=True)
        print(f"   capacity while the TTFT error stays under 5 ms: {best:.0f} tokens/s/core (goal >= 20000)")
    finally:
        proc.terminate()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--deployment", default="runs/local/deployment.json")
    ap.add_argument("--config", default="baseline")
    ap.add_argument("--tokens", type=int, default=256)
    args = ap.parse_args()
    server = {s["config"]: s for s in json.loads(Path(args.deployment).read_text())["servers"]}[args.config]
    tokenizer = Tokenizer.from_file(str(Path(server["model_path"]) / "tokenizer.json"))
    with tempfile.TemporaryDirectory() as tmp:
        client_added_ttft(server, tokenizer, Path(tmp))
        capacity(Path(tmp), args.tokens, server["model_path"])


if __name__ == "__main__":
    main()
