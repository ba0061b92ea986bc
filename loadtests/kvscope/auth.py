"""The servers' API key and what keeps secrets out of results.

The key comes from the environment only: $KVSCOPE_API_KEY, or the file named by $KVSCOPE_API_KEY_FILE (a
mounted secret). Deploy hands it to each server as $VLLM_API_KEY, never as a flag (flags are recorded and
logged); every request kvscope sends to a server's /v1 routes carries it. Whatever kvscope writes down
(manifests, deployment.json, run.json, reports) passes through `redact_args` and `redact_env`.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

KEY_ENV, KEY_FILE_ENV = "KVSCOPE_API_KEY", "KVSCOPE_API_KEY_FILE"
SECRET_WORDS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASSWD", "CREDENTIAL", "CREDENTIALS", "AUTH")
REDACTED = "<redacted>"
URL_PASSWORD = re.compile(r"(://[^/:@\s]+:)[^@/\s]+@")


def api_key() -> str | None:
    if os.environ.get(KEY_FILE_ENV):
        return Path(os.environ[KEY_FILE_ENV]).read_text().strip() or None
    return os.environ.get(KEY_ENV) or None


def headers() -> dict[str, str]:
    """Headers of a JSON request to a server, with the API key when there is one."""
    key = api_key()
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


def _secret(name: str) -> bool:
    """HF_TOKEN, api_key, --api-key, aws_secret_access_key, MYAPIKEY: yes; --max-num-batched-tokens: no."""
    words = re.split(r"[_.]", name.upper().replace("-", "_").strip("_"))
    return any(w in SECRET_WORDS for w in words) or any(words[-1].endswith(w) for w in SECRET_WORDS[:4])


def _secret_flag(flag: str) -> bool:
    """A secret-looking flag, or one vLLM's parser may expand into one: --hf-tok abbreviates --hf-token."""
    last = re.split(r"[_.-]", flag.split("=", 1)[0].upper())[-1]
    return _secret(flag) or (len(last) > 1 and any(w.startswith(last) for w in SECRET_WORDS))


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """Environment safe to write down: values of secret-looking names are replaced."""
    return {k: REDACTED if _secret(k) else v for k, v in env.items()}


def _redact_json(value):
    if isinstance(value, str):
        return URL_PASSWORD.sub(r"\1" + REDACTED + "@", value)  # redis://user:password@host
    if isinstance(value, dict):
        return {k: REDACTED if _secret(k) and isinstance(v, str) else _redact_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_json(v) for v in value]
    return value


def redact_args(args: list[str]) -> list[str]:
    """Server arguments safe to write down: the value of a secret-looking flag, and of every secret-looking
    key inside a JSON argument (the kv-transfer config), replaced."""
    out: list[str] = []
    for arg in args:
        if out and out[-1].startswith("--") and _secret_flag(out[-1]) and not arg.startswith("--"):
            out.append(REDACTED)
        elif arg.startswith("--") and "=" in arg and _secret_flag(arg.split("=", 1)[0]):
            out.append(arg.split("=", 1)[0] + "=" + REDACTED)
        elif arg.startswith("{"):
            try:
                doc = json.loads(arg)
            except ValueError:
                doc = None
            clean = _redact_json(doc)
            out.append(arg if clean == doc else json.dumps(clean, sort_keys=True))
        else:
            out.append(arg)
    return out
