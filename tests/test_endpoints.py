"""`kvscope bench --endpoint/--golden`: the addresses it takes. The bench of servers kvscope did not deploy runs
against fake servers (test_bench_chain.py)."""

from __future__ import annotations

import pytest

from kvscope.config.matrix import ConfigError
from kvscope.run import endpoints


def test_endpoint_urls_are_named_and_anything_kvscope_cannot_address_is_refused():
    assert endpoints.parse("http://10.0.0.5:8000", "endpoint-1") == ("endpoint-1", "http", "10.0.0.5", 8000)
    assert endpoints.parse("llm-d=http://gateway/v1", "endpoint-2") == ("llm-d", "http", "gateway", 80)
    for bad in ("http://gateway:8000/prefix/v1", "Bad_Name=http://h:1", "gateway:8000"):
        with pytest.raises(ConfigError, match="endpoint"):
            endpoints.parse(bad, "endpoint-1")
