#!/usr/bin/env bash
# On the CUDA host, from the repository root: kvscope's connector against vLLM's own CPU offload and
# recomputing, on the Qwen3-4B shape in bf16 served with CUDA graphs (no --enforce-eager), in one run. First
# what needs no server, with the whole GPU: the connector's GPU tests, load_throughput.py (file loads into the
# GPU's KV cache, hot and cold, on the host's disk under runs/; then hot at the Qwen3-4B shape's 2.25 MiB blocks
# on 4, 8 and 16 load threads), copy_paths.py (a 2.3k- and a 16k-token hit against a pinned copy, the 16k one
# with the forward thread profiled, on 8 load threads and on 16); then, on
# servers, connector_ttft.py (the prompt-length sweep; misses under load on kvscope-ram, kvscope-fs and
# offload-cpu-tier; kvscope-fs-kvikio beside them where kvikio imports) and a bench of the same servers
# (rag-zipf and rag-long: fidelity under the run's own noise floor, TTFT under load). Writes OUT_DIR, the
# bench's run folder too (OUT_DIR/RUN_ID: a lent host that re-syncs the checkout removes what lies in results/).
# PARTS picks parts, in this order (all by default): tests, load (load_throughput.py), copy (copy_paths.py),
# ttft, bench; control, the bench's noise floor, is served only for the bench, and nothing without ttft or bench.
#   [PARTS=tests,load,copy,ttft,bench] loadtests/benchmarks/gpu/connector-bench.sh OUT_DIR
#     [TOKENS=2048,8192,16384,32768] [RUN_ID]
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd); tokens=${2:-2048,8192,16384,32768}; run_id=${3:-h200-connector-sweep}
. "$(dirname "$0")/env.sh"
. "$(dirname "$0")/parts.sh"
pick_parts connector-bench tests,load,copy,ttft,bench
servers=false; { want ttft || want bench; } && servers=true  # the parts that measure servers
configs=baseline$(want bench && echo ,control),offload-cpu-tier,kvscope-ram,kvscope-fs
candidates=kvscope-ram,kvscope-fs
if python3 -c 'import kvikio' 2>/dev/null; then  # kvscope-fs's files read by KvikIO too, where it is installed
  configs+=,kvscope-fs-kvikio; candidates+=,kvscope-fs-kvikio
fi
overrides=$(long_context 6442450944)  # 6 GiB of GPU KV: one 32k-token prompt
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/machine.txt"
python3 -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)' >> "$out/machine.txt"
# the parts without servers first, with the whole GPU: on an 80 GB card the servers leave them no memory
if want tests; then
  python3 -m pytest -q -p no:cacheprovider connector/tests/test_gpu.py > "$out/test_gpu.txt" 2>&1
  echo "GPU tests exit $?"
fi
if want load; then
  files="$PWD/runs/load-throughput"  # the host's disk, not /tmp (it may be tmpfs)
  for mode in hot cold; do
    rm -rf "$files" && mkdir -p "$files"
    { echo "filesystem under $files: $(stat -f -c %T "$files")"
      python3 loadtests/benchmarks/load_throughput.py --device cuda --dir "$files" $([ "$mode" = cold ] && echo --cold)
    } > "$out/load_throughput-$mode.txt" 2>&1
    echo "load_throughput $mode exit $?"
  done
  rc=0
  for threads in 4 8 16; do  # the Qwen3-4B shape's 2.25 MiB blocks: what a block's load costs, by load threads
    rm -rf "$files" && mkdir -p "$files"
    python3 loadtests/benchmarks/load_throughput.py --device cuda --dir "$files" --layers 36 --block 16 --blocks 512 \
      --threads "$threads" || rc=$?
  done > "$out/load_threads.txt" 2>&1
  echo "load_throughput by threads exit $rc"
  rm -rf "$files"
fi
if want copy; then
  python3 loadtests/benchmarks/copy_paths.py --blocks 72 > "$out/copy_paths-72.txt" 2>&1
  for threads in 8 16; do  # a 16k-token hit, the forward thread profiled, on the connector's 8 load threads and on 16
    python3 loadtests/benchmarks/copy_paths.py --blocks 512 --load-threads "$threads" --profile \
      > "$out/copy_paths-512$([ "$threads" = 16 ] && echo -16threads).txt" 2>&1
  done
  echo "copy_paths done"
fi
if $servers; then
  model qwen3-4b
  deploy "$configs" "$overrides" > "$out/deploy.log" 2>&1
  tail -1 "$out/deploy.log"
  if python3 -c 'import json, sys
sys.exit([f["config"] for f in json.load(open(sys.argv[1]))["failed"]] != ["kvscope-fs-kvikio"])' \
      "$run_dir/deployment.json"; then  # KvikIO's server alone did not start: the others are measured without it
    echo "kvscope-fs-kvikio did not start (deploy.log says why); measuring the others" | tee "$out/KVIKIO-FAILED"
    configs=${configs%,kvscope-fs-kvikio}; candidates=${candidates%,kvscope-fs-kvikio}
  elif ! python3 -c 'import json, sys; d = json.load(open(sys.argv[1]))
sys.exit(len(d["failed"]) > 0)' "$run_dir/deployment.json"; then  # CUDA graphs failed somewhere: measure in eager mode, and say so
    echo "a server did not start with CUDA graphs; deploying again with --enforce-eager" | tee "$out/EAGER"
    teardown > /dev/null 2>&1
    deploy "$configs" "${overrides/\"enforce-eager\": false/\"enforce-eager\": true}" > "$out/deploy-eager.log" 2>&1
  fi
  cp "$run_dir/deployment.json" "$out/"
fi
if want ttft; then
  python3 loadtests/benchmarks/connector_ttft.py --deployment "$run_dir/deployment.json" \
    --configs "$candidates" --peers offload-cpu-tier --tokens "$tokens" --prompts 3 --repeats 3 \
    --pause 0.3 --load-users 8 --load-configs "$candidates" --load-peers offload-cpu-tier \
    > "$out/connector_ttft.txt" 2>&1
  echo "connector_ttft exit $?"
fi
if want bench; then
  python3 -m kvscope.cli bench --deployment "$run_dir/deployment.json" --configs "$configs" \
    --scenarios rag-zipf,rag-long --users 4 --run-id "$run_id" --report --results "$out" > "$out/bench.log" 2>&1
  echo "bench exit $?"
fi
if $servers; then teardown > /dev/null 2>&1; fi
