#!/usr/bin/env bash
# On the CUDA host, from the repository root: Mooncake's conversation trace at its own lengths
# (scenario trace-mooncake-full: open-loop arrivals, prompts up to 32k tokens) on the Qwen3-4B shape in bf16,
# normal mode, with CUDA graphs: TTFT under the trace's arrivals, hit rate against the trace's ideal LRU, and
# fidelity on every hit. Leaves OUT_DIR/trace.tar.gz (run folder and log).
#   loadtests/benchmarks/gpu/trace-bench.sh OUT_DIR [CONFIGS=baseline,control,apc,offload-cpu-tier,kvscope-fs]
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd); configs=${2:-baseline,control,apc,offload-cpu-tier,kvscope-fs}
. "$(dirname "$0")/env.sh"
# 12 GiB of GPU KV a server (~87k tokens: the trace's working set is several times that, so eviction decides)
overrides=$(long_context 12884901888)
SCENARIOS=trace-mooncake-full RESULTS=$out/results bash "$(dirname "$0")/bench.sh" qwen3-4b h200-trace-4b-bf16 \
  "$configs" "$overrides" 32 > "$out/trace.log" 2>&1
tar -czf "$out/trace.tar.gz" -C "$out" --ignore-failed-read trace.log results/h200-trace-4b-bf16 2>/dev/null
