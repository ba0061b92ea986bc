"""Does vLLM recompute a prompt whose synchronous KV load failed? A minimal reproduction, no kvscope needed.

`FailingLoads` is a KV connector that claims every full block of a prompt it has seen before, loads nothing
and reports each of those blocks as failed (`get_block_ids_with_load_errors`), under
`kv_load_failure_policy: recompute`. A vLLM that recovers answers the second identical request exactly as
the first (greedy); one that does not answers from whatever the unloaded blocks held. Each variant runs in
its own process (the environment must be set before vLLM starts):

    python loadtests/repro/vllm_failed_load.py MODEL_DIR [--dtype bfloat16] [--variants defaults,sync,sync-v1]

Variants: `defaults` (vLLM's own choices: on a GPU, async scheduling and, for dense models, Model Runner V2),
`sync` (--no-async-scheduling), `sync-v1` (also VLLM_USE_V2_MODEL_RUNNER=0). Exit 1 when a variant answers
a repeat differently from its first answer; the lines say which (vLLM issue #49250 reads the V2 runner's
side of it, #45138 async scheduling's).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

VARIANTS = {"defaults": ({}, {}), "sync": ({}, {"async_scheduling": False}),
            "sync-v1": ({"VLLM_USE_V2_MODEL_RUNNER": "0"}, {"async_scheduling": False})}
PROMPTS = [f"Passage {i}: " + " ".join(f"fact {i}.{j} is that the sky over field {j} is calm" for j in range(40))
           + "\nQuestion: what is fact 3?\nAnswer:" for i in range(4)]

try:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata
except ImportError:  # the parent process only starts children
    KVConnectorBase_V1, KVConnectorMetadata = object, object


@dataclass
class _Meta(KVConnectorMetadata):  # type: ignore[misc, valid-type]
    block_ids: list[int] = field(default_factory=list)


class FailingLoads(KVConnectorBase_V1):  # type: ignore[misc, valid-type]
    """Claims the full blocks of every prompt it saw before; every claimed load fails."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = vllm_config.cache_config.block_size
        self.seen: set[tuple[int, ...]] = set()
        self.planned: list[int] = []
        self.failed: set[int] = set()

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        prompt = tuple(request.prompt_token_ids)
        if prompt not in self.seen:
            return 0, False
        return max(0, (len(prompt) - 1) // self.block_size * self.block_size - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens:
            start = request.num_computed_tokens // self.block_size
            self.planned += blocks.get_block_ids()[0][start:start + num_external_tokens // self.block_size]

    def build_connector_meta(self, scheduler_output):
        self.seen |= {tuple(new.prompt_token_ids) for new in scheduler_output.scheduled_new_reqs}
        meta, self.planned = _Meta(block_ids=self.planned), []
        return meta

    def start_load_kv(self, forward_context, **kwargs):
        self.failed |= set(self._get_connector_metadata().block_ids)  # nothing is written: every load fails

    def wait_for_layer_load(self, layer_name):
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return

    def wait_for_save(self):
        return

    def get_block_ids_with_load_errors(self):
        failed, self.failed = self.failed, set()
        return failed


def child(model: str, dtype: str, variant: str) -> None:
    """One variant: each prompt twice in a row; prints JSON [[first answer, second answer, tokens the
    second one was promised from the connector], ...]."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model, dtype=dtype, seed=0, enforce_eager=True, enable_prefix_caching=False,
              max_model_len=2048, gpu_memory_utilization=0.1, **VARIANTS[variant][1],
              kv_transfer_config={"kv_connector": "FailingLoads", "kv_role": "kv_both",
                                  "kv_connector_module_path": "vllm_failed_load",
                                  "kv_load_failure_policy": "recompute"})
    greedy = SamplingParams(temperature=0, max_tokens=24)
    pairs = []
    for prompt in PROMPTS:
        first, again = (llm.generate([prompt], greedy)[0] for _ in range(2))
        pairs.append([list(first.outputs[0].token_ids), list(again.outputs[0].token_ids), again.num_cached_tokens])
    print("RESULT " + json.dumps(pairs), flush=True)


def root_cause(err: str) -> str:
    """Why a variant's process failed, from its standard error: the last exception line above vLLM's "See root
    cause above." (which names none), else the last exception line."""
    found = [line.strip() for line in err.splitlines() if re.match(r"\s*[\w.]+(Error|Exception)\b.*:", line)]
    causes = [line for line in found if "See root cause above" not in line]
    return (causes or found or ["no error output"])[-1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.model, args.dtype, args.child)
        return 0
    here = str(Path(__file__).resolve().parent)
    wrong = 0
    procs = {}
    for variant in args.variants.split(","):
        env = {**os.environ, **VARIANTS[variant][0], "PYTHONPATH": here + os.pathsep + os.environ.get("PYTHONPATH", "")}
        procs[variant] = subprocess.Popen([sys.executable, __file__, args.model, "--dtype", args.dtype, "--child",
                                           variant], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for variant, proc in procs.items():
        out, err = proc.communicate()
        lines = [line for line in out.splitlines() if line.startswith("RESULT ")]
        if proc.returncode or not lines:
            print(f"{variant}: did not run (exit {proc.returncode}): {root_cause(err)}")
            wrong += 1
            continue
        pairs = json.loads(lines[-1][len("RESULT "):])
        if not all(cached for _, _, cached in pairs):  # no claim, no failed load: nothing was tested
            print(f"{variant}: the connector was not asked for every repeat ({[c for _, _, c in pairs]}): no test")
            wrong += 1
            continue
        differ = [i for i, (first, again, _) in enumerate(pairs) if first != again]
        wrong += bool(differ)
        print(f"{variant}: {len(pairs) - len(differ)} of {len(pairs)} repeats (each promised "
              f"{pairs[0][2]} tokens whose loads all failed) answer as the first" +
              (f"; prompts {differ} differ, e.g. {pairs[differ[0]][0][:8]} then {pairs[differ[0]][1][:8]}"
               if differ else ""))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
