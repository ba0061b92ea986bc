"""The bench's plan, checked before anything starts: `kvscope bench` asks for a run (BenchOptions, its flags),
build() checks it and resolves it into a BenchPlan (the servers, in order, the scenarios at each load, the
workloads, the run folder), and treatments.run() carries the plan out. `kvscope bench --plan` prints it instead.

Nothing here starts a process or writes a file: bad input is refused (ConfigError, exit 2) before the run folder
exists. Endpoints kvscope did not deploy are asked what they serve (/v1/models), as the bench needs it.
"""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field
from tokenizers import Tokenizer

from kvscope import HARNESS, auth
from kvscope.artifacts import (
    Deployment,
    Failure,
    Load,
    Mode,
    Request,
    RunInfo,
    RunScenario,
    Scenario,
    Treatment,
    read_json,
)
from kvscope.commandline import RUN_ID, names
from kvscope.config.matrix import ROLE_ORDER, ConfigError
from kvscope.deploy.folder import LOCAL, DeploymentFolder
from kvscope.run import orphans
from kvscope.run.locustspec import LocustWorkers
from kvscope.run.workload import generate, load_scenarios
from kvscope.run.workload import read_jsonl as read_workload
from kvscope.runfolder import RunFolder

PHASES = ("prime", "measure")


class BenchOptions(BaseModel):
    """What the bench was asked for (`kvscope bench`'s flags, or the rollout gate's), before any check."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    results: Path = Path("results")  # the run folder goes to RESULTS/<run_id>
    scenarios_file: Path = HARNESS / "scenarios.yaml"
    scenarios: list[str]
    configs: list[str] = Field(default_factory=list)  # none: every deployed config
    deployments: list[Path] = Field(default_factory=list)  # none: the inventory's, else the embedded default's
    inventory: str | None = None
    worker_hosts: list[str] = Field(default_factory=list)  # none: the inventory's locust_workers
    ssh_config: str | None = None
    master_host: str = ""
    endpoints: list[str] = Field(default_factory=list)  # [NAME=]URL of servers kvscope did not deploy
    golden: str = ""
    control: str | None = None
    model_dir: Path = Path("models/tiny-qwen3")
    ca_file: str | None = None
    servers: list[Treatment] | None = None  # servers given as treatments (the rollout's gate), golden among them
    users: str = "2"  # as given: a number, or numbers separated by commas (a load sweep)
    repeats: int = 1
    processes: int = 1
    rate: float = 0.0
    timeout_s: float = 1800
    queries: int | None = None
    restart_cmd: str | None = None
    run_id: str | None = None
    resume: bool = False
    exact: bool = False
    command: str = ""  # the command line recorded in run.json, redacted


class BenchPlan(BaseModel):
    """A bench run, checked and resolved: what treatments.run() does, in order."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    run_id: str
    folder: Path
    resume: bool
    command: str  # redacted
    servers: list[Treatment]  # the treatments in order: golden, control, candidates, a canary's faults
    writers: dict[str, Treatment]  # shared scenarios: the server that stores what a config loads, by its config
    crashed: list[Failure]  # configs whose server did not come up: a row each in the report
    sources: dict[str, Scenario]  # the scenarios run, by name (--queries applied)
    scenarios: dict[str, RunScenario]  # the treatment columns, by label: a scenario at a load level, a repeat
    mode: Mode
    serving_path: str | None
    users: list[int]  # the load levels
    repeats: int
    processes: int
    rate: float
    timeout_s: float
    workers: LocustWorkers | None  # Locust workers on other hosts (None: all on this one)
    restart_cmd: str | None
    kv_capacity_tokens: int | None  # the smallest server's KV cache, which sizes the workloads
    workloads: dict[str, list[Request]] = Field(repr=False)  # each scenario's requests, by name

    def scenario(self, label: str) -> Scenario:
        return self.sources[self.scenarios[label].name]

    def users_of(self, label: str) -> int:
        """Locust's users for a column: its scenario's own, else the column's load level."""
        return self.scenario(label).users or self.scenarios[label].users or 1

    def restarts(self, server: Treatment, label: str) -> bool:
        """A restart scenario restarts a candidate's server between its phases."""
        return self.scenario(label).restart and server.role == "candidate"

    def store_fault(self, server: Treatment, label: str) -> str | None:
        """A store-fault scenario damages a candidate's stores between its phases."""
        return self.scenario(label).store_fault if server.role == "candidate" else None

    def writer(self, server: Treatment, label: str) -> Treatment | None:
        """The server a shared scenario's prime phase goes to (the config's writer), None for its own."""
        return self.writers.get(server.manifest.writer or "") if self.scenario(label).shared else None

    def phases(self, label: str) -> dict[str, list[Request]]:
        """A column's requests, by phase (a phase without requests left out)."""
        requests = self.workloads[self.scenarios[label].name]
        return {phase: part for phase in PHASES if (part := [r for r in requests if r.phase == phase])}

    def load(self) -> Load:
        return Load(users=self.users[0] if len(self.users) == 1 else self.users, repeats=self.repeats,
                    processes=self.processes, rate_sessions_per_s=self.rate,
                    locust_worker_hosts=self.workers.hosts if self.workers else [])

    def describe(self) -> str:
        """The plan for a person to read (`kvscope bench --plan`), every secret this process knows redacted."""
        load = (f"closed loop, {', '.join(map(str, self.users))} users" if not self.rate
                else f"open loop, {self.rate} sessions/s") + f"; {self.repeats} repeat(s)"
        locust = (f"workers on {', '.join(self.workers.hosts)} (master {self.workers.master_host})" if self.workers
                  else f"{self.processes} process(es) on this host")
        lines = [f"run {self.run_id}: {self.folder}" + (" (resumed: its finished treatments are kept)"
                                                        if self.resume else " (new)"),
                 f"command: {self.command}",
                 f"mode: {self.mode}; serving path: {self.serving_path or 'none'}; KV capacity for sizing: "
                 f"{self.kv_capacity_tokens or 'unknown'} tokens",
                 f"load: {load}; Locust: {locust}; at most {self.timeout_s:g} s a phase",
                 f"servers ({len(self.servers)} treatments, in order):"]
        for s in self.servers:
            shown = f" on {s.deployed_as}'s server" if s.deployed_as != s.config else ""
            lines.append(f"  {s.config:<24} {s.role:<9} {s.url}{shown}" + (f", fault {s.fault}" if s.fault else ""))
        lines += [f"  {f.config:<24} did not come up: {f.why}" for f in self.crashed]
        lines.append(f"scenarios ({len(self.scenarios)} columns):")
        for label in self.scenarios:
            sc, phases = self.scenario(label), self.phases(label)
            what = [f"{sc.kind}", f"{self.users_of(label)} users",
                    ", ".join(f"{phase} {len(part)} requests" for phase, part in phases.items())]
            what += [w for w, on in (("shared store", sc.shared), ("restart", sc.restart),
                                     (f"store fault {sc.store_fault}", sc.store_fault)) if on]
            lines.append(f"  {label:<24} {'; '.join(what)}")
        if self.restart_cmd and any(sc.restart for sc in self.sources.values()):
            lines.append(f"restart command: {self.restart_cmd}")
        lines.append(f"{len(self.servers) * len(self.scenarios)} treatments; nothing was started")
        return auth.redact_command("\n".join(lines))


def levels(text: str) -> list[int]:
    """--users: a load level, or levels separated by commas (a load sweep)."""
    try:
        return [int(u) for u in names(text)]
    except ValueError as exc:
        raise ConfigError(f"--users {text!r}: expected a number, or numbers separated by commas (a load sweep)") \
            from exc


def deployments_and_workers(options: BenchOptions) -> tuple[list[Path], LocustWorkers | None]:
    """The deployment.json of each host and the Locust workers (None: all local): the flags given, else the
    inventory's bench variables (deploy/inventory.py), else the embedded default's deployment."""
    from kvscope.deploy import inventory

    bench = inventory.bench_hosts(options.inventory) if options.inventory else inventory.BenchHosts("", [])
    deployments = (options.deployments or bench.deployments(options.run_id)
                   or [DeploymentFolder(LOCAL).deployment])
    workers = options.worker_hosts or bench.workers
    if not workers:
        return deployments, None
    master = options.master_host or bench.master
    if not master:
        raise ConfigError(f"Locust workers on {', '.join(workers)} need --master-host (or the inventory's "
                          "kvscope_locust_master): the address they reach this machine at")
    return deployments, LocustWorkers(hosts=workers, ssh_config=options.ssh_config or bench.ssh_config,
                                      master_host=master)


def given_servers(options: BenchOptions) -> list[Treatment] | None:
    """The servers given rather than deployed: the gate's treatments, or --endpoint's (asked what they serve);
    None for a deployment's."""
    if options.servers is not None:
        return options.servers
    if not (options.endpoints or options.golden):
        return None
    from kvscope.run import endpoints

    if not (options.endpoints and options.golden):
        raise ConfigError("--endpoint and --golden go together: the servers under test and the cache-off reference "
                          "their answers are compared with")
    if options.ca_file:  # read by every TLS context of this process and its Locust processes
        if not Path(options.ca_file).is_file():
            raise ConfigError(f"--ca-file {options.ca_file}: no such file")
        os.environ["SSL_CERT_FILE"] = str(Path(options.ca_file).resolve())
    return endpoints.treatments(options.endpoints, options.golden, options.control, options.model_dir)


def build(options: BenchOptions) -> BenchPlan:
    """Check a bench's options and resolve them into its plan; ConfigError names what is wrong."""
    if options.run_id is not None and not RUN_ID.match(options.run_id):
        raise ConfigError(f"--run-id {options.run_id!r} (RUN_ID): a run's folder name, letters, digits, '.', '_' "
                          "and '-', starting with a letter or digit")
    if options.resume and options.run_id and RunFolder(options.results / options.run_id).published_as is not None:
        raise ConfigError(f"--resume: {options.results / options.run_id} is a published run (its report.md is "
                          "tracked): new records would change it; resume a copy of it (its run.json keeps the "
                          "published run's id)")
    if options.resume and options.run_id and (resumed := RunFolder(options.results / options.run_id)).compressed:
        raise ConfigError(f"--resume: {resumed.root} was compressed (kvscope compress): a resume rewrites its "
                          f"workloads and appends to its status, plain; gunzip its files first (find {resumed.root} "
                          "-name '*.jsonl.gz' -exec gunzip {} +)")
    users = levels(options.users)
    deployments, workers = deployments_and_workers(options)
    given = given_servers(options)
    if not users or min(users) < 1 or options.repeats < 1:
        raise ConfigError(f"--users {users} and --repeats {options.repeats}: each must be at least 1")
    if workers and auth.api_key() and not os.environ.get(auth.KEY_FILE_ENV):
        raise ConfigError(f"Locust workers on other hosts read the API key from a file: set {auth.KEY_FILE_ENV} (the "
                          f"same path on every host) instead of {auth.KEY_ENV}; a key never goes on a command line")
    found, failed = load_deployments(deployments) if given is None else (given, {})
    by_name = {s.config: s for s in found}
    if len(by_name) != len(found):
        raise ConfigError("the same config is deployed on more than one host; give each host its own configs")
    configs = options.configs
    missing = [c for c in configs if c not in by_name and c not in failed]
    if missing:
        raise ConfigError(f"config(s) {missing} are not deployed (deployed: {sorted(by_name)}); run `make deploy`")
    chosen = [by_name[c] for c in configs if c in by_name] if configs else found
    crashed = [failed[c] for c in (configs or failed) if c in failed]  # a row each in the report, with why
    if not any(s.role == "golden" for s in chosen):
        raise ConfigError("no golden config (role 'golden', e.g. baseline) among the configs: fidelity needs it")
    chosen = treatments(chosen)
    if given is not None and options.exact:  # the owner of the endpoints says so; the control pair checks it
        chosen = [s.model_copy(update={"manifest": s.manifest.model_copy(update={"exact": True})}) for s in chosen]
    mode = serving_mode(chosen, options.exact)
    path = serving_path(chosen)
    all_scenarios = load_scenarios(options.scenarios_file)
    if options.queries is not None:
        if options.queries < 1:
            raise ConfigError(f"--queries {options.queries}: must be at least 1")
        all_scenarios = {n: sc.model_copy(update={"num_queries": options.queries}) for n, sc in all_scenarios.items()}
    unknown = [n for n in options.scenarios if n not in all_scenarios]
    if unknown:
        raise ConfigError(f"unknown scenario(s) {unknown}; known: {sorted(all_scenarios)}")
    sources = {n: all_scenarios[n] for n in options.scenarios}
    sharing = [s for s in chosen if s.manifest.writer and any(sc.shared for sc in sources.values())]
    if missing := [f"{s.config} (writer {s.manifest.writer})" for s in sharing if s.manifest.writer not in by_name]:
        raise ConfigError(f"shared scenarios send a config's prime phase to its writer's server, which is not "
                          f"deployed: {', '.join(missing)}")
    restarting = [n for n, sc in sources.items() if sc.restart]
    if restarting and not options.restart_cmd:
        raise ConfigError(f"scenario(s) {restarting} restart servers: give --restart-cmd (make bench sets it), a "
                          "command with {config} that restarts that config's server")
    hashes = {s.manifest.model_hash for s in chosen}
    if len(hashes) != 1:
        raise ConfigError(f"deployed servers serve different models ({sorted(hashes)}); outputs are not comparable")

    run_id = options.run_id or datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    folder = options.results / run_id
    if folder.exists() and not options.resume:
        raise ConfigError(f"run folder {folder} exists: its records would be mixed with new ones; choose another "
                          "RUN_ID, or continue that run with --resume")
    rf = RunFolder(folder)
    if options.resume and not rf.run_json.exists():
        raise ConfigError(f"--resume: {folder} has no run.json; nothing to continue")
    if options.resume and (pids := orphans.writers(folder)):
        raise ConfigError(f"--resume: process(es) {', '.join(map(str, pids))} still writes into {folder} (the "
                          "interrupted bench's Locust, or another bench): their records would mix with the resumed "
                          "run's; wait for them to end, or stop them")
    if options.resume:
        rf.check_folders()
    tokenizer = Tokenizer.from_file(str(Path(chosen[0].manifest.model_path) / "tokenizer.json"))
    capacity = min(s.manifest.kv_capacity_tokens or 0 for s in chosen) or None
    context = min((s.manifest.max_model_len for s in chosen if s.manifest.max_model_len), default=None)
    plan = BenchPlan(
        run_id=run_id, folder=folder, resume=options.resume, command=options.command, servers=chosen,
        writers={s.manifest.writer: by_name[s.manifest.writer] for s in sharing if s.manifest.writer},
        crashed=crashed, sources=sources,
        scenarios={label: run_scenario(sources[name], u, r)
                   for label, (name, u, r) in variants(options.scenarios, users, options.repeats).items()},
        mode=mode, serving_path=path, users=users, repeats=options.repeats, processes=options.processes,
        rate=options.rate, timeout_s=options.timeout_s, workers=workers, restart_cmd=options.restart_cmd,
        kv_capacity_tokens=capacity,
        workloads={n: generate(sc, tokenizer, capacity, context) for n, sc in sources.items()})
    share = len(workers.hosts) if workers else options.processes  # Locust's workers, each a share of the sessions
    if share > (fewest := min(plan.users_of(label) for label in plan.scenarios)):
        what = f"--worker-hosts ({share} hosts)" if workers else f"--processes {share}"
        raise ConfigError(f"{what}: more Locust processes than the {fewest} user(s) a scenario runs; one without a "
                          "user sends nothing, and its share of the sessions would wait out the time limit unsent")
    if options.resume and (changes := plan_changes(read_json(rf.run_json, RunInfo), plan)):
        raise ConfigError("--resume: the plan differs from run.json's (resume with the same scenarios, servers and "
                          "mode, or start another run):\n  " + "\n  ".join(changes))
    return plan


def load_deployments(paths: list[Path]) -> tuple[list[Treatment], dict[str, Failure]]:
    """Servers and failures of one or more deployments (one per host of a cluster); each server keeps the run
    folder its log is in."""
    found, failed = [], {}
    for path in paths:
        doc = read_json(Path(path), Deployment)
        found += [Treatment(config=s.config, manifest=s, run_dir=str(Path(path).parent)) for s in doc.servers]
        failed.update({f.config: f for f in doc.failed})
    return found, failed


def treatments(servers_: list[Treatment]) -> list[Treatment]:
    """What the bench runs, in order: golden, control, candidates, then one treatment per canary fault
    (config '<canary>-<fault>', on the canary's server)."""
    out = []
    for s in sorted(servers_, key=lambda s: ROLE_ORDER[s.role]):
        if s.role == "canary" and s.manifest.faults:
            out += [s.model_copy(update={"config": f"{s.config}-{f}", "fault": f}) for f in s.manifest.faults]
        else:
            out.append(s)
    return out


def serving_mode(servers_: list[Treatment], exact: bool) -> Mode:
    """'exact' when every server serves batch-invariant, 'normal' when none does; anything else is refused
    before a request is sent (one exact server beside normal ones proves nothing bitwise)."""
    plain = sorted({s.deployed_as for s in servers_ if not s.manifest.exact})
    if exact and plain:
        raise ConfigError(f"--exact: {', '.join(plain)} were deployed without exact mode; deploy them with "
                          "EXACT=1 (make deploy EXACT=1)")
    if plain and len(plain) < len({s.deployed_as for s in servers_}):
        raise ConfigError(f"{', '.join(plain)} serve in normal mode, the others batch-invariant (EXACT=1): deploy "
                          "them all in one mode")
    return "normal" if plain else "exact"


def serving_path(servers_: list[Treatment]) -> str | None:
    """The serving path (SERVING_PATH=) every server ran, None for none; servers of different paths are refused
    before a request is sent: golden on one path and a cache on another would judge the path, not the cache."""
    paths = {s.deployed_as: s.manifest.serving_path for s in servers_}
    if len(set(paths.values())) > 1:
        raise ConfigError("the servers' serving paths differ: " + ", ".join(
            f"{config} {path or 'none'}" for config, path in sorted(paths.items()))
            + "; deploy them all with one SERVING_PATH (make deploy SERVING_PATH=...)")
    return next(iter(paths.values()), None)


def run_scenario(scenario: Scenario, users: int, repeat: int) -> RunScenario:
    """A treatment column: the scenario at a load level and repeat, and the users Locust runs where it sets its
    own (a key only then: run.json keeps the keys it was given)."""
    doc = {**scenario.model_dump(), "users": users, "repeat": repeat}
    if scenario.users:
        doc["locust_users"] = scenario.users
    return RunScenario.model_validate(doc)


def variants(scenario_names: list[str], users: list[int], repeats: int) -> dict[str, tuple[str, int, int]]:
    """Label -> (scenario, users, repeat) of every treatment column of a run: a scenario's name alone, with
    `@u<users>` under a load sweep and `#<repeat>` when repeated (each repeat replays the same requests)."""
    return {name + (f"@u{u}" if len(users) > 1 else "") + (f"#{r}" if repeats > 1 else ""): (name, u, r)
            for r in range(1, repeats + 1) for u in users for name in scenario_names}


def _server_plan(server: Treatment) -> dict:
    """What a treatment's records depend on: where its server is, what it serves and how, on which stack."""
    m = server.manifest
    return {"role": m.role, "deployed_as": m.config, "fault": server.fault, "scheme": server.scheme, "host": m.host,
            "port": m.port, "served_model_name": m.served_model_name, "model_hash": m.model_hash,
            "server_args": m.server_args, "block_size": m.block_size, "prefix_caching": m.prefix_caching,
            "exact": m.exact, "vllm_version": m.vllm_version, "packages": m.packages, "tiers": m.tiers}


def _differences(was: dict, now: dict, fields: bool = False) -> list[str]:
    """'name (what differs)' for each key of either mapping whose value differs; with `fields`, each value's
    differing fields with their values."""
    out = []
    for name in sorted(was.keys() | now.keys()):
        if name not in was or name not in now:
            out.append(f"{name} ({'not in run.json' if name not in was else 'not now'})")
        elif was[name] != now[name]:
            keys = sorted(k for k in was[name].keys() | now[name].keys() if was[name].get(k) != now[name].get(k))
            what = [f"{k}: {was[name].get(k)} in run.json, {now[name].get(k)} now" for k in keys] if fields else keys
            out.append(f"{name} ({'; '.join(what) if fields else ', '.join(what)})")
    return out


def plan_changes(info: RunInfo, plan: BenchPlan) -> list[str]:
    """How a resume's plan differs from the one its run.json recorded (nothing: the same plan): the mode, the
    servers, the scenarios, and the workload files finished treatments replayed."""
    changes = [f"mode: {info.mode} in run.json, {plan.mode} now"] if info.mode != plan.mode else []
    if servers := _differences({s.config: _server_plan(s) for s in info.servers},
                               {s.config: _server_plan(s) for s in plan.servers}):
        changes.append("servers: " + ", ".join(servers))
    if differ := _differences({k: v.model_dump() for k, v in info.scenarios.items()},
                              {k: v.model_dump() for k, v in plan.scenarios.items()}, fields=True):
        changes.append("scenarios: " + ", ".join(differ))
    rf = RunFolder(plan.folder)
    workloads = [f"{label}.{phase}" for label in plan.scenarios for phase, part in plan.phases(label).items()
                 if not (path := rf.workload(label, phase)).is_file() or read_workload(path) != part]
    if workloads:
        changes.append(f"workloads: {', '.join(workloads)} (generated otherwise now)")
    return changes
