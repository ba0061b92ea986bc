"""A compatibility shim, not a fix: UCM 0.8.1's UCMBlendConnector on vLLM >= 0.20.

vLLM PR #39832 removed the 2-argument KV connector constructor, and vLLM 0.26 refuses a connector whose
__init__ takes only (vllm_config, role), so UCM's blend connector cannot start there. This subclass takes
vLLM's third argument (the KV cache config) and keeps it where vLLM's base class does, since UCM's blend
passes only two arguments on and its KV layout reads the config later; nothing else changes. On an H200
(vLLM 0.26, UCM 0.8.1) the server then starts and dies at its first request inside UCM's blend code
(docs/gpu.md). Importable only where UCM is installed.
"""

from __future__ import annotations

from ucm.integration.vllm.blend_connector import UCMBlendConnector


class UCMBlendConnectorShim(UCMBlendConnector):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config, role)  # UCM 0.8.1's blend takes no KV cache config ...
        self._kv_cache_config = kv_cache_config  # ... which its layout reads from vLLM's base class
