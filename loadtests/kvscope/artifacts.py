"""What travels between kvscope's stages, typed and versioned: every file one stage writes for another is
one of these models, and is read and written only here.

    rendered.json    Rendered        config -> deploy: what each server is started with
    manifest.json    Manifest        deploy -> run: a live server, read off it (block size, model, versions)
    failed.json      Failure         deploy -> run: a server that did not come up, and why
    deployment.json  Deployment      deploy -> run: the manifests and failures of one host
    workloads/*.jsonl  Request       run: the requests every config replays
    records/*.jsonl    Record        run -> analyze: one answer, measured
    continuations/*.jsonl Continuation run -> analyze: golden's logprobs of an answer
    faults/*.jsonl   FaultEvent      the canary connector -> analyze: what a request's loads really got
    loads/*.jsonl    LoadEvent       kvscope's connector -> analyze: which tier served each request's blocks
    status.jsonl     StatusRow       run -> analyze: one treatment's resets, Locust exit, counter deltas
    run.json         RunInfo         run -> analyze: the machine, the treatments (each with its server's
                                     Manifest), the scenarios, the scorer

Every model carries `schema_version`; a file written before versions existed reads as version 0 and is
brought up to date on reading (legacy()); a run.json is written back in the form it was read in. Unknown keys
are errors: a renamed field must not read as absent.
The parts of a model (each a Part: run.json's machine, scenarios, load and scorer, a status row's reset and
phases) carry no version of their own and are written with the keys they were given: a key an older file lacks
stays out.
"""

from __future__ import annotations

import gzip
import json
import zlib
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    ValidationError,
    model_serializer,
    model_validator,
)

from kvscope import files

SCHEMA_VERSION = 2  # 2: run.json nests each treatment's manifest (RunInfo)
Role = Literal["golden", "control", "candidate", "canary"]
Mode = Literal["normal", "exact"]  # exact: every server batch-invariant (EXACT=1)
# exact: the run proved invariance (exact mode, the control bitwise equal to golden); statistical: it did not
VerdictTier = Literal["exact", "statistical"]
TOPOLOGY_KEYS = ("tensor_parallel", "pipeline_parallel")  # a server's ranks, as config.matrix.Topology names them


class Verdict(StrEnum):
    """A config's verdict: analyze/verdicts.py says when each is given."""

    GOLDEN = "GOLDEN"
    PASS = "PASS"
    FAIL = "FAIL"
    INCOMPLETE = "INCOMPLETE"
    UNVERIFIED = "UNVERIFIED"
    INVALID = "INVALID"
    CRASHED = "CRASHED"


class Answer(StrEnum):
    """One answer's class against golden's: analyze/fidelity.py says when each is given."""

    IDENTICAL = "identical"
    BENIGN = "benign"
    FAIL = "FAIL"
    FAILED = "failed"  # the request failed: no answer
    NO_GOLDEN = "no-golden"
    INPUT_DIFFERS = "input-differs"
    NO_TOKEN_IDS = "no-token-ids"
    NO_LOGPROBS = "no-logprobs"  # tokens equal, but no logprobs to compare at some position: not verified
    UNVERIFIED = "unverified"  # a near tie golden could not score
Scheme = Literal["http", "https"]
A = TypeVar("A", bound="Artifact")


class ArtifactError(ValueError):
    """A file that is not the artifact it should be; the message names the file (and line)."""


class Artifact(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
    schema_version: int = SCHEMA_VERSION


class Part(BaseModel):
    """A part of an artifact: unknown keys are errors; written with the keys it was given, in field order (a
    key an older file lacks stays out)."""

    model_config = ConfigDict(extra="forbid")

    @model_serializer(mode="wrap")
    def _given_keys(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if k in self.model_fields_set}


# config -> deploy


DEFAULT_GPU_SHARE = 0.9  # vLLM's --gpu-memory-utilization when a config does not set it


def flag_value(args: list[str], flag: str) -> str | None:
    """The value a server's arguments give `flag` (`--flag V` as rendered, or `--flag=V`), else None."""
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            return args[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


class RenderedServer(Artifact):
    """A storage config rendered for one platform: everything a runtime starts it with."""

    config: str
    role: Role
    port: int
    platform: str
    served_model_name: str
    server_args: list[str]
    env: dict[str, str] = Field(default_factory=dict)
    stores: dict[str, str] = Field(default_factory=dict)
    store_reset: Literal["wipe", "keep"] = "wipe"
    faults: list[str] = Field(default_factory=list)
    install: list[str] = Field(default_factory=list)  # the config's packages, installed before the server starts
    upstream: list[str] = Field(default_factory=list)  # upstream reports about this path, for the report
    exact: bool = False  # served batch-invariant (the platform's exact mode)
    exact_workarounds: list[str] | None = None  # the upstream issues whose exact-mode workaround it runs (None:
    # not recorded, a run before 2026-12-06: written without the key, as it was)
    tiers: list[str] = Field(default_factory=list)  # the tiers it certifies (its connector's load log names them)
    writer: str | None = None  # shared-store scenarios: the config whose server writes what this one loads
    serving_path: str | None = None  # the matrix's serving path it ran (SERVING_PATH=); None: none, no key written
    topology: dict[str, int] | None = None  # its ranks ({tensor_parallel, pipeline_parallel}); None: one, no key

    @model_serializer(mode="wrap")
    def _unrecorded_out(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        out = handler(self)
        for key in ("exact_workarounds", "serving_path", "topology", "extensible_kv_cache"):  # the last: a Manifest's
            if out.get(key, []) is None:
                del out[key]
        return out

    @model_validator(mode="before")
    @classmethod
    def legacy(cls, data: Any) -> Any:
        """Version 0 (runs recorded before 2026-12): the served model name lives only in the arguments."""
        if isinstance(data, dict) and "served_model_name" not in data and "--served-model-name" in data.get(
                "server_args", [])[:-1]:
            args = data["server_args"]
            data = {**data, "served_model_name": args[args.index("--served-model-name") + 1]}
        return data

    @model_validator(mode="after")
    def _both_ranks(self) -> RenderedServer:
        """A topology names both ranks, as the render writes it (the report and the rollback read both)."""
        if self.topology is not None and set(self.topology) != set(TOPOLOGY_KEYS):
            raise ValueError(f"topology {self.topology}: names {' and '.join(TOPOLOGY_KEYS)}, nothing else")
        return self

    # What the arguments say, read in one place (run.json keeps only the arguments)
    @property
    def kv_transfer_config(self) -> dict | None:
        text = flag_value(self.server_args, "--kv-transfer-config")
        return None if text is None else json.loads(text)

    @property
    def dtype(self) -> str | None:
        return flag_value(self.server_args, "--dtype")

    @property
    def gpu_share(self) -> float:
        """The --gpu-memory-utilization it claims (vLLM's default where it sets none)."""
        value = flag_value(self.server_args, "--gpu-memory-utilization")
        return float(value) if value is not None else DEFAULT_GPU_SHARE


class Rendered(Artifact):
    kvscope_servers: list[RenderedServer]  # the key is the variable name the Ansible role loads it as


# deploy -> run


class Manifest(RenderedServer):
    """A deployed server, read off the live server."""

    host: str = "127.0.0.1"
    pid: int | None = None
    container: str | None = None
    vllm_version: str | None
    packages: dict[str, Any] = Field(default_factory=dict)
    connector_imports: dict[str, str] = Field(default_factory=dict)  # module -> "ok" or why it did not import
    kv_capacity_tokens: int | None
    extensible_kv_cache: bool | None = None  # vLLM 0.34+ on CUDA: KV sized after warm-up (None: not reported,
    # no key written)
    block_size: int
    prefix_caching: bool | None  # None: not known (an endpoint whose /metrics does not say)
    max_model_len: int | None = None
    model_path: str
    model_hash: str
    model_config_: dict[str, Any] | None = Field(default=None, alias="model_config")

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), populate_by_name=True)


class Failure(Artifact):
    config: str
    role: Role = "candidate"
    why: str
    error: str


class Deployment(Artifact):
    servers: list[Manifest] = Field(default_factory=list)
    failed: list[Failure] = Field(default_factory=list)


# run


class Scenario(BaseModel):
    """A named, parameterised workload profile (loadtests/kvscope/scenarios.yaml; run/workload.py makes its
    requests). Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]*$")
    kind: Literal["rag", "multiturn", "repeat", "trace", "reuse"]
    description: str = ""
    endpoint: Literal["chat", "completions"] = "chat"
    seed: int = 0
    num_docs: int = Field(default=32, ge=1, description="document pool size (ignored with working_set)")
    working_set: float | None = Field(
        default=None, gt=0, description="size the pool to this multiple of the servers' KV capacity"
    )
    doc_tokens_median: int = Field(default=160, ge=16, description="lognormal median document length")
    doc_tokens_sigma: float = Field(default=0.4, ge=0)
    docs_per_query: int = Field(default=3, ge=1, description="k documents per query")
    zipf_s: float = Field(default=1.0, ge=0, description="Zipf exponent of document popularity")
    order: Literal["canonical", "relevance"] = Field(
        default="canonical", description="canonical: sorted ids (prefix-friendly); relevance: shuffled"
    )
    num_queries: int = Field(default=24, ge=1, description="queries, or sessions for multiturn")
    turns: int = Field(default=3, ge=1, description="turns per multiturn session")
    tenants: int = Field(default=1, ge=1, description="distinct shared system prompts")
    system_prompt_tokens: int = Field(default=96, ge=0)
    repeats: int = Field(default=2, ge=1, description="repeat: how often the seed request is sent in a row")
    max_tokens: int = Field(default=16, ge=1)
    prime: Literal["none", "replay"] = Field(default="none", description="replay: send every request once first")
    # kind trace: a Mooncake-format trace (one JSON object a line: timestamp ms, input_length, output_length,
    # hash_ids of trace_block_tokens-token prefix blocks), replayed open loop at its own arrival times
    trace: str | None = Field(default=None, description="trace file; relative paths from the scenarios file")
    trace_block_tokens: int = Field(default=512, ge=1, description="tokens per hash id in the trace")
    block_tokens: int = Field(default=64, ge=1, description="tokens per hash id replayed (the length scale)")
    time_scale: float = Field(default=1.0, gt=0, description="multiplies the trace's arrival times")
    max_requests: int = Field(default=200, ge=1, description="the trace's first requests replayed")
    duration_s: float = Field(default=300.0, gt=0, description="requests arriving later are not replayed")
    users: int | None = Field(default=None, ge=1, description="Locust users for this scenario, over --users (a "
                              "trace's arrivals wait for a free user: give it its peak concurrency)")
    # kind reuse: a controlled hit rate, each prompt a shared prefix of `reuse` of its tokens and a unique rest
    reuse: float = Field(default=0.5, ge=0, le=1, description="share of every prompt that a shared prefix reuses")
    prompt_tokens: int = Field(default=512, ge=1, description="tokens per prompt (kind reuse)")
    prefixes: int = Field(default=4, ge=1, description="distinct shared prefixes, taken in turn (kind reuse)")
    shared: bool = Field(default=False, description="a config with a writer (matrix) gets its prime phase sent to "
                         "the writer's server and its measure phase to its own: it loads what another server stored")
    restart: bool = Field(default=False, description="restart each candidate's server between the prime phase "
                          "(which stores) and the measure phase (which loads): a persistent tier must still serve")
    store_fault: Literal["bitflip", "truncate", "swap", "unreadable"] | None = Field(
        default=None, description="damage every file a config's stores hold between the prime phase (which stores) "
        "and the measure phase (which loads): the tier must miss and recompute, or fail (run/storefaults.py)")

    @model_validator(mode="after")
    def _trace_has_a_file(self) -> Scenario:
        if (self.kind == "trace") != (self.trace is not None):
            raise ValueError("a trace scenario names its trace file (field 'trace'), and only a trace scenario does")
        if (self.restart or self.shared or self.store_fault) and self.prime != "replay":
            raise ValueError("a restart, shared or store_fault scenario needs prime: replay (the phase that stores "
                             "the blocks)")
        return self


class RunScenario(Part, Scenario):
    """A treatment column of run.json: its scenario's settings, the load level it ran at and which repeat;
    written with the keys it was given (a setting, or the level, that an older run did not record stays out)."""

    users: int | None = None  # the load level (--users)
    locust_users: int | None = None  # the users Locust ran where the scenario sets its own (over the level)
    repeat: int = 1


class Request(Artifact):
    """One request of a workload; a session's requests run in order on one user."""

    request_id: str
    scenario: str
    phase: Literal["prime", "measure"]
    session_id: str
    turn: int
    endpoint: Literal["chat", "completions"]
    max_tokens: int
    messages: list[dict] | None = None  # chat: this turn's new messages (earlier turns are added at run time)
    prompt: str | list[int] | None = None  # completions: text, or token ids (a replayed trace)
    arrival_s: float | None = None  # open loop: when to send it, from the phase's start (a replayed trace)
    doc_ids: list[int] = Field(default_factory=list)
    needle: str | None = None  # the string a correct answer contains
    with_history: bool = False  # chat: prepend the session's earlier turns, with the answers actually given


class Record(Artifact):
    """One answer, measured. Units are in the field names; None means "not reported", never 0."""

    model_config = ConfigDict(allow_inf_nan=False)  # an infinite TTFT or a NaN logprob measures nothing

    config: str
    scenario: str
    phase: str
    request_id: str
    session_id: str
    turn: int
    endpoint: str
    start_unix_s: float
    ok: bool = False
    error: str | None = None
    http_status: int | None = None
    ttft_s: float | None = None  # to the first chunk that carries a generated token
    e2e_s: float | None = None
    itl_s: list[float] = Field(default_factory=list)  # gaps between token-bearing chunks
    prompt_tokens: int | None = None  # server counts, from the usage chunk
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    finish_reason: str | None = None
    output_text: str = ""
    output_token_ids: list[int] = Field(default_factory=list)
    # per position: [[token, logprob], ...] best first; the token is an id (a string in version 0 records); the
    # logprob None where the server sent one that is not a finite number (NaN, ±inf: JSON has neither)
    top_logprobs: list[list[tuple[int | str, float | None]]] = Field(default_factory=list)
    prompt_sha: str | None = None  # sha256 of the prompt token ids: the exact input the server saw
    prompt_block_hashes: list[str] = Field(default_factory=list)  # chained, one per full block
    prompt_token_ids: list[int] | None = None  # kept for the golden config: continuations are scored on it
    needle: str | None = None
    worker: int = 0


class Continuation(Artifact):
    """Golden's logprobs of an answer, position by position from `start`: [[token id, logprob], ...]."""

    model_config = ConfigDict(allow_inf_nan=False)  # a NaN would make every comparison with golden's view pass

    request_id: str
    phase: str
    start: int
    logprobs: list[list[tuple[int, float]]]


class FaultEvent(Artifact):
    """One line of a canary's fault log (written by kvscope_connector.canary, which carries no version)."""

    request: str  # vLLM's request id: '<prefix>-<records.request_key>-<8 chars>'
    fault: str
    loaded: int
    changed: int  # blocks the KV cache held otherwise than verified, after the write
    inherited: int = 0  # blocks loaded that an earlier request computed on top of wrong KV
    distance: list[float] = []  # per changed block: its largest difference from the verified block, relative
    # to the layer's largest value (logs before it: absent)


class LoadEvent(Artifact):
    """One line of kvscope's connector's load log: the blocks each tier served one request in one step."""

    request: str  # vLLM's request id, as in FaultEvent
    ram: int = 0
    disk: int = 0
    missed: int = 0


class ResetProbe(Part):
    """After a reset, the prompt the server answered just before it (the warm-up's) sent again: what each counter
    kvscope reads says was reused (every one must say 0). None of them exposed: the reset is unverified."""

    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens; None: the answer had none
    counters: dict[str, float] | None = None  # /metrics over the probe (hit counters only); None: no /metrics
    error: str | None = None  # the probe got no answer


class Reset(Part):
    """How one server's tiers were emptied before a treatment."""

    reset_prefix_cache_http: int | str  # the endpoint's HTTP status, or the error that reached none
    stores_wiped: list[str] = Field(default_factory=list)
    stores_refused: list[str] = Field(default_factory=list)  # not wiped: outside the run's stores, or still written
    writer: str | None = None  # a shared store: the config whose server wrote it, reset too
    writer_reset: Reset | None = None
    probe: ResetProbe | None = None  # whether the reset really emptied the tiers (absent before probes existed)


class LocustPhase(Part):
    """One phase's Locust run: its exit, the server's counter deltas, what went wrong. None: not recorded."""

    locust_exit: int
    seconds: float
    locust_stderr_tail: list[str] = Field(default_factory=list)  # on an exit other than 0 or 1
    worker_errors: list[str] = Field(default_factory=list)  # distributed mode: the workers' failing stderr
    sessions_lost: int | None = None
    sessions_lost_tail: list[str] = Field(default_factory=list)
    metrics_delta: dict[str, float] | None = None  # /metrics over the phase (metrics.delta)
    metrics_error: str | None = None
    server_error: str | None = None  # the server's log, when it stopped answering /metrics
    sessions: int | None = None
    requests: int | None = None


class RestartPhase(Part):
    """A server restarted between the prime and the measure phase (restart scenarios)."""

    restart_exit: int | None  # None: the command did not run, or timed out
    seconds: float
    tail: list[str] = Field(default_factory=list)  # the command's last lines, when it failed


class StoreFaultPhase(Part):
    """Store-fault scenarios: the stored files damaged between the prime and the measure phase."""

    fault: str
    files: int  # files damaged
    how: str  # what was done to each, or why nothing was
    seconds: float = 0.0  # waiting for the saves to land, and the damage
    reset_prefix_cache_http: int | str | None = None  # the tiers in front of the store emptied first


class StatusRow(Artifact):
    """One treatment: how its tiers were reset, and each phase's Locust exit, counters and faults."""

    config: str
    scenario: str
    reset: Reset | None = None
    phases: dict[str, LocustPhase | RestartPhase | StoreFaultPhase] = Field(default_factory=dict)  # prime, restart
    # or store-fault, measure
    fault_log: str | None = None
    load_log: str | None = None  # what became of the connector's load log of this treatment

    def metrics_delta(self) -> dict[str, float] | None:
        """The measure phase's counter deltas; None where it did not run or the server did not answer."""
        measure = self.phases.get("measure")
        return measure.metrics_delta if isinstance(measure, LocustPhase) else None


class Treatment(BaseModel):
    """A treatment the bench runs: a deployed config, or one fault class of a canary server, on the server its
    manifest describes."""

    model_config = ConfigDict(extra="forbid")
    config: str  # the treatment's name: its config, or '<canary>-<fault>'
    manifest: Manifest  # the server it runs on; manifest.config is the config that server was deployed as
    run_dir: str | None = None  # the deployment folder its log is in
    fault: str | None = None
    scheme: Scheme = "http"  # https: an endpoint kvscope did not deploy
    _flat_deployed_as_own_name = PrivateAttr(False)  # a flat file named deployed_as although it is `config`

    @staticmethod
    def unflatten(data: dict[str, Any]) -> dict[str, Any]:
        """Versions 0 and 1 (runs recorded before 2026-12-04): a treatment is one flat object, its manifest's
        fields beside its own (the flat form was a Manifest of version 1 where it names none), the server's
        config in `deployed_as` where the treatment is named otherwise."""
        own: dict[str, Any] = {k: data[k] for k in ("run_dir", "fault", "scheme") if k in data}
        manifest = {k: v for k, v in data.items() if k not in (*own, "deployed_as")}
        return {**own, "config": data.get("config"),
                "manifest": {"schema_version": 1, **manifest, "config": data.get("deployed_as") or data.get("config")}}

    def flat(self) -> dict[str, Any]:
        """The treatment as versions 0 and 1 wrote it (unflatten())."""
        own = self.model_dump(include={"run_dir", "fault", "scheme"})
        named = self.deployed_as != self.config or self._flat_deployed_as_own_name
        return {**self.manifest.model_dump(by_alias=True), "config": self.config, "run_dir": own["run_dir"],
                "deployed_as": self.deployed_as if named else None, "fault": own["fault"], "scheme": own["scheme"]}

    @property
    def role(self) -> Role:
        return self.manifest.role

    @property
    def deployed_as(self) -> str:
        """The config its server was deployed as (a canary's treatments share one server)."""
        return self.manifest.config

    @property
    def url(self) -> str:
        return root_url(self.scheme, self.manifest.host, self.manifest.port)


def root_url(scheme: Scheme, host: str, port: int) -> str:
    """A server's root URL (an IPv6 address in brackets)."""
    return f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"


class Machine(Part):
    """The machine the bench ran on."""

    cpu: str
    cores: int | None  # os.cpu_count()
    memory_gib: float
    arch: str
    os: str
    python: str
    gpu: str | None  # nvidia-smi's name, memory and driver of each GPU; None without one


class Load(Part):
    """The load the bench offered."""

    users: int | list[int]  # a list: a load sweep, one treatment per level
    repeats: int = 1
    processes: int
    rate_sessions_per_s: float  # 0: closed loop
    locust_worker_hosts: list[str] = Field(default_factory=list)


class Difference(Part):
    """One measured difference behind a noise floor (fidelity.Deviation)."""

    pair: str
    request: str
    position: int | None
    nats: float


class Scorer(Part):
    """How a report scored the run (analyze/report.py): the scorer and its gate thresholds, then the run's
    noise floors, the tolerances they give, and the largest differences behind them."""

    version: int
    min_verified_hits: int
    max_failed_share: float
    mode: Mode
    direct_noise_nats: float | None  # None: not measured (no control)
    continuation_noise_nats: float | None
    tolerance_nats: float
    continuation_tolerance_nats: float
    tie_band_nats: float
    source: str  # where the tolerance came from, in words
    control_answers: int
    control_differing: int
    golden_rescored: int
    largest_differences: list[Difference]
    tier: VerdictTier | None = None  # the verdict's tier (analyze/verdicts.tier); None in files written before tiers
    tier_why: str | None = None


class RunInfo(Artifact):
    run_id: str
    command: str
    machine: Machine
    servers: list[Treatment]
    crashed: list[Failure] = Field(default_factory=list)
    scenarios: dict[str, RunScenario]  # by column label (plan.variants)
    load: Load
    kv_capacity_tokens_for_sizing: int | None = None
    scorer: Scorer | None = None  # written by the report
    mode: Mode = "normal"
    interrupted: str | None = None  # why the bench stopped early; the treatments in status.jsonl are intact

    @model_validator(mode="wrap")
    @classmethod
    def _flat_before_2(cls, data: Any, handler: ModelWrapValidatorHandler[RunInfo]) -> RunInfo:
        """Versions 0 and 1 hold flat treatments (Treatment.unflatten), version 2 and later nested ones; a file
        that mixes its version and form is refused."""
        version = data.get("schema_version", SCHEMA_VERSION) if isinstance(data, dict) else None
        servers = data.get("servers") if isinstance(data, dict) else None
        if not isinstance(version, int) or not isinstance(servers, list):
            return handler(data)
        flat = version < 2
        if any(isinstance(s, dict) and ("manifest" in s) == flat for s in servers):
            form = "flat (its manifest's fields beside its own)" if flat else "nests its server's manifest"
            raise ValueError(f"schema_version {version}: each treatment is {form}")
        if not flat:
            return handler(data)
        run = handler({**data, "servers": [Treatment.unflatten(s) if isinstance(s, dict) else s for s in servers]})
        for treatment, given in zip(run.servers, servers, strict=True):
            treatment._flat_deployed_as_own_name = given.get("deployed_as") == treatment.config
        return run

    @model_serializer(mode="wrap")
    def _as_read(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """A run.json of version 0 or 1 is written back in its own form, each treatment flat (Treatment.flat),
        so a published run re-renders byte for byte."""
        data = handler(self)
        if self.schema_version < 2:
            data["servers"] = [s.flat() for s in self.servers]
        return data

    def golden(self) -> Treatment:
        return next(s for s in self.servers if s.role == "golden")


# reading and writing


def dumps(model: Artifact) -> str:
    return json.dumps(model.model_dump(by_alias=True), ensure_ascii=False, sort_keys=True)


def read_json(path: Path, cls: type[A]) -> A:
    """A JSON artifact: a regular file (no link) of at most files.MAX_LINE_BYTES."""
    try:
        return cls.model_validate(_versioned(json.loads(files.read_bytes(path))))
    except files.UnsafeFile:
        raise
    except (OSError, ValueError, RecursionError) as exc:  # nested past Python's stack
        raise ArtifactError(f"{path}: not a kvscope {cls.__name__}: {exc}") from exc


def write_json(path: Path, model: Artifact) -> None:
    """Write a JSON artifact whole or not at all (files.replace): a kill or a full disk keeps the old file."""
    files.replace(path, json.dumps(model.model_dump(by_alias=True), indent=2, ensure_ascii=False) + "\n")


class Rows(list[A]):
    """A JSONL file's rows; `torn`: the bytes of a last line cut short (no newline: a full disk or a kill while
    it was written), set aside."""

    torn: int = 0


def read_jsonl(path: Path, cls: type[A]) -> Rows[A]:
    """Every row of a JSONL file (gzipped where its name ends in .gz), a regular file within files' bounds; a last
    line without its newline is set aside and counted (Rows.torn). A truncated or foreign line before it, or a
    broken gzip stream, is an error naming the file (and line)."""
    out: Rows[A] = Rows()
    try:
        for n, line in enumerate(files.lines(path), 1):
            if not line.endswith(b"\n"):
                out.torn = len(line)
                break
            try:
                out.append(cls.model_validate(_versioned(json.loads(line))))
            except (json.JSONDecodeError, UnicodeDecodeError, ValidationError, RecursionError) as exc:
                raise ArtifactError(f"{path}:{n}: truncated or not a kvscope {cls.__name__}: {exc}") from exc
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise ArtifactError(f"{path}: a truncated or broken gzip file: {exc}") from exc
    return out


def append_jsonl(path: Path, rows) -> None:
    """Append rows (models, or their dicts from another process) to a JSONL file, a regular file (no link); a
    last line an earlier write cut short is cut off first (files.open_append)."""
    with files.open_append(path) as f:
        for row in rows:
            text = dumps(row) if isinstance(row, Artifact) else json.dumps(row, ensure_ascii=False)
            f.write(text.encode() + b"\n")


def _versioned(data: Any) -> Any:
    """Version 0 files carry no schema_version: they read as version 0 and are brought up to date by each
    model's legacy() hook."""
    if isinstance(data, dict) and "schema_version" not in data:
        return {**data, "schema_version": 0}
    return data
