#!/usr/bin/env bash
# On the CUDA host, from the repository root: build a model, deploy CONFIGS with the cuda-host inventory, run
# the scenarios, write the report, tear down. The same commands `make bench` runs, with the host's Python.
#   [SCENARIOS=a,b] docker/cuda-host/bench.sh SHAPE RUN_ID CONFIGS [OVERRIDES_JSON] [USERS]
set -uo pipefail
shape=$1; run_id=$2; configs=$3; overrides=${4:-"{}"}; users=${5:-4}
export PYTHONPATH="$PWD/loadtests:$PWD/connector${PYTHONPATH:+:$PYTHONPATH}" ANSIBLE_CONFIG=ansible/ansible.cfg
export KVSCOPE_MODEL_DIR="$PWD/models/$shape" PYTHONUNBUFFERED=1
inv=ansible/inventories/cuda-host
[ -f "$KVSCOPE_MODEL_DIR/model.safetensors" ] || python3 -m kvscope.cli build-model --shape "$shape" --out "$KVSCOPE_MODEL_DIR"
python3 -m ansible playbook -i $inv ansible/deploy.yml -e vllm_configs="$configs" \
  -e "{\"vllm_flag_overrides\": $overrides}"
echo "deploy exit $? (configs that did not start are reported as crashed)"
python3 -m kvscope.cli bench --deployment runs/cuda-host/deployment.json --configs "$configs" \
  --scenarios "${SCENARIOS:-rag-zipf,rag-relevance,multiturn,repeat-867}" --users "$users" --run-id "$run_id" --report
echo "bench exit $?"
python3 -m ansible playbook -i $inv ansible/teardown.yml
