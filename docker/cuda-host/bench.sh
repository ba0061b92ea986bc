#!/usr/bin/env bash
# On the CUDA host, from the repository root: build a model, deploy CONFIGS with the cuda-host inventory, run
# the scenarios, write the report, tear down. The same commands `make bench` runs, with the host's Python.
#   [SCENARIOS=a,b] [QUERIES=N] [EXACT=1] [RESULTS=dir] [RUN_DIR=runs/x PORT_OFFSET=N] docker/cuda-host/bench.sh \
#     SHAPE RUN_ID CONFIGS [OVERRIDES_JSON] [USERS]
set -uo pipefail
shape=$1; run_id=$2; configs=$3; overrides=${4:-"{}"}; users=${5:-4}
. "$(dirname "$0")/env.sh"
model "$shape"
deploy "$configs" "$overrides"
python3 -m kvscope.cli bench --deployment "$run_dir/deployment.json" --configs "$configs" \
  --scenarios "${SCENARIOS:-rag-zipf,rag-relevance,multiturn,repeat-867}" --users "$users" --run-id "$run_id" --report \
  --results "${RESULTS:-results}" \
  ${EXACT:+--exact} ${QUERIES:+--queries $QUERIES}
echo "bench exit $?"
teardown
