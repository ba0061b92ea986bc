"""kvscope's vLLM KV connector: load with
`--kv-transfer-config '{"kv_connector":"KVScopeConnector","kv_connector_module_path":"kvscope_connector",...}'`."""

from .connector import KVScopeConnector

__all__ = ["KVScopeConnector"]
