#!/usr/bin/env bash
# On a CUDA host with vLLM and LMCache: three exact servers of one model (bf16, batch-invariant, TRITON_ATTN,
# the step cap; otherwise the matrix's cuda platform flags), then lmcache_mp_under_load.py against vLLM's
# prefix cache (the control: must find every answer identical) and against LMCache's multi-process
# connector, both judged against the server that recomputes every prompt. Logs and output go to OUT.
#   loadtests/repro/lmcache_mp_servers.sh MODEL_DIR OUT [USERS=16]
# Exit: the worst of the script's exits (0 identical, 1 an answer differs, 2 a request failed or a server did
# not start, 3 nothing known to be tested).
set -uo pipefail
model=$1; out=$(mkdir -p "$2" && cd "$2" && pwd); users=${3:-16}
here=$(cd "$(dirname "$0")" && pwd)
export VLLM_BATCH_INVARIANT=1 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
lmcache='{"kv_connector": "LMCacheMPConnector", "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
  "kv_role": "kv_both", "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1", "lmcache.mp.port": 8317,
  "lmcache.mp.autostart": true, "lmcache.mp.autostart.server_args": "--l1-size-gb 4 --eviction-policy LRU --http-port 8318"}}'
ports=(8190 8191 8192 8317 8318)
for port in "${ports[@]}"; do  # a server left from an earlier run would answer for the new one
  ! (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null || { echo "port $port is in use: stop what serves it" >&2; exit 2; }
done
pids=(); client=""
stop() {  # the client, every server's process group (LMCache's server is the connector's child), then what is left
  trap '' INT TERM
  [ -n "$client" ] && kill "$client" 2>/dev/null
  for pid in "${pids[@]}"; do kill -- -"$pid" 2>/dev/null; done
  for _ in $(seq 30); do pgrep -g "$(IFS=,; echo "${pids[*]}")" >/dev/null 2>&1 || return 0; sleep 1; done
  for pid in "${pids[@]}"; do kill -9 -- -"$pid" 2>/dev/null; done
}
trap stop EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
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
up() {  # up PORT PID: healthy within 10 minutes, while its process lives
  for _ in $(seq 600); do
    curl -sf --max-time 5 "http://127.0.0.1:$1/health" >/dev/null && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 1
  done
  return 1
}
up 8190 "${pids[0]}" || { echo "the reference server did not start (logs in $out)"; exit 2; }
worst=0
for target in apc:8191:1 lmcache-mp:8192:2; do
  IFS=: read -r name port i <<< "$target"
  if ! up "$port" "${pids[$i]}"; then
    echo "$name did not start (its log: $out/$name.log)" | tee "$out/$name.txt"; worst=2; continue
  fi
  echo "== $name against reference, $users users" | tee "$out/$name.txt"
  python3 "$here/lmcache_mp_under_load.py" --url "http://127.0.0.1:$port" \
    --reference-url http://127.0.0.1:8190 --users "$users" >> "$out/$name.txt" 2>&1 &
  client=$!; wait "$client"; rc=$?; client=""  # in the background, so a signal's trap runs at once
  echo "exit $rc" >> "$out/$name.txt"; tail -4 "$out/$name.txt"
  (( rc > worst )) && worst=$rc
done
exit "$worst"
