"""Servers kvscope did not deploy: OpenAI-compatible endpoints (vLLM, llm-d, production-stack) benched as
they run, each read off its own routes into the same Treatment a deployment gives.

What a deployment knows and an endpoint may not say: its block size and KV capacity (from vLLM's
`vllm:cache_config_info` where /metrics has it; otherwise vLLM's default block size and no capacity), and
whether its cache can be reset (`/reset_prefix_cache`; the report says where it could not).
"""

from __future__ import annotations

import json
import re
import urllib.error
from pathlib import Path
from urllib.parse import urlparse

from kvscope.artifacts import Role, Treatment
from kvscope.config.matrix import NAME, ConfigError
from kvscope.deploy import servers

DEFAULT_BLOCK_SIZE = 16  # vLLM's, where the server does not report its own


def parse(spec: str, default_name: str) -> tuple[str, str, int]:
    """'[name=]http://host:port' -> (name, host, port); refuses what kvscope cannot address."""
    name, _, url = spec.rpartition("=") if re.match(r"^[a-z0-9-]+=", spec) else ("", "", spec)
    name = name or default_name
    parsed = urlparse(url)
    if not re.match(NAME, name):
        raise ConfigError(f"endpoint '{spec}': the name '{name}' must match {NAME}")
    if parsed.scheme != "http" or not parsed.hostname or parsed.path not in ("", "/", "/v1", "/v1/"):
        raise ConfigError(f"endpoint '{spec}': expected http://host:port (the server's root, no other path)")
    return name, parsed.hostname, parsed.port or 80


def treatment(spec: str, default_name: str, role: Role, model_dir: Path) -> Treatment:
    """One endpoint as a treatment: its served model, and what its /metrics says of its cache."""
    name, host, port = parse(spec, default_name)
    base = f"http://{host}:{port}"
    try:
        models = json.loads(servers.http_get(f"{base}/v1/models", timeout=30))["data"]
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"endpoint '{name}' ({base}): /v1/models did not answer: {exc}") from exc
    try:
        labels = servers.cache_config(servers.http_get(f"{base}/metrics", timeout=30).decode())
    except (urllib.error.URLError, OSError):
        labels = {}
    try:
        version = json.loads(servers.http_get(f"{base}/version", timeout=10)).get("version")
    except (urllib.error.URLError, OSError, ValueError):
        version = None
    block = labels.get("block_size", "None")
    caching = labels.get("enable_prefix_caching") == "True" if labels else role == "candidate"  # unknown: assumed
    if caching and labels and role in ("golden", "control"):
        raise ConfigError(f"endpoint '{name}' ({role}) has prefix caching on: the reference must be cache-off "
                          "(vLLM: --no-enable-prefix-caching)")
    return Treatment(config=name, role=role, port=port, host=host, platform="endpoint",
                     served_model_name=models[0]["id"], server_args=[], store_reset="keep", vllm_version=version,
                     kv_capacity_tokens=servers.kv_capacity_tokens(labels),
                     block_size=int(block) if block != "None" else DEFAULT_BLOCK_SIZE,
                     prefix_caching=caching,
                     max_model_len=models[0].get("max_model_len"), model_path=str(model_dir),
                     model_hash=f"served:{models[0]['id']}")


def treatments(endpoints: list[str], golden: str, control: str | None, model_dir: Path) -> list[Treatment]:
    """The golden endpoint (which must be cache-off), an optional control, and the endpoints under test."""
    if not (model_dir / "tokenizer.json").is_file():
        raise ConfigError(f"--model-dir {model_dir}: no tokenizer.json (the endpoints' model's tokenizer sizes the "
                          "workloads)")
    found = [treatment(golden, "golden", "golden", model_dir)]
    if control:
        found.append(treatment(control, "control", "control", model_dir))
    found += [treatment(spec, f"endpoint-{i}", "candidate", model_dir) for i, spec in enumerate(endpoints, 1)]
    names = [t.config for t in found]
    if len(set(names)) != len(names):
        raise ConfigError(f"endpoint names repeat: {names}; name them as name=http://host:port")
    return found
