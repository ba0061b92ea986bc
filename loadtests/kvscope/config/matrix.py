"""The storage-config matrix: one YAML file, one schema, read by every deployment path.

Local processes (the embedded default) and GPU containers both render a config from this model; nothing
else restates it. Validation runs before anything is deployed, and every error names the config and field.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Annotated, Literal

import yaml
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import Version
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from kvscope.artifacts import Role
from kvscope.config import strict_yaml

Platform = Literal["cpu", "cuda"]
FlagValue = bool | int | float | str
NAME = r"^[a-z0-9][a-z0-9-]*$"  # config and store names: a path component, never a path
StoreName = Annotated[str, Field(pattern=NAME)]
# A plain variable name: keys reach a shell's environment prefix and Docker's env unquoted.
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")]
Link = Annotated[str, Field(pattern=r"^https://\S+$")]
ROLE_ORDER = {"golden": 0, "control": 1, "candidate": 2, "canary": 3}  # the order treatments run and reports list

# Flags the renderer owns: a config that sets one would silently fight the deployment.
# The API key is one too: it comes from the environment (KVSCOPE_API_KEY), never from a file that is recorded.
# So is vLLM's --config, a file of flags kvscope would not see.
RESERVED_FLAGS = {"--model", "--port", "--host", "--served-model-name", "--kv-transfer-config", "--api-key", "--config"}
# The fault classes of kvscope_connector.canary.FAULTS (the harness does not import the connector; a test
# keeps the two lists equal).
CANARY_FAULTS = ("shift", "zeros", "stale", "layer", "head", "noise-1e-2", "noise-1e-3", "second-hit", "foreign",
                 "unloaded", "reused", "partial", "rank0-only", "rank0-heads")
RANK_FAULTS = ("rank0-only", "rank0-heads")  # they act on tensor-parallel ranks above 0 only
# Flags that would give a cache-off reference (golden, control) a cache.
CACHE_FLAGS = ("--enable-prefix-caching", "--kv-offloading-size")
CACHE_OFF = "--no-enable-prefix-caching"
# The server's topology (TP and PP ranks within one server), which only a config's `topology` field sets, so that
# every sharded server is rendered, recorded and judged as one; vLLM also reads the short '-tp' and '-pp'.
TOPOLOGY_FLAGS = {"--tensor-parallel-size": "tensor_parallel", "--pipeline-parallel-size": "pipeline_parallel"}
TOPOLOGY_SHORT = {"tp": "--tensor-parallel-size", "pp": "--pipeline-parallel-size"}
# Other ways vLLM runs one server on several ranks, which no topology records (context parallelism splits the KV
# across ranks): refused in every spelling (their short '-dp', '-dcp', '-pcp' as every single-dash flag is).
RANK_FLAGS = ("--data-parallel-size", "--decode-context-parallel-size", "--prefill-context-parallel-size")
# Flags whose every spelling is checked: vLLM's parser reads an unambiguous prefix as the whole option.
WATCHED_FLAGS = RESERVED_FLAGS | set(CACHE_FLAGS) | {CACHE_OFF}
# A value shaped as an option ('--x', '-O3'), not a number ('-1', '-.5'): once the value of a flag that takes
# none, vLLM's parser would read it as an option of its own.
OPTION_SHAPED = re.compile(r"^\s*-(?![\d.])")
# An option's name as vLLM's parser reads one word: '--name' or '--name.key' (a key of a JSON option); a space
# would make the word a positional argument, an '=' its value.
FLAG_NAME = re.compile(r"^--[A-Za-z0-9][A-Za-z0-9_-]*(\.[A-Za-z0-9_-]+)*$")


def vllm_flag(flag: str) -> str:
    """A flag as vLLM's parser names it: '_' is '-' up to the first '.' (`--kv_transfer_config.kv_role` sets
    a key of `--kv-transfer-config`'s JSON)."""
    name, dot, key = flag.split("=", 1)[0].partition(".")
    return name.replace("_", "-") + dot + key


NEGATIVE = re.compile(r"^-\d+$|^-\d*\.\d+$")  # a value, not a flag, to argparse


def arg_pairs(args: list[str]) -> tuple[list[tuple[str, FlagValue]], list[str]]:
    """Server arguments read back into flags as vLLM's parser reads them (`--flag value`, `--flag=value`, or a
    switch), in order, and why they could not be."""
    pairs: list[tuple[str, FlagValue]] = []
    errors = []
    i = 0
    while i < len(args):
        flag, eq, value = args[i].partition("=")
        if not flag.startswith("-"):
            errors.append(f"argument {args[i]!r} belongs to no flag")
        elif not eq and i + 1 < len(args) and (not args[i + 1].startswith("-") or NEGATIVE.match(args[i + 1])):
            pairs.append((flag, args[i + 1]))
            i += 1
        else:
            pairs.append((flag, value if eq else True))
        i += 1
    return pairs, errors


def vllm_option(flag: str) -> str:
    """The option a flag sets in vLLM's parser (before any abbreviation is expanded)."""
    return vllm_flag(flag).split(".", 1)[0]


def option_read(flag: str, options) -> str | None:
    """The option of OPTIONS that FLAG sets as vLLM's parser reads it: its own, or the one it abbreviates (an
    unambiguous prefix is the whole option); None when it sets none of them."""
    option = vllm_option(flag)
    return option if option in options else next((o for o in sorted(options) if o.startswith(option)), None)


def topology_option(flag: str) -> str | None:
    """The topology option FLAG sets as vLLM's parser reads it (in full, '_' for '-', abbreviated or short), if any."""
    return TOPOLOGY_SHORT.get(flag.lstrip("-").split("=", 1)[0]) or option_read(flag, TOPOLOGY_FLAGS)


def cache_off_errors(flags: dict[str, FlagValue]) -> list[str]:
    """Why these server flags do not keep vLLM's prefix cache and KV offloading off ([] when they do)."""
    on = {vllm_option(f) for f, v in flags.items() if v is not None and v is not False}  # 0 too: vLLM attaches
    # its offloading connector whenever --kv-offloading-size is set
    errors = [f"flag '{f}' turns a cache on" for f in CACHE_FLAGS if f in on]
    if not any(vllm_flag(f) == CACHE_OFF and v is True for f, v in flags.items()):
        errors.append(f"needs '{CACHE_OFF}: true' (vLLM caches prefixes by default)")
    return errors


class ConfigError(ValueError):
    """Input that must not be run (matrix, selection, scenario); the message names the item and the field."""


class Strict(BaseModel):
    # Unknown keys are an error, not silently dropped: a misspelt key would otherwise keep "working"
    # while quietly losing the setting it was meant to apply.
    model_config = ConfigDict(extra="forbid")


def flag_errors(flags: dict[str, FlagValue]) -> list[str]:
    """Why these flags may not be given to a server ([] when they may), read as vLLM's parser reads them."""
    errors, seen = [], set()
    for flag, value in flags.items():
        option = vllm_option(flag)
        whole = read if (read := option_read(flag, WATCHED_FLAGS)) != option else None
        if topology := topology_option(flag):
            errors.append(f"flag '{flag}' sets the server's topology ({topology}, as vLLM reads it): set the "
                          "config's 'topology' field instead")
        elif ranks := option_read(flag, RANK_FLAGS):
            errors.append(f"flag '{flag}' runs the server on several ranks ({ranks}, as vLLM reads it), which a "
                          "config's topology does not record (tensor and pipeline parallel only)")
        elif not flag.startswith("--"):
            errors.append(f"flag '{flag}' must start with '--'")
        elif not FLAG_NAME.match(flag):
            errors.append(f"flag {flag!r} is not an option's name (letters, digits, '-' and '_', keys after '.'): "
                          "vLLM's parser would read a space as another word and '=' as a value")
        elif option in RESERVED_FLAGS:
            errors.append(f"flag '{flag}' is set by kvscope itself and may not appear in a config or override")
        elif whole:
            errors.append(f"flag '{flag}' abbreviates '{whole}' (vLLM would read it so): write it in full")
        elif vllm_flag(flag) in seen:
            errors.append(f"flag '{flag}' is given twice (vLLM reads '_' as '-')")
        elif isinstance(value, str) and OPTION_SHAPED.match(value):
            errors.append(f"flag '{flag}': its value {value!r} reads as an option, not a value (a flag that takes "
                          "no value is true or false)")
        seen.add(vllm_flag(flag))
    return errors


def whole_and_key_errors(flags: dict[str, FlagValue]) -> list[str]:
    """Options given both whole and by key (`--x '{...}'` and `--x.k v`): vLLM's parser appends the keys as a
    JSON object of their own after every other argument, so the whole value would be dropped silently."""
    keyed: dict[str, list[str]] = {}
    for flag in flags:
        if "." in vllm_flag(flag):
            keyed.setdefault(vllm_option(flag), []).append(vllm_flag(flag))
    return [f"flag '{f}' is given whole and by key ({', '.join(repr(k) for k in keyed[vllm_flag(f)])}): vLLM would "
            "drop the whole value; give its keys as flags of their own" for f in flags if vllm_flag(f) in keyed]


def attention_backend_errors(flags: dict[str, FlagValue]) -> list[str]:
    """vLLM refuses `--attention-backend` beside an `--attention-config` that names a backend ("mutually
    exclusive"), at start-up: say so before anything is deployed."""
    named = {vllm_flag(f): v for f, v in flags.items()}
    if "--attention-backend" not in named:
        return []
    whole = named.get("--attention-config")
    try:
        whole_backend = isinstance(whole, str) and "backend" in json.loads(whole)
    except (ValueError, TypeError):
        whole_backend = False
    if "--attention-config.backend" in named or whole_backend:
        return ["'--attention-backend' and an '--attention-config' backend are both given: vLLM refuses them "
                "as mutually exclusive"]
    return []


def vllm_flags(flags: dict[str, FlagValue]) -> dict[str, FlagValue]:
    """Flags named as vLLM's parser names them, so that a later spelling overrides an earlier one."""
    return {vllm_flag(f) if f.startswith("--") else f: v for f, v in flags.items()}


def _check_flags(flags: dict[str, FlagValue]) -> dict[str, FlagValue]:
    if errors := flag_errors(flags):
        raise ValueError("; ".join(errors))
    return vllm_flags(flags)


class ExactWorkaround(Strict):
    """Flags exact mode needs on the vLLM releases before an upstream fix (the report names the issue)."""

    issue: str = Field(description="the upstream report, e.g. vllm#48271")
    fixed_in: str = Field(description="the first vLLM release with the fix: from it on, the workaround is off")
    flags: dict[str, FlagValue] = Field(description="vLLM flags exact mode adds on older releases")

    _flags = field_validator("flags")(_check_flags)

    @field_validator("fixed_in")
    @classmethod
    def _release(cls, value: str) -> str:
        Version(value)  # raises InvalidVersion, a ValueError, on a string that is not a release
        return value

    def needed(self, vllm_version: str | None) -> bool:
        """On a release before the fix, or where the serving vLLM's version is unknown (the safe side)."""
        return vllm_version is None or Version(vllm_version).release < Version(self.fixed_in).release


class ExactMode(Strict):
    """How a platform serves batch-invariant, so that a correct cache is bitwise equal to golden (EXACT=1).
    The mode's flags depend on the serving vLLM only through `workarounds`, a table keyed by release."""

    flags: dict[str, FlagValue] = Field(default_factory=dict, description="vLLM flags every server gets in exact mode")
    env: dict[EnvName, str] = Field(default_factory=dict, description="environment every server gets in exact mode")
    workarounds: list[ExactWorkaround] = Field(
        default_factory=list, description="flags added on vLLM releases before an upstream fix")

    _flags = field_validator("flags")(_check_flags)

    def for_vllm(self, vllm_version: str | None) -> tuple[dict[str, FlagValue], list[str]]:
        """The mode's flags on that vLLM, and the issues whose workarounds they include."""
        needed = [w for w in self.workarounds if w.needed(vllm_version)]
        return {**self.flags, **{f: v for w in needed for f, v in w.flags.items()}}, [w.issue for w in needed]


class Topology(Strict):
    """The ranks of one server: vLLM's --tensor-parallel-size and --pipeline-parallel-size."""

    model_config = ConfigDict(extra="forbid", strict=True)  # 2, never "2", 2.0 or true
    tensor_parallel: int = Field(default=1, ge=1, le=64, description="tensor-parallel ranks (heads split)")
    pipeline_parallel: int = Field(default=1, ge=1, le=64, description="pipeline stages (layers split)")

    def ranks(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    def flags(self) -> list[str]:
        """Its ranks as vLLM's arguments, as the render gives them (and a rollback's check reads them)."""
        return [f"{flag}={getattr(self, field)}" for flag, field in TOPOLOGY_FLAGS.items()]


class PlatformDefaults(Strict):
    flags: dict[str, FlagValue] = Field(default_factory=dict, description="vLLM flags every config gets")
    env: dict[EnvName, str] = Field(default_factory=dict, description="environment every server gets")
    max_topology: Topology = Field(
        default_factory=Topology, description="the largest topology this platform's vLLM runs (a config's "
        "tensor_parallel and pipeline_parallel each at most this); default: one rank, no sharded configs")
    exact: ExactMode | None = Field(
        default=None, description="batch-invariant serving (EXACT=1); none: the platform has no exact mode")

    _flags = field_validator("flags")(_check_flags)


class KVTransferConfig(Strict):
    """The JSON of vLLM's --kv-transfer-config; `{store:NAME}` in extra_config becomes that store's path."""

    kv_connector: str = Field(description="connector class name (registry or inside the module path)")
    kv_role: Literal["kv_producer", "kv_consumer", "kv_both"] = "kv_both"
    kv_connector_module_path: str | None = Field(default=None, description="external connector module")
    kv_connector_extra_config: dict = Field(default_factory=dict, description="connector settings")
    kv_load_failure_policy: Literal["fail", "recompute"] | None = None


class StorageConfig(Strict):
    name: str = Field(pattern=NAME, description="unique config name")
    description: str = Field(min_length=1, description="what this tier is, in a sentence")
    platforms: list[Platform] = Field(min_length=1, description="where it can run")
    port: int = Field(ge=1024, le=65535, description="server port, unique in the matrix")
    role: Role = Field(
        default="candidate", description="golden: the cache-off reference; control: a second cache-off server, "
        "whose differences from golden are the run's noise floor; canary: injects faults, must FAIL fidelity")
    faults: list[Literal[CANARY_FAULTS]] = Field(  # type: ignore[valid-type]
        default_factory=list, description="canary: the fault classes to run, one treatment each")
    flags: dict[str, FlagValue] = Field(default_factory=dict, description="vLLM flags over the platform's")
    env: dict[EnvName, str] = Field(default_factory=dict, description="environment over the platform's")
    kv_transfer_config: KVTransferConfig | None = None
    shared_stores: list[StoreName] = Field(
        default_factory=list, description="store dirs shared with every config that names them, wiped on reset"
    )
    stores: list[StoreName] = Field(default_factory=list, description="store dirs it owns, wiped on reset")
    python_path: list[str] = Field(
        default_factory=list, description="folders put first on the server's Python path (a connector of your "
        "own that is not installed; relative to the matrix file)")
    packages: list[str] = Field(
        default_factory=list, description="requirements installed into the serving environment before the server "
        "starts (process runtime), e.g. 'lmcache==0.5.6'")
    upstream: list[Link] = Field(
        default_factory=list, description="upstream reports about this path (issue or PR links), listed beside "
        "its verdict in the report")
    writer: str | None = Field(
        default=None, pattern=NAME, description="shared-store scenarios: the config whose server writes the store "
        "this one loads from (their prime phase goes to it, the measure phase here)")
    tiers: list[StoreName] = Field(
        default_factory=list, description="the tiers this config certifies (as its connector's load log names "
        "them: ram, disk): each must serve at least --min-hits verified hits, or the config cannot PASS")
    topology: Topology | None = Field(
        default=None, description="TP and PP ranks within this one server (candidates and canaries only: golden "
        "and control stay one unsharded server, the reference the sharded answers are judged against)")
    store_reset: Literal["wipe", "keep"] = Field(
        "wipe", description="keep: never wipe the stores under the live server (a connector that keeps its own "
        "state in them); the server's own reset endpoint is still called")

    _flags = field_validator("flags")(_check_flags)

    @field_validator("stores")
    @classmethod
    def _stores_cover_the_connector(cls, stores: list[str], info: ValidationInfo) -> list[str]:
        ktc = info.data.get("kv_transfer_config")
        declared = set(stores) | set(info.data.get("shared_stores") or [])
        missing = (_store_refs(ktc.kv_connector_extra_config) if ktc else set()) - declared
        if missing:
            raise ValueError(f"kv_transfer_config uses store(s) {sorted(missing)} that are not listed here")
        return stores

    @field_validator("packages")
    @classmethod
    def _requirements(cls, packages: list[str]) -> list[str]:
        for spec in packages:
            try:
                Requirement(spec)  # a name and a version set: never a pip option or a URL
            except InvalidRequirement as exc:
                raise ValueError(f"'{spec}' is not a requirement ({exc})") from exc
            if "@" in spec:
                raise ValueError(f"'{spec}': direct URLs are not allowed; use python_path for a local folder")
        return packages

    @model_validator(mode="after")
    def _role_rules(self) -> StorageConfig:
        if self.role in ("golden", "control"):
            errors = cache_off_errors(self.flags) + (["has a kv_transfer_config"] if self.kv_transfer_config else [])
            if errors:
                raise ValueError(f"a {self.role} config must be cache-off: {'; '.join(errors)}")
        if self.faults and self.role != "canary":
            raise ValueError("only a canary config lists faults")
        per_rank = [f for f in self.faults if f in RANK_FAULTS]
        if per_rank and (self.topology is None or self.topology.tensor_parallel < 2):
            raise ValueError(f"faults {', '.join(repr(f) for f in per_rank)} act on tensor-parallel ranks above 0 "
                             "only: on this server of one rank they would break no hit (give the canary a topology "
                             "of tensor_parallel 2 or more)")
        if self.topology is not None and self.role in ("golden", "control"):
            raise ValueError(f"a {self.role} config stays one unsharded server (no topology): the verdict compares "
                             "the sharded answers with the unsharded ones")
        if self.topology is not None and self.topology.ranks() == 1:
            raise ValueError("field 'topology': a topology of one rank is one unsharded server; leave the field out")
        return self


class ServingPath(Strict):
    """A serving path a user picks for a whole bench (`make bench SERVING_PATH=fp8-kv`): vLLM flags applied over
    every config's, as OVERRIDES are, but named, so that the report and run.json say which path each server ran.
    A config that sets one of its flags itself cannot take the path (rendering refuses it)."""

    description: str = Field(min_length=1, description="what the path serves differently, in a sentence")
    covers: str = Field(min_length=1, description="the upstream wrong-KV bug class it exercises")
    platforms: list[Platform] = Field(min_length=1, description="where vLLM runs it")
    flags: dict[str, FlagValue] = Field(min_length=1, description="vLLM flags every server of the bench gets")
    upstream: list[Link] = Field(default_factory=list, description="upstream reports of that bug class")

    _flags = field_validator("flags")(_check_flags)


class Matrix(Strict):
    platforms: dict[Platform, PlatformDefaults] = Field(description="per-platform server defaults")
    configs: list[StorageConfig]
    paths: dict[Annotated[str, Field(pattern=NAME)], ServingPath] = Field(
        default_factory=dict, description="serving paths a bench may pick (SERVING_PATH=), by name")

    def get(self, name: str) -> StorageConfig:
        for cfg in self.configs:
            if cfg.name == name:
                return cfg
        raise ConfigError(f"unknown config '{name}'; the matrix has: {', '.join(c.name for c in self.configs)}")

    def path(self, name: str, platform: Platform) -> ServingPath:
        """The serving path NAME on PLATFORM; refuses a name the matrix lacks and a path vLLM does not run there."""
        if name not in self.paths:
            raise ConfigError(f"unknown serving path '{name}'; the matrix has: {', '.join(self.paths) or 'none'}")
        if platform not in self.paths[name].platforms:
            raise ConfigError(f"serving path '{name}': field 'platforms': runs on {self.paths[name].platforms}, "
                              f"not on this platform ({platform})")
        return self.paths[name]

    def golden(self) -> StorageConfig:
        return next(c for c in self.configs if c.role == "golden")


def _store_refs(value) -> set[str]:
    if isinstance(value, str):
        return {part.split("}", 1)[0] for part in value.split("{store:")[1:]}
    if isinstance(value, dict):
        return set().union(*(_store_refs(v) for v in value.values()))
    if isinstance(value, list):
        return set().union(*(_store_refs(v) for v in value))
    return set()


def _describe(err: ValidationError, where: str) -> str:
    lines = []
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        lines.append(f"{where}: field '{field}': {e['msg']}")
    return "\n".join(lines)


def load(path: Path, base: Path | None = None) -> Matrix:
    """Read and validate the matrix, naming the config and field of every error. Relative folders (python_path)
    are resolved against `base`, by default the matrix file's folder (a copy's: its original's)."""
    try:
        raw = strict_yaml.load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read the matrix: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: the matrix must be a mapping with 'platforms' and 'configs'")
    raw_configs = raw.get("configs")
    if not isinstance(raw_configs, list) or not raw_configs:
        raise ConfigError(f"{path}: field 'configs' must be a non-empty list")

    errors, configs = [], []
    for index, item in enumerate(raw_configs):
        name = item.get("name", f"#{index}") if isinstance(item, dict) else f"#{index}"
        try:
            configs.append(StorageConfig.model_validate(item))
        except ValidationError as exc:
            errors.append(_describe(exc, f"config '{name}'"))
    raw_platforms = raw.get("platforms") or {}
    if not isinstance(raw_platforms, dict):
        raise ConfigError(f"{path}: field 'platforms' must be a mapping of platform to server defaults "
                          f"(cpu: {{flags: ..., env: ...}}), not a {type(raw_platforms).__name__}")
    platforms = {}
    for key, value in raw_platforms.items():
        try:
            platforms[key] = PlatformDefaults.model_validate(value)
        except ValidationError as exc:
            errors.append(_describe(exc, f"{path}: platform '{key}'"))
    matrix = None
    try:
        matrix = Matrix(platforms=platforms, configs=configs, paths=raw.get("paths") or {}) if not errors else None
    except ValidationError as exc:
        errors.append(_describe(exc, str(path)))
    for key in set(raw) - {"platforms", "configs", "paths"}:
        errors.append(f"{path}: field '{key}': unknown key")
    errors.extend(_cross_config_errors(configs))
    for cfg in configs:  # python_path: relative to the matrix file, and there
        cfg.python_path = [str((Path(base or Path(path).parent) / p).resolve()) for p in cfg.python_path]
        errors += [f"config '{cfg.name}': field 'python_path': {p} is not a folder" for p in cfg.python_path
                   if not Path(p).is_dir()]
    if errors or matrix is None:
        raise ConfigError("\n".join(errors))
    if sum(c.role == "golden" for c in matrix.configs) != 1:
        raise ConfigError(f"{path}: exactly one config must have role 'golden' (the cache-off reference)")
    if sum(c.role == "control" for c in matrix.configs) > 1:
        raise ConfigError(f"{path}: at most one config may have role 'control' (the second cache-off server)")
    if errors := _reset_errors(matrix) + _topology_errors(matrix):
        raise ConfigError("\n".join(errors))
    return matrix


def _reset_errors(matrix: Matrix) -> list[str]:
    """Configs with a cache whose servers would have no /reset_prefix_cache (vLLM mounts it only with
    VLLM_SERVER_DEV_MODE=1), so their cache could never be emptied between treatments."""
    errors = []
    for cfg in matrix.configs:
        for name in cfg.platforms if cfg.role in ("candidate", "canary") else []:
            defaults = matrix.platforms.get(name)
            if defaults is None:
                continue
            env = {**defaults.env, **cfg.env}
            exact = {**env, **defaults.exact.env} if defaults.exact else env
            if env.get("VLLM_SERVER_DEV_MODE") != "1" or exact.get("VLLM_SERVER_DEV_MODE") != "1":
                errors.append(f"config '{cfg.name}': field 'env': VLLM_SERVER_DEV_MODE must be \"1\" on platform "
                              f"'{name}' (here or in the platform's env): without it vLLM has no /reset_prefix_cache "
                              "and the cache is never emptied between treatments")
                break
    return errors


def _topology_errors(matrix: Matrix) -> list[str]:
    """Configs whose topology is larger than a platform they name runs (its `max_topology`)."""
    errors = []
    for cfg in (c for c in matrix.configs if c.topology):
        for name in (p for p in cfg.platforms if p in matrix.platforms):
            most = matrix.platforms[name].max_topology
            errors += [f"config '{cfg.name}': field 'topology': {field} {getattr(cfg.topology, field)} is more than "
                       f"platform '{name}' runs ({getattr(most, field)}; platforms.{name}.max_topology)"
                       for field in ("tensor_parallel", "pipeline_parallel")
                       if getattr(cfg.topology, field) > getattr(most, field)]
    return errors


def _cross_config_errors(configs: list[StorageConfig]) -> list[str]:
    errors: list[str] = []
    names: dict[str, StorageConfig] = {}
    ports: dict[int, str] = {}
    for cfg in configs:
        if cfg.name in names:
            errors.append(f"config '{cfg.name}': field 'name': duplicate of another config")
        names[cfg.name] = cfg
        if cfg.port in ports:
            errors.append(f"config '{cfg.name}': field 'port': {cfg.port} is already used by '{ports[cfg.port]}'")
        else:
            ports[cfg.port] = cfg.name
    errors += [f"config '{cfg.name}': field 'writer': no config named '{cfg.writer}'" for cfg in configs
               if cfg.writer is not None and (cfg.writer not in names or cfg.writer == cfg.name)]
    return errors


def select(matrix: Matrix, names: list[str], platform: Platform) -> list[StorageConfig]:
    """The configs to deploy, in the order asked; refuses unknown names and configs for another platform."""
    if not names:
        raise ConfigError("no configs selected")
    chosen = [matrix.get(n) for n in names]
    wrong = [c for c in chosen if platform not in c.platforms]
    if wrong:
        raise ConfigError(
            "\n".join(
                f"config '{c.name}': field 'platforms': runs on {c.platforms}, not on this platform ({platform})"
                for c in wrong
            )
        )
    if platform not in matrix.platforms:
        raise ConfigError(f"field 'platforms': no server defaults for platform '{platform}'")
    return chosen
