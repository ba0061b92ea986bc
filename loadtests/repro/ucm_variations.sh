#!/usr/bin/env bash
# On a CUDA host with vLLM and UCM: run ucm_second_request.py against one fresh vLLM server per variation of
# UCM's store, to narrow down which condition gives wrong answers on a hit. Each server starts alone with
# prefix caching off; its log goes to OUT.
#   loadtests/repro/ucm_variations.sh MODEL_DIR OUT [VARIATION ...]
# Variations: nfs (UcmNfsStore, fp32, block 32, a fresh store), nfs-kept (a new server on nfs's store),
# nfs-sync (enable_event_sync true), nfs-block16, nfs-bf16, pipeline (UcmPipelineStore Cache|Posix: the
# store that passed kvscope's runs).
set -uo pipefail
model=$1; out=$2; shift 2
variations=${*:-nfs nfs-kept nfs-sync nfs-block16 nfs-bf16 pipeline}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
export ENABLE_UCM_PATCH=1 VLLM_USE_FLASHINFER_SAMPLER=0 HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
port=8190
for v in $variations; do
  store="$out/store-$v"; dtype=float32; block=32; sync=false; name=UcmNfsStore; extra=""
  case $v in
    nfs-kept) store="$out/store-nfs" ;;
    nfs-sync) sync=true ;;
    nfs-block16) block=16 ;;
    nfs-bf16) dtype=bfloat16 ;;
    pipeline) name=UcmPipelineStore; extra=', "store_pipeline": "Cache|Posix", "cache_buffer_capacity_gb": 2' ;;
  esac
  mkdir -p "$store"
  ktc="{\"kv_connector\": \"UCMConnector\", \"kv_connector_module_path\": \"ucm.integration.vllm.ucm_connector\",
        \"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {\"enable_event_sync\": $sync, \"ucm_connectors\":
        [{\"ucm_connector_name\": \"$name\", \"ucm_connector_config\": {\"storage_backends\": \"$store\"$extra}}]}}"
  setsid python3 -m vllm.entrypoints.openai.api_server --model "$model" --port $port --dtype $dtype \
    --block-size $block --max-model-len 4096 --enforce-eager --seed 0 --no-enable-prefix-caching \
    --enable-prompt-tokens-details --kv-cache-memory-bytes 3221225472 --gpu-memory-utilization 0.3 \
    --kv-transfer-config "$ktc" > "$out/$v.log" 2>&1 &
  pid=$!
  for _ in $(seq 300); do curl -sf "http://127.0.0.1:$port/health" >/dev/null && break; kill -0 $pid 2>/dev/null || break; sleep 1; done
  echo "== $v (UCM $name, $dtype, block $block, event sync $sync, store $(basename "$store"))"
  if curl -sf "http://127.0.0.1:$port/health" >/dev/null; then
    python3 "$here/ucm_second_request.py" --url "http://127.0.0.1:$port"
  else
    echo "server did not start:"; grep -m3 -E "Error|error" "$out/$v.log"
  fi
  kill -- -$pid 2>/dev/null; wait $pid 2>/dev/null
done
