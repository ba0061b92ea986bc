# Sourced by the CUDA-host benchmarks, from the repository root: they deploy, bench and tear down with the same
# make targets as every other path (the inventory's overlay.mk: the host's Python, the checkout on its path),
# and run the connector's own benchmarks with that Python.
export PYTHONPATH="$PWD/loadtests:$PWD/connector${PYTHONPATH:+:$PYTHONPATH}" ANSIBLE_CONFIG=ansible/ansible.cfg
export PYTHONUNBUFFERED=1
inv=${INVENTORY:-ansible/inventories/cuda-processes}  # another CUDA host's inventory: a copy, its overlay.mk with it
# EXACT=1: serve batch-invariant (the matrix's exact mode). A second deployment beside the first: its own
# RUN_DIR (default runs/cuda-processes) and PORT_OFFSET (added to every config's port).
run_dir=${RUN_DIR:-runs/cuda-processes}
where=(INVENTORY="$inv" RUN_DIR="$run_dir" PORT_OFFSET="${PORT_OFFSET:-0}" ${EXACT:+EXACT=1})
deploy() {  # deploy CONFIGS [OVERRIDES_JSON]: configs that do not start are reported as crashed
  make --no-print-directory deploy "${where[@]}" MODEL="$KVSCOPE_MODEL_DIR" CONFIGS="$1" OVERRIDES="${2:-"{}"}"
  echo "deploy exit $?"
}
teardown() { make --no-print-directory teardown "${where[@]}"; }
long_context() {  # long_context KV_BYTES: server flags (JSON) for 32k-token prompts on the Qwen3-4B shape: bf16;
  # CUDA graphs for up to 32 sequences (capture stays short); a context that holds a 32k-token prompt; KV_BYTES
  # of GPU KV cache; the servers' start-up memory checks within one GPU
  echo "{\"dtype\": \"bfloat16\", \"enforce-eager\": false, \"max-num-seqs\": 32, \"max-model-len\": 33792,"\
    "\"kv-cache-memory-bytes\": $1, \"gpu-memory-utilization\": 0.15}"
}
model() {  # model SHAPE: build it once under models/SHAPE and point the inventory at it
  export KVSCOPE_MODEL_DIR="$PWD/models/$1"
  [ -f "$KVSCOPE_MODEL_DIR/model.safetensors" ] || python3 -m kvscope.cli build-model --shape "$1" --out "$KVSCOPE_MODEL_DIR"
}
