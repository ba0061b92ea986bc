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
from typing import NamedTuple, cast
from urllib.parse import urlparse

from kvscope.artifacts import Manifest, Role, Scheme, Treatment, root_url
from kvscope.config.matrix import NAME, ConfigError
from kvscope.deploy import servers

DEFAULT_BLOCK_SIZE = 16  # vLLM's, where the server does not report its own
DEFAULT_PORTS: dict[Scheme, int] = {"http": 80, "https": 443}
PROBE_S = 30.0  # the whole of each answer of an endpoint's routes, read before the bench


class Address(NamedTuple):
    name: str
    scheme: Scheme
    host: str
    port: int


def parse(spec: str, default_name: str) -> Address:
    """'[name=]http(s)://host[:port]' -> its name and address; refuses what kvscope cannot address (another
    path, a query) and credentials in the URL (the API key travels in a header: KVSCOPE_API_KEY)."""
    name, _, url = spec.rpartition("=") if re.match(r"^[a-z0-9-]+=", spec) else ("", "", spec)
    name = name or default_name
    parsed = urlparse(url)
    if not re.match(NAME, name):
        raise ConfigError(f"endpoint '{spec}': the name '{name}' must match {NAME}")
    try:
        port = parsed.port
    except ValueError as exc:  # not a number, or out of range
        raise ConfigError(f"endpoint '{spec}': port {exc}") from exc
    if parsed.username is not None or parsed.password is not None:
        raise ConfigError(f"endpoint '{spec}': credentials in the URL are not sent; set KVSCOPE_API_KEY")
    if (parsed.scheme not in DEFAULT_PORTS or not parsed.hostname or port == 0 or parsed.query or parsed.fragment
            or parsed.params or parsed.path not in ("", "/", "/v1", "/v1/")):
        raise ConfigError(f"endpoint '{spec}': expected http(s)://host:port, the server's root (no other path, no "
                          "query)")
    scheme = cast(Scheme, parsed.scheme)
    return Address(name, scheme, parsed.hostname, port or DEFAULT_PORTS[scheme])


def treatment(address: Address, role: Role, model_dir: Path) -> Treatment:
    """One endpoint as a treatment: its served model, and what its /metrics says of its cache."""
    name, scheme, host, port = address
    base = root_url(scheme, host, port)
    try:
        models = json.loads(servers.http_get(f"{base}/v1/models", timeout=PROBE_S))["data"]
    except (urllib.error.URLError, OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"endpoint '{name}' ({base}): /v1/models did not answer: {exc}") from exc
    try:
        labels = servers.cache_config(servers.http_get(f"{base}/metrics", timeout=PROBE_S).decode())
    except (urllib.error.URLError, OSError):
        labels = {}
    try:
        version = json.loads(servers.http_get(f"{base}/version", timeout=PROBE_S)).get("version")
    except (urllib.error.URLError, OSError, ValueError):
        version = None
    block = labels.get("block_size", "None")
    # unknown: assumed on for a server under test; for a reference, its answers' cached tokens must show it off
    caching = labels.get("enable_prefix_caching") == "True" if labels else (True if role == "candidate" else None)
    if caching and labels and role in ("golden", "control"):
        raise ConfigError(f"endpoint '{name}' ({role}) has prefix caching on: the reference must be cache-off "
                          "(vLLM: --no-enable-prefix-caching)")
    manifest = Manifest(config=name, role=role, port=port, host=host, platform="endpoint",
                        served_model_name=models[0]["id"], server_args=[], store_reset="keep", vllm_version=version,
                        kv_capacity_tokens=servers.kv_capacity_tokens(labels),
                        block_size=int(block) if block != "None" else DEFAULT_BLOCK_SIZE, prefix_caching=caching,
                        max_model_len=models[0].get("max_model_len"), model_path=str(model_dir),
                        model_hash=f"served:{models[0]['id']}")
    return Treatment(config=name, manifest=manifest, scheme=scheme)


def treatments(endpoints: list[str], golden: str, control: str | None, model_dir: Path) -> list[Treatment]:
    """The golden endpoint (which must be cache-off), an optional control, and the endpoints under test."""
    if not (model_dir / "tokenizer.json").is_file():
        raise ConfigError(f"--model-dir {model_dir}: no tokenizer.json (the endpoints' model's tokenizer sizes the "
                          "workloads)")
    roles: list[tuple[Address, Role]] = [(parse(golden, "golden"), "golden")]  # every one parsed before any is asked
    if control:
        roles.append((parse(control, "control"), "control"))
    roles += [(parse(spec, f"endpoint-{i}"), "candidate") for i, spec in enumerate(endpoints, 1)]
    names = [address.name for address, _ in roles]
    if len(set(names)) != len(names):
        raise ConfigError(f"endpoint names repeat: {names}; name them as name=http://host:port")
    return [treatment(address, role, model_dir) for address, role in roles]
