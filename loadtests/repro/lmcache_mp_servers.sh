#!/usr/bin/env bash
# On a CUDA host with vLLM and LMCache: three exact servers of one model (bf16, batch-invariant, TRITON_ATTN,
# the step cap; otherwise the matrix's cuda platform flags), then lmcache_mp_under_load.py against vLLM's
# prefix cache (the control: must find every answer identical) and against LMCache's multi-process
# connector, both judged against the server that recomputes every prompt. Logs and output go to OUT.
#   loadtests/repro/lmcache_mp_servers.sh MODEL_DIR OUT [USERS=16]
set -uo pipefail
model=$1; out=$(mkdir -p "$2" && cd "$2" && pwd); users=${3:-16}
here=$(cd "$(dirname "$0")" && pwd)
export VLLM_BATCH_INVARIANT=1 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
lmcache='{"kv_connector": "LMCacheMPConnector", "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
  "kv_role": "kv_both", "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 8317,
  "lmcache.mp.autostart": true, "lmcache.mp.autostart.server_args": "--l1-size-gb 4 --eviction-policy LRU --http-port 8318"}}'
pids=()
serve() {  # serve NAME PORT FLAGS...
  setsid python3 -m vllm.entrypoints.openai.api_server --model "$model" --port "$2" --dtype bfloat16 \
    --attention-backend TRITON_ATTN --max-num-batched-tokens 255 --max-num-seqs 32 --max-model-len 4096 \
    --block-size 32 --enforce-eager --seed 0 --enable-prompt-tokens-details \
    --kv-cache-memory-bytes 3221225472 --gpu-memory-utilization 0.05 \
    "${@:3}" > "$out/$1.log" 2>&1 &
  pids+=($!)
}
serve reference 8190 --no-enable-prefix-caching
serve apc 8191
serve lmcache-mp 8192 --no-enable-prefix-caching --kv-transfer-config "$lmcache"
up() { for _ in $(seq 600); do curl -sf "http://127.0.0.1:$1/health" >/dev/null && return 0; sleep 1; done; return 1; }
for port in 8190 8191 8192; do up $port || echo "server on port $port did not start (logs in $out)"; done
for target in apc:8191 lmcache-mp:8192; do
  echo "== ${target%%:*} against reference, $users users" | tee "$out/${target%%:*}.txt"
  python3 "$here/lmcache_mp_under_load.py" --url "http://127.0.0.1:${target##*:}" \
    --reference-url http://127.0.0.1:8190 --users "$users" >> "$out/${target%%:*}.txt" 2>&1
  echo "exit $?" >> "$out/${target%%:*}.txt"; tail -4 "$out/${target%%:*}.txt"
done
for pid in "${pids[@]}"; do kill -- -"$pid" 2>/dev/null; done; wait
