# Sourced by the CUDA-host scripts, from the repository root: the host's Python sees the harness and the
# connector from the checkout, Ansible the repository's configuration and the cuda-host inventory.
export PYTHONPATH="$PWD/loadtests:$PWD/connector${PYTHONPATH:+:$PYTHONPATH}" ANSIBLE_CONFIG=ansible/ansible.cfg
export PYTHONUNBUFFERED=1
inv=ansible/inventories/cuda-host
# EXACT=1: serve batch-invariant (the matrix's exact mode). A second deployment beside the first: its own
# RUN_DIR (default runs/cuda-host) and PORT_OFFSET (added to every config's port).
run_dir=${RUN_DIR:-runs/cuda-host}
where=(-e kvscope_run_dir="$PWD/$run_dir" -e vllm_port_offset="${PORT_OFFSET:-0}")
deploy() {  # deploy CONFIGS [OVERRIDES_JSON]: configs that do not start are reported as crashed
  local overrides=${2:-"{}"}
  python3 -m ansible playbook -i $inv ansible/deploy.yml -e vllm_configs="$1" -e "{\"vllm_flag_overrides\": $overrides}" \
    "${where[@]}" ${EXACT:+-e vllm_exact=true}
  echo "deploy exit $?"
}
teardown() { python3 -m ansible playbook -i $inv ansible/teardown.yml "${where[@]}"; }
long_context() {  # long_context KV_BYTES: server flags (JSON) for 32k-token prompts on the Qwen3-4B shape: bf16;
  # CUDA graphs for up to 32 sequences (capture stays short); a context that holds a 32k-token prompt; KV_BYTES
  # of GPU KV cache; the servers' start-up memory checks within one GPU
  echo "{\"dtype\": \"bfloat16\", \"enforce-eager\": false, \"max-num-seqs\": 32, \"max-model-len\": 33792,
  \"kv-cache-memory-bytes\": $1, \"gpu-memory-utilization\": 0.15}"
}
model() {  # model SHAPE: build it once under models/SHAPE and point the inventory at it
  export KVSCOPE_MODEL_DIR="$PWD/models/$1"
  [ -f "$KVSCOPE_MODEL_DIR/model.safetensors" ] || python3 -m kvscope.cli build-model --shape "$1" --out "$KVSCOPE_MODEL_DIR"
}
