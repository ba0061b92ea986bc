#!/usr/bin/env bash
# The connector's worker before and after the refactor by composition (issue 62 item 2), on one CUDA GPU:
# connector/tests/test_gpu.py and loadtests/benchmarks/copy_paths.py (72 blocks of the Qwen3-4B shape, 340 MB)
# at each commit, the benchmark's runs interleaved (before, after, before, after) so that both see the same machine;
# then the benchmark's numbers side by side. About 2-3 minutes of GPU.
#   worker-gpu-check.sh BEFORE_DIR [AFTER_DIR=.]   two checkouts (or `git archive` trees: connector/ and
#                                                 loadtests/benchmarks/ are all it needs)
#   worker-gpu-check.sh --git BEFORE_COMMIT        from a git checkout (AFTER = this one): BEFORE via git worktree
# COPY_ARGS (default --blocks 72) are copy_paths.py's arguments, RUNS (default 2) its runs per side.
# Needs python3 with torch (CUDA), triton, xxhash, numpy and pytest. Where vLLM does not import (a bare lent
# host), a stand-in for the five vLLM names the connector's modules import at load is put first on the path:
# the tests and the benchmark drive the worker directly, never vLLM. Writes its logs to $OUT (else /tmp/worker-gpu-check).
set -uo pipefail
if [ "${1:-}" = --git ]; then
  before=/tmp/kvscope-before; after=$PWD
  [ -e "$before" ] && { echo "$before exists: git worktree remove --force $before first" >&2; exit 2; }
  git worktree add --detach "$before" "${2:?the commit before the refactor}" >/dev/null || exit 2
else
  before=$(cd "${1:?usage: worker-gpu-check.sh BEFORE_DIR [AFTER_DIR]}" && pwd) || exit 2
  after=$(cd "${2:-.}" && pwd) || exit 2
fi
out=${OUT:-/tmp/worker-gpu-check}; mkdir -p "$out"
stub=""
if ! python3 -c 'import vllm' 2>/dev/null; then
  stub=$(mktemp -d)/stub; base=$stub/vllm/distributed/kv_transfer/kv_connector/v1
  mkdir -p "$base" && touch "$stub/vllm/__init__.py" "$stub/vllm/distributed/__init__.py" \
    "$stub/vllm/distributed/kv_transfer/__init__.py" "$stub/vllm/distributed/kv_transfer/kv_connector/__init__.py" \
    "$base/__init__.py"
  printf '%s\n' 'import enum' 'class KVConnectorMetadata: ...' 'class KVConnectorBase_V1: ...' \
    'class KVConnectorRole(enum.Enum):' '    SCHEDULER = 0' '    WORKER = 1' > "$base/base.py"
  printf '%s\n' 'from dataclasses import dataclass, field' '@dataclass' 'class KVConnectorStats:' \
    '    data: dict = field(default_factory=dict)' 'class KVConnectorPromMetrics: ...' > "$base/metrics.py"
  echo "vLLM does not import here: a stand-in for its connector base classes ($stub)"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/machine.txt"
python3 -c 'import torch; print("torch", torch.__version__)' | tee -a "$out/machine.txt"
at() {  # at DIR COMMAND...: run with DIR's connector and harness first on the path
  (cd "$1" && shift && PYTHONPATH="${stub:+$stub:}$PWD/connector:$PWD/loadtests" "$@")
}
for side in before after; do
  dir=$before; [ $side = after ] && dir=$after
  at "$dir" python3 -m pytest -q -p no:cacheprovider connector/tests/test_gpu.py > "$out/test_gpu-$side.txt" 2>&1
  echo "$side: test_gpu.py exit $? ($(tail -1 "$out/test_gpu-$side.txt"))"
done
for run in $(seq "${RUNS:-2}"); do
  for side in before after; do
    dir=$before; [ $side = after ] && dir=$after
    at "$dir" python3 loadtests/benchmarks/copy_paths.py ${COPY_ARGS:---blocks 72} > "$out/copy_paths-$side-$run.txt" 2>&1
    echo "$side run $run: copy_paths.py exit $?"
  done
done
python3 - "$out" <<'EOF' | tee "$out/side-by-side.txt"
import re, sys
from pathlib import Path
out = Path(sys.argv[1])
step = re.compile(r"^(\S.*?)\s{2,}(-?[\d.]+) ms\s+[\d.]+ GB/s$")
split = re.compile(r"^(load: .*?): load ([\d.]+) ms: waiting for the load threads ([\d.]+), for the GPU ([\d.]+), "
                   r"the rest (-?[\d.]+)")
runs = {}
for f in sorted(out.glob("copy_paths-*-*.txt"), key=lambda f: (int(f.stem.split("-")[2]), f.stem.split("-")[1] == "after")):
    _, side, run = f.stem.split("-")
    rows = {}
    for line in f.read_text().splitlines():
        if m := step.match(line):
            rows[m[1]] = float(m[2])
        elif m := split.match(line):
            for part, value in zip(("read wait", "GPU wait", "rest"), m.groups()[2:]):
                rows[f"{m[1]} | {part}"] = float(value)
    runs[f"{side}{run}"] = rows
cols = list(runs)
names = list(dict.fromkeys(n for c in cols for n in runs.get(c, {})))
print(f"\n{'copy_paths.py, ms (mean of runs: after/before)':<78}" + "".join(f"{c:>9}" for c in cols) + f"{'after/before':>14}")
for n in names:
    vals = [runs.get(c, {}).get(n) for c in cols]
    b = [v for v, c in zip(vals, cols) if v is not None and c.startswith("before")]
    a = [v for v, c in zip(vals, cols) if v is not None and c.startswith("after")]
    ratio = f"{sum(a) / len(a) / (sum(b) / len(b)):.2f}" if a and b and sum(b) > 0 else "-"
    print(f"{n[:77]:<78}" + "".join(f"{v:9.2f}" if v is not None else f"{'-':>9}" for v in vals) + f"{ratio:>14}")
EOF
