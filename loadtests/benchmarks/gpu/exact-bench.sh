#!/usr/bin/env bash
# On the CUDA host, from the repository root: the exact verdict's evidence in one run (docs/gpu.md).
#  exact:  the Qwen3-4B shape in bf16, every server batch-invariant (EXACT=1): golden, control, vLLM's prefix
#          cache and CPU offload, kvscope's connector, LMCache (in-process and multi-process) and UCM's NFS
#          store, and the canary's nine faults; QUERIES queries per scenario (>= 60 broken hits per fault);
#  tiny:   beside it, the tiny model in fp32, exact: golden, control, kvscope-fs and the canary;
#  lmcache-repro: loadtests/repro/lmcache_mp_servers.sh on the 4B shape: lmcache-mp's wrong hits without
#          kvscope (three exact servers of their own on TRITON_ATTN whatever ATTENTION says, after the exact
#          part's are gone);
#  normal: then the same 4B workload without batch invariance on baseline, apc and kvscope-fs, same flags
#          otherwise: speed, and the mode's cost (three servers start in a fraction of the ten's time);
#  failed-load: on the freed GPU, loadtests/repro/vllm_failed_load.py (does this vLLM recompute a prompt
#          whose KV load failed?);
#  store-faults: last, the tiny model in fp32, exact: the store faults at rest (docs/workloads.md) on every
#          file-store config (kvscope-fs, vLLM's example-fs, LMCache's disk tier, UCM's stores), with
#          offload-cpu-tier and lmcache-cpu beside them for their reset probes.
# Each part leaves OUT_DIR/<part>.tar.gz (its run folder and log) when it ends; OUT_DIR/DONE at the end. Run
# folders are written under OUT_DIR/results, outside the checkout: a tool that syncs the checkout while the
# run goes on (the lent H200's does, at every call) would remove them there. PARTS picks parts (all by default);
# ATTENTION serves the 4B parts on another attention backend than the matrix's (their run ids then name it);
# CONFIGS replaces the exact part's configs (e.g. only the correct caches, for a run at one user).
#   [PARTS=tiny,exact,lmcache-repro,normal,failed-load,store-faults] [ATTENTION=FLASH_ATTN] [CONFIGS=a,b] loadtests/benchmarks/gpu/exact-bench.sh \
#     OUT_DIR [QUERIES=56] [USERS=16]
set -uo pipefail
out=$(mkdir -p "$1" && cd "$1" && pwd); queries=${2:-56}; users=${3:-16}
here=$(dirname "$0"); . "$here/parts.sh"
pick_parts exact-bench tiny,exact,lmcache-repro,normal,failed-load,store-faults
[[ ${ATTENTION:-X} =~ ^[A-Z0-9_]+$ ]] || { echo "exact-bench: ATTENTION '$ATTENTION' is not a backend name" >&2; exit 2; }
tag=${ATTENTION:+-${ATTENTION,,}}
export SCENARIOS=rag-zipf,rag-relevance QUERIES=$queries RESULTS=$out/results
correct=baseline,control,apc,offload-cpu-tier,kvscope-ram,kvscope-fs
exact_configs=${CONFIGS:-$correct,canary,lmcache-mp,lmcache-cpu,ucm-nfs}
bf16='{"dtype": "bfloat16"'${ATTENTION:+', "attention-backend": "'$ATTENTION'"'}'}'
keep() {  # keep PART FILES...: what a part made, in one archive (paths under OUT_DIR)
  tar -czf "$out/$1.tar.gz" -C "$out" --ignore-failed-read "${@:2}" 2>/dev/null
  echo "$(date -u +%T) $1 kept" >> "$out/progress"
}
python3 -c 'import vllm, ansible, pydantic' 2>/dev/null \
  || { echo "exact-bench: vLLM or the harness's packages do not import: bootstrap.sh first" | tee "$out/DONE" >&2; exit 2; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader > "$out/machine.txt"
python3 -c 'import torch, vllm; print("torch", torch.__version__, "vllm", vllm.__version__)' >> "$out/machine.txt"
want tiny && (
  EXACT=1 RUN_DIR=runs/cuda-processes-tiny PORT_OFFSET=1000 bash "$here/bench.sh" tiny h200-exact-tiny-fp32 \
    baseline,control,kvscope-fs,canary '{"kv-cache-memory-bytes": 536870912}' 8 > "$out/tiny.log" 2>&1
  keep tiny tiny.log results/h200-exact-tiny-fp32
) &
if want exact; then
  EXACT=1 bash "$here/bench.sh" qwen3-4b h200-exact-4b-bf16$tag "$exact_configs" "$bf16" \
    "$users" > "$out/exact.log" 2>&1
  keep exact exact.log "results/h200-exact-4b-bf16$tag"
fi
wait
if want lmcache-repro; then
  if (. "$here/env.sh" && model qwen3-4b) > "$out/lmcache-repro.log" 2>&1; then
    bash loadtests/repro/lmcache_mp_servers.sh models/qwen3-4b "$out/lmcache-repro" "$users" >> "$out/lmcache-repro.log" 2>&1
  else echo "the model did not build" >> "$out/lmcache-repro.log"; fi
  keep lmcache-repro lmcache-repro.log lmcache-repro
fi
if want normal; then
  bash "$here/bench.sh" qwen3-4b "h200-normal-4b-bf16$tag" baseline,apc,kvscope-fs "$bf16" "$users" > "$out/normal.log" 2>&1
  keep normal normal.log "results/h200-normal-4b-bf16$tag"
fi
if want failed-load; then
  python3 loadtests/repro/vllm_failed_load.py models/tiny --dtype float32 > "$out/failed-load.txt" 2>&1
  echo "exit $?" >> "$out/failed-load.txt"
  keep failed-load failed-load.txt
fi
if want store-faults; then
  SCENARIOS=store-bitflip,store-truncate,store-swap,store-unreadable QUERIES=6 EXACT=1 bash "$here/bench.sh" tiny \
    h200-exact-tiny-fp32-store-faults \
    baseline,control,kvscope-fs,example-fs,offload-cpu-tier,lmcache-cpu,lmcache-disk,ucm-nfs,ucm-pipeline \
    '{"kv-cache-memory-bytes": 536870912}' 4 > "$out/store-faults.log" 2>&1
  keep store-faults store-faults.log results/h200-exact-tiny-fp32-store-faults
fi
touch "$out/DONE"
