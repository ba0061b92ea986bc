"""A compatibility shim, not a fix: UCM 0.8.1's UCMBlendConnector on vLLM >= 0.20.

vLLM PR #39832 removed the 2-argument KV connector constructor, and vLLM 0.26 refuses a connector whose
__init__ takes only (vllm_config, role), so UCM's blend connector cannot start there. This subclass takes
vLLM's third argument (the KV cache config) and drops it; nothing else changes. UCM applies its blend
patches to vLLM 0.11.0 only, so whether blending happens on a newer vLLM is what a run of the matrix's
`ucm-blend-shim` config shows. Importable only where UCM is installed.
"""

from __future__ import annotations

from ucm.integration.vllm.blend_connector import UCMBlendConnector


class UCMBlendConnectorShim(UCMBlendConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role)  # UCM 0.8.1 takes no KV cache config
