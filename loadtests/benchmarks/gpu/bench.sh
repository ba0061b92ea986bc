#!/usr/bin/env bash
# On the CUDA host, from the repository root: build a model, then `make bench` with the cuda-processes inventory
# (deploy CONFIGS, run the scenarios, write the report) and `make teardown`: the same targets as every path.
#   [SCENARIOS=a,b] [QUERIES=N] [EXACT=1] [RESULTS=dir] [RUN_DIR=runs/x PORT_OFFSET=N] \
#     loadtests/benchmarks/gpu/bench.sh SHAPE RUN_ID CONFIGS [OVERRIDES_JSON] [USERS]
set -uo pipefail
shape=$1; run_id=$2; configs=$3; overrides=${4:-"{}"}; users=${5:-4}
. "$(dirname "$0")/env.sh"
model "$shape"
make --no-print-directory bench "${where[@]}" MODEL="$KVSCOPE_MODEL_DIR" CONFIGS="$configs" OVERRIDES="$overrides" \
  SCENARIOS="${SCENARIOS:-rag-zipf,rag-relevance,multiturn,repeat-867}" USERS="$users" RUN_ID="$run_id" \
  RESULTS="${RESULTS:-results}" ${QUERIES:+QUERIES=$QUERIES}
echo "bench exit $?"
teardown
