"""Render a storage config into what a deployment starts: server arguments, environment, store paths.

The output is deployment-neutral: the process runtime prepends `python -m vllm.entrypoints.openai.api_server`,
a container runtime passes the same arguments to the image's entrypoint.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvscope.artifacts import RenderedServer
from kvscope.auth import redact_args
from kvscope.config.matrix import (
    ConfigError,
    Matrix,
    Platform,
    StorageConfig,
    arg_pairs,
    attention_backend_errors,
    cache_off_errors,
    flag_errors,
    option_read,
    vllm_flags,
    vllm_option,
    whole_and_key_errors,
)


def _flag_args(flags: dict) -> list[str]:
    """One argument a flag: a switch alone (true), a valued flag as `--flag=value`, which vLLM's parser never
    reads as two options; false and null leave a flag out."""
    return [flag if value is True else f"{flag}={value}" for flag, value in flags.items()
            if value is not False and value is not None]


def _fill_stores(value, stores: dict[str, str]):
    if isinstance(value, str):
        for name, path in stores.items():
            value = value.replace("{store:" + name + "}", path)
        return value
    if isinstance(value, dict):
        return {k: _fill_stores(v, stores) for k, v in value.items()}
    if isinstance(value, list):
        return [_fill_stores(v, stores) for v in value]
    return value


def store_paths(cfg: StorageConfig, store_root: Path) -> dict[str, str]:
    """Own stores under stores/<config>/, shared ones under stores/shared/ (one directory for all users)."""
    own = {name: str(store_root / cfg.name / name) for name in cfg.stores}
    return {**own, **{name: str(store_root / "shared" / name) for name in cfg.shared_stores}}


def parse_overrides(text: str) -> dict:
    """'{"dtype": "bfloat16"}' -> {"--dtype": "bfloat16"}: a deployment's server flags over every config's
    (the model's serving dtype, say); true/false switch a flag on or off."""
    try:
        items = json.loads(text or "{}")
    except json.JSONDecodeError as exc:
        raise ConfigError(f"flag overrides {text!r}: not JSON ({exc})") from exc
    if not isinstance(items, dict):
        raise ConfigError(f"flag overrides {text!r}: expected a JSON object such as {{\"dtype\": \"bfloat16\"}}")
    flags = {"--" + str(k).lstrip("-"): v for k, v in items.items()}
    if errors := flag_errors(flags):
        raise ConfigError(f"flag overrides: {'; '.join(errors)}")
    return vllm_flags(flags)


def render(
    matrix: Matrix, cfg: StorageConfig, platform: Platform, model_dir: Path, store_root: Path, host: str,
    overrides: dict | None = None, port_offset: int = 0, exact: bool = False, vllm_version: str | None = None,
    serving_path: str | None = None,
) -> RenderedServer:
    """Everything a runtime needs to start `cfg`; `port_offset` moves its port (a second deployment beside
    one on the matrix's ports); `exact`: serve batch-invariant (the platform's exact mode over the config's
    own flags and environment, with the workarounds the serving `vllm_version` needs: all where it is
    unknown); `serving_path`: the matrix's path of that name, its flags over the config's. The model is served
    under its folder's name."""
    defaults = matrix.platforms[platform]
    if exact and defaults.exact is None:
        raise ConfigError(f"platform '{platform}': no exact mode in the matrix (field 'platforms.{platform}.exact'); "
                          "vLLM's batch-invariant mode needs a GPU of compute capability 8.0 or more")
    mode = defaults.exact if exact and defaults.exact is not None else None
    mode_flags, workarounds = mode.for_vllm(vllm_version) if mode else ({}, [])
    stores = store_paths(cfg, store_root)
    port = cfg.port + port_offset
    args = ["--model", str(model_dir), "--served-model-name", model_dir.name, "--host", host, "--port", str(port)]
    path_flags = matrix.path(serving_path, platform).flags if serving_path else {}
    if errors := _path_errors(path_flags, {"the config": cfg.flags, "exact mode": mode_flags,
                                                        "the flag overrides": overrides or {}}):
        raise ConfigError(f"config '{cfg.name}' cannot take serving path '{serving_path}': {'; '.join(errors)}")
    flags = {**defaults.flags, **cfg.flags, **mode_flags, **path_flags, **(overrides or {})}
    if mode and (mine := {o for f in cfg.flags if (o := option_read(f, _options(mode_flags)))}):
        raise ConfigError(f"config '{cfg.name}': exact mode sets {', '.join(sorted(mine))} (platforms.{platform}"
                          ".exact), which the config sets too; batch invariance needs the platform's choice")
    if mode and (errors := _override_errors(overrides or {}, mode_flags)):
        raise ConfigError(f"flag overrides in exact mode: {'; '.join(errors)}")
    errors = whole_and_key_errors(flags) + attention_backend_errors(flags) + _connector_errors(cfg, flags, platform)
    if errors:
        raise ConfigError(f"config '{cfg.name}': {'; '.join(errors)}")
    if cfg.role in ("golden", "control") and (errors := cache_off_errors(flags)):
        raise ConfigError(f"config '{cfg.name}': the flag overrides would give the {cfg.role} server a cache: "
                          + "; ".join(errors))
    args += _flag_args(flags)
    if cfg.topology is not None:  # the config's ranks; no other source may set them (flag_errors)
        args += cfg.topology.flags()
    if cfg.kv_transfer_config is not None:
        ktc = cfg.kv_transfer_config.model_dump(exclude_none=True)
        args += ["--kv-transfer-config", json.dumps(_fill_stores(ktc, stores), sort_keys=True)]
    if held := _secret_args(args):
        raise ConfigError(f"config '{cfg.name}': {', '.join(held)} holds a secret, which the deployment's and a "
                          "rollout's records would keep in clear: give it by environment (the config's env, from "
                          "ansible-vault: e.g. HF_TOKEN), which they leave out")
    env = {**defaults.env, **cfg.env, **(mode.env if mode else {})}
    if cfg.python_path:  # a connector from the user's own directory, ahead of the platform's path
        env["PYTHONPATH"] = ":".join(cfg.python_path + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return RenderedServer(config=cfg.name, role=cfg.role, port=port, platform=platform,
                          served_model_name=model_dir.name, server_args=args, env=env, stores=stores,
                          store_reset=cfg.store_reset, faults=list(cfg.faults), install=list(cfg.packages),
                          upstream=list(cfg.upstream), exact=mode is not None, exact_workarounds=workarounds,
                          tiers=list(cfg.tiers), writer=cfg.writer, serving_path=serving_path,
                          topology=cfg.topology.model_dump() if cfg.topology else None)


def _secret_args(args: list[str]) -> list[str]:
    """The flags whose values redact_args would hide ('--flag' quoted), in a rendered argument list."""
    return [f"'{(args[i - 1] if i and not arg.startswith('--') else arg).split('=', 1)[0]}'"
            for i, (arg, shown) in enumerate(zip(args, redact_args(args))) if arg != shown]


def cpu_kv_errors(servers: list[RenderedServer], cpu_flags: set[str]) -> list[str]:
    """fp8 KV cache on a CPU without AVX-512 or AMX (`cpu_flags`: /proc/cpuinfo's), which vLLM's CPU backend
    refuses at start: said before anything is deployed, in any spelling vLLM reads."""
    if cpu_flags & {"avx512f", "amx_tile"}:
        return []
    return [f"config '{server.config}': --kv-cache-dtype {value} needs a CPU with AVX-512 or AMX (vLLM's CPU "
            "backend refuses it at start); this one has neither"
            for server in servers for flag, value in arg_pairs(server.server_args)[0]
            if option_read(flag, {"--kv-cache-dtype"}) and str(value).startswith("fp8")]


KVSCOPE_CONNECTOR = {"kvscope_connector", "kvscope_connector.connector", "kvscope_connector.canary"}  # its modules
# (the UCM blend shim in its package is UCM's connector)


def _connector_errors(cfg: StorageConfig, flags: dict, platform: str) -> list[str]:
    """kvscope's connector settings its server would refuse at start: file_tokens, a whole number of the
    blocks vLLM reads from the flags; file_reads, host or kvikio (KvikIO beside a CUDA GPU, no RAM tier)."""
    ktc = cfg.kv_transfer_config
    extra = ktc.kv_connector_extra_config if ktc and ktc.kv_connector_module_path in KVSCOPE_CONNECTOR else {}
    errors = []
    if (reads := extra.get("file_reads")) not in (None, "host", "kvikio"):
        errors.append(f"file_reads {reads!r} is not host or kvikio")
    elif reads == "kvikio" and platform != "cuda":
        errors.append(f"file_reads 'kvikio' reads into a CUDA GPU's memory, not on platform '{platform}'")
    elif reads == "kvikio" and extra.get("ram_bytes") not in (0, "0"):
        errors.append("file_reads 'kvikio' reads file hits into GPU memory, but a RAM tier (ram_bytes absent or "
                      "above 0) takes every one into host memory: set ram_bytes: 0")
    if "file_tokens" not in extra:
        return errors
    tokens = extra["file_tokens"]
    block = next((v for f, v in flags.items() if option_read(f, {"--block-size"})), None)
    block = int(block) if isinstance(block, (int, str)) and str(block).isdigit() else None
    if type(tokens) is int and tokens > 0 and (block is None or (tokens >= block and tokens % block == 0)):
        return errors
    return errors + [f"file_tokens {tokens!r} is not a multiple of the block size"
                     + (f" ({block} tokens)" if block else "") + " (kvscope's connector stores files of whole blocks)"]


def _options(flags: dict) -> set[str]:
    return {vllm_option(f) for f in flags}


def _override_errors(overrides: dict, mode_flags: dict) -> list[str]:
    """An override replaces a flag of the exact mode only in full and with a value (so the server's argv shows
    it): an abbreviation or a switch-off would change what vLLM runs while the server is judged as exact."""
    errors = []
    for flag, value in overrides.items():
        if (option := option_read(flag, _options(mode_flags))) and option != vllm_option(flag):
            errors.append(f"'{flag}' abbreviates {option}, which exact mode sets: write it in full")
        elif option and value in (None, False):
            errors.append(f"'{flag}' would drop {option}, which exact mode sets")
    return errors


def _path_errors(path_flags: dict, sources: dict[str, dict]) -> list[str]:
    """A serving path's flag that a config, exact mode or an override also sets, either way round, in any
    spelling vLLM reads (in full, abbreviated, its --no- form): one of the two would be dropped silently, so
    what was served would not be what the record says."""
    return [f"{source} sets '{flag}', which the path sets ({path_flag})" for source, flags in sources.items()
            for flag in flags for path_flag in path_flags if _same_setting(flag, path_flag)]


def _same_setting(a: str, b: str) -> bool:
    """Whether two flags set one of vLLM's settings: the same option, one abbreviating the other, or a --no- form."""
    def forms(flag: str) -> set[str]:
        option = vllm_option(flag)
        return {option, "--" + option[len("--no-"):]} if option.startswith("--no-") else {option}
    mine, theirs = forms(a), forms(b)
    return any(option_read(f, theirs) for f in mine) or any(option_read(f, mine) for f in theirs)


def model_config(model_dir: Path) -> dict:
    """A model folder's config.json, parsed."""
    return json.loads((model_dir / "config.json").read_text())


def model_errors(model_dir: Path) -> list[str]:
    """Why a folder is not a model vLLM can serve with its tokenizer ([] when it is)."""
    if not model_dir.is_dir():
        return [f"{model_dir} is not a folder"]
    errors = []
    try:
        config = model_config(model_dir)
        if not isinstance(config, dict) or not (config.get("architectures") or config.get("model_type")):
            errors.append("config.json names no architectures or model_type")
    except (OSError, ValueError) as exc:
        errors.append(f"no readable config.json ({type(exc).__name__})")
    if not (model_dir / "tokenizer.json").is_file():
        errors.append("no tokenizer.json (kvscope sizes every workload with the model's own tokenizer)")
    if not any(model_dir.glob("*.safetensors")) and not any(model_dir.glob("*.bin")):
        errors.append("no weights (*.safetensors or *.bin)")
    return errors


ATTENTION_LAYERS = {"full_attention", "sliding_attention", "chunked_attention", "attention"}


def recurrent_layers(config: dict) -> list[str]:
    """The kinds of layer in a model's config.json that keep a recurrent state (linear attention, Mamba), by
    every key the hybrid families spell them with; [] for an attention-only model."""
    kinds: set[str] = set()
    for part in [config, *(config[k] for k in ("text_config", "llm_config") if isinstance(config.get(k), dict))]:
        for key in ("layer_types", "layers_block_type"):  # Qwen3-Next, Gemma; Zamba2
            layers = part.get(key)
            kinds |= {t for t in layers if isinstance(t, str) and t not in ATTENTION_LAYERS} \
                if isinstance(layers, list) else set()
        if "M" in str(part.get("hybrid_override_pattern") or ""):  # Nemotron-H
            kinds.add("mamba")
        if part.get("attn_layer_period") or any(k.startswith(("mamba_", "ssm_")) for k in part):  # Jamba
            kinds.add("mamba")
        interval = part.get("full_attention_interval")
        if (isinstance(interval, int) and interval > 1) or part.get("linear_attn_config") \
                or "linear_conv_kernel_dim" in part:  # Qwen3-Next, Kimi-Linear
            kinds.add("linear_attention")
    return sorted(kinds)


def hybrid_errors(config: dict, configs: list[StorageConfig]) -> list[str]:
    """kvscope's connector on a model (its config.json) with layers that keep a recurrent state (linear
    attention, Mamba): vLLM turns its hybrid KV cache manager off for a connector without SupportsHMA
    (kvscope's), and such a model then cannot start. Refused here, before a deploy, for kvscope's connectors."""
    kinds = recurrent_layers(config)
    if not kinds:
        return []
    return [f"config '{cfg.name}': kvscope's connector cannot serve this model's {', '.join(kinds)} layers: vLLM "
            "turns its hybrid KV cache manager off for a connector without SupportsHMA, and then fails at start "
            "('Failed to promote local KV cache specs to one unified type'); apc serves it"
            for cfg in configs if cfg.kv_transfer_config is not None
            and cfg.kv_transfer_config.kv_connector_module_path in KVSCOPE_CONNECTOR]


def topology_errors(config: dict, configs: list[StorageConfig]) -> list[str]:
    """Topologies vLLM would refuse at start for a model (its config.json): TP ranks that do not divide its
    attention heads, more PP stages than it has layers."""
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    heads, layers = text.get("num_attention_heads"), text.get("num_hidden_layers")
    errors = []
    for cfg in configs:
        if cfg.topology is None:
            continue
        tp, pp = cfg.topology.tensor_parallel, cfg.topology.pipeline_parallel
        if isinstance(heads, int) and heads % tp:
            errors.append(f"config '{cfg.name}': tensor_parallel {tp} does not divide the model's {heads} attention "
                          "heads")
        if isinstance(layers, int) and pp > layers:
            errors.append(f"config '{cfg.name}': pipeline_parallel {pp} is more than the model's {layers} layers")
    return errors
