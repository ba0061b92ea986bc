"""The servers' API key and what keeps secrets out of results.

The key comes from the environment only: $KVSCOPE_API_KEY, or the file named by $KVSCOPE_API_KEY_FILE (a
mounted secret). Deploy hands it to each server as $VLLM_API_KEY, never as a flag (flags are recorded and
logged); every request kvscope sends to a server's /v1 routes carries it. Whatever kvscope writes down
(manifests, deployment.json, run.json, reports) passes through `redact_args`, `redact_env` and
`redact_command`: by name (a secret-looking flag, key or variable), and by value (a URL's password, and the
value of every secret this process knows: the API key, the store key, secret-looking environment variables).
"""

from __future__ import annotations

import json
import os
import re
import shlex
from collections.abc import Iterable
from pathlib import Path

import yaml

KEY_ENV, KEY_FILE_ENV = "KVSCOPE_API_KEY", "KVSCOPE_API_KEY_FILE"
SECRET_ENDINGS = ("KEY", "TOKEN", "SECRET", "PASSWORD", "PASS")  # MYAPIKEY, PGPASS
SECRET_WORDS = (*SECRET_ENDINGS, "PASSWD", "PWD", "CREDENTIAL", "CREDENTIALS", "AUTH", "BEARER")
# Words before TOKEN that name a model's token, not a credential: time_to_first_token, eos_token
MODEL_TOKENS = ("FIRST", "LAST", "NEXT", "INPUT", "OUTPUT", "PROMPT", "PER", "INTER", "BOS", "EOS", "PAD", "UNK",
                "SPECIAL")
STORE_KEY_ENV, STORE_KEY_FILE_ENV = "KVSCOPE_STORE_KEY", "KVSCOPE_STORE_KEY_FILE"  # the connector's (keys.py)
MIN_SECRET_CHARS = 6  # a shorter value of a secret-looking variable ("1", "true") is left where it appears
REDACTED = "<redacted>"
URL_PASSWORD = re.compile(r"(://[^/:@\s]*:)[^@/\s]+@")  # redis://user:password@host, redis://:password@host
SHELL_WORD = re.compile(r"""(?:'[^']*'|"(?:\\.|[^"\\])*"|\\.|[^\s'"\\])+""")


def api_key() -> str | None:
    if os.environ.get(KEY_FILE_ENV):
        return Path(os.environ[KEY_FILE_ENV]).read_text().strip() or None
    return os.environ.get(KEY_ENV) or None


def headers() -> dict[str, str]:
    """Headers of a JSON request to a server, with the API key when there is one."""
    key = api_key()
    return {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}


def _secret(name: str) -> bool:
    """HF_TOKEN, api_key, --api-key, aws_secret_access_key, MYAPIKEY: yes; --max-num-batched-tokens: no. A token
    is a credential as a name's last word (access_token), not a model's token (time_to_first_token, eos_token)."""
    words = re.split(r"[_.]", name.upper().replace("-", "_").strip("_"))
    if words[-1] == "TOKEN" and len(words) > 1 and words[-2] in MODEL_TOKENS:
        words = words[:-1]
    return any(w in SECRET_WORDS for w in words if w != "TOKEN") or any(words[-1].endswith(w) for w in SECRET_ENDINGS)


def _secret_flag(flag: str) -> bool:
    """A secret-looking flag, or one vLLM's parser may expand into one: --hf-tok abbreviates --hf-token."""
    last = re.split(r"[_.-]", flag.split("=", 1)[0].upper())[-1]
    return _secret(flag) or (len(last) > 1 and any(w.startswith(last) for w in SECRET_WORDS))


def _known_secrets() -> list[str]:
    """The values of every secret this process knows, longest first."""
    found = {v.strip() for k, v in os.environ.items()
             if _secret(k) and not k.endswith("_FILE") and k not in ("PWD", "OLDPWD")}  # the shell's folders
    for name in (KEY_FILE_ENV, STORE_KEY_FILE_ENV):
        try:
            found.add(Path(os.environ[name]).read_text().strip())
        except (KeyError, OSError, UnicodeDecodeError):
            pass
    return sorted((v for v in found if len(v) >= MIN_SECRET_CHARS), key=len, reverse=True)


def _scrub(text: str, secrets: list[str]) -> str:
    """A text with URL passwords and known secret values replaced."""
    text = URL_PASSWORD.sub(r"\1" + REDACTED + "@", text)
    for secret in secrets:
        text = text.replace(secret, REDACTED)
    return text


def redact_env(env: dict[str, str]) -> dict[str, str]:
    """Environment safe to write down: values of secret-looking names replaced, secrets in the rest."""
    secrets = _known_secrets()
    return {k: REDACTED if _secret(k) else _scrub(v, secrets) for k, v in env.items()}


def _redact_json(value, secrets: list[str]):
    if isinstance(value, str):
        return _scrub(value, secrets)
    if isinstance(value, dict):
        return {k: REDACTED if _secret(k) else _redact_json(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact_json(v, secrets) for v in value]
    return value


def redact_command(command: str, secrets: Iterable[str] = ()) -> str:
    """A shell command line safe to write down: the value of a secret-looking assignment (NAME=value) or flag
    (--api-key value, --api-key=value), URL passwords, known secret values and `secrets` replaced."""
    out, end, previous = [], 0, ""
    for word in SHELL_WORD.finditer(command):
        text = word.group(0)
        name, eq, _ = text.partition("=")
        if previous.startswith("-") and _secret_flag(previous) and not text.startswith("-"):
            text = REDACTED
        elif eq and (_secret_flag(name) if name.startswith("-") else _secret(name)):
            text = name + "=" + REDACTED
        out += [command[end:word.start()], text]
        end, previous = word.end(), word.group(0)
        secrets = [*secrets, *_mapping_secrets(word.group(0))]
    known = {*_known_secrets(), *(v for v in secrets if len(v) >= MIN_SECRET_CHARS)}
    return _scrub("".join(out) + command[end:], sorted(known, key=len, reverse=True))


def _mapping_secrets(word: str) -> list[str]:
    """The values that a JSON or YAML mapping in one shell word gives secret-looking keys, after a NAME= or
    --flag= (OVERRIDES='{"hf_token": ...}', --overrides '{...}')."""
    try:
        text = "".join(shlex.split(word))
    except ValueError:
        return []
    text = re.sub(r"^-*[A-Za-z_][\w.-]*=", "", text)
    return extra_var_secrets([text]) if text.lstrip().startswith(("{", "[")) else []


def extra_var_secrets(extra_vars: list[str]) -> list[str]:
    """The values that ansible-playbook's extra vars (each one -e's text: NAME=VALUE words, a JSON or YAML
    mapping, or @FILE, whose content is not read) give secret-looking names, at any depth: what must be
    redacted wherever they are written down."""
    found: list[str] = []

    def collect(value, secret: bool) -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                collect(v, secret or _secret(str(k)))
        elif isinstance(value, list):
            for v in value:
                collect(v, secret)
        elif secret and value is not None:
            found.append(str(value))

    for text in extra_vars:
        if text.startswith("@"):
            continue
        if text.lstrip().startswith(("{", "[")):
            try:
                collect(yaml.safe_load(text), False)
            except yaml.YAMLError:
                pass
        else:
            try:
                words = shlex.split(text)
            except ValueError:
                words = text.split()
            collect(dict(w.split("=", 1) for w in words if "=" in w), False)
    return found


def redact_args(args: list[str]) -> list[str]:
    """Server arguments safe to write down: the value of a secret-looking flag, and of every secret-looking
    key inside a JSON argument (the kv-transfer config), replaced."""
    out: list[str] = []
    secrets = _known_secrets()
    for arg in args:
        if out and out[-1].startswith("--") and _secret_flag(out[-1]) and not arg.startswith("--"):
            out.append(REDACTED)
        elif arg.startswith("--") and "=" in arg:  # --flag=value, as kvscope renders a valued flag
            name, value = arg.split("=", 1)
            out.append(name + "=" + (REDACTED if _secret_flag(name) else _redact_value(value, secrets)))
        else:
            out.append(_redact_value(arg, secrets))
    return out


def _redact_value(value: str, secrets: list[str]) -> str:
    """A flag's value safe to write down: a JSON object's secret-looking keys, and known secrets, replaced."""
    if not value.startswith("{"):
        return _scrub(value, secrets)
    try:
        doc = json.loads(value)
    except ValueError:
        return _scrub(value, secrets)
    clean = _redact_json(doc, secrets)
    return value if clean == doc else json.dumps(clean, sort_keys=True)
