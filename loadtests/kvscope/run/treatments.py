"""`make bench`: every deployed config x every scenario, with the cache state controlled per treatment.

Per treatment: reset every tier (POST /reset_prefix_cache?reset_external=true, and wipe the config's
stores), then the optional prime phase, then the measure phase, with /metrics snapshots around each phase.
The golden config runs first, then the control; a canary server runs one treatment per fault class, named
<config>-<fault>, and its fault log is kept beside the records. At the end the golden server scores every
answer that split from its own (continuations.py). Faults are recorded in status rows; finished records are
never lost. A run folder is never reused: --resume continues one, keeping its finished treatments.
"""

from __future__ import annotations

import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from tokenizers import Tokenizer

from kvscope import HARNESS, auth, bounded_http
from kvscope.artifacts import (
    Deployment,
    Failure,
    Load,
    LocustPhase,
    Machine,
    Mode,
    Reset,
    RestartPhase,
    RunInfo,
    RunScenario,
    StatusRow,
    Treatment,
    append_jsonl,
    read_json,
    read_jsonl,
    write_json,
)
from kvscope.config.matrix import ROLE_ORDER, ConfigError
from kvscope.deploy import servers
from kvscope.deploy.folder import DeploymentFolder
from kvscope.files import replacing
from kvscope.run import continuations, locustspec, metrics, orphans, probe, storefaults
from kvscope.run.locustspec import LocustSpec, LocustWorkers
from kvscope.run.records import SESSION_LOST
from kvscope.run.workload import Request, generate, load_scenarios, sessions, write_jsonl
from kvscope.run.workload import read_jsonl as read_workload
from kvscope.runfolder import RunFolder

LOCUSTFILE = HARNESS / "locustfile.py"
WARM_UP_S = 300.0  # an idle CPU server's first answer; at most --timeout-s


def _post(url: str, timeout: float = 60) -> int:
    """The HTTP status of an empty POST (a redirect's own: it is not followed)."""
    try:
        return bounded_http.request(url, b"", timeout).status
    except bounded_http.Redirected as exc:
        return exc.status


def _snapshot(base: str) -> dict[str, float] | None:
    try:
        return metrics.scrape(base)
    except (urllib.error.URLError, OSError):
        return None


def reset(server: Treatment) -> Reset:
    """Empty every tier of one server: vLLM's prefix cache, the connector's cache, the config's stores."""
    base = server.url
    status: int | str
    try:
        status = _post(f"{base}/reset_prefix_cache?reset_external=true")
    except (urllib.error.URLError, OSError) as exc:
        status = type(exc).__name__
    wiped, refused = [], []
    root = DeploymentFolder(Path(server.run_dir).resolve()).stores if server.run_dir else None
    for name in sorted(server.manifest.stores) if server.manifest.store_reset == "wipe" else []:
        path = Path(server.manifest.stores[name]).resolve()
        if root is None or path == root or not path.is_relative_to(root):
            refused.append(name)  # a manifest pointing outside the run's stores folder: wipe nothing there
            continue
        if why := _wipe(path):
            refused.append(f"{name}: {why}")
        else:
            wiped.append(name)
    done = Reset(reset_prefix_cache_http=status, stores_wiped=wiped)
    if refused:
        done.stores_refused = refused
    return done


def _wipe(path: Path, passes: int = 20) -> str:
    """Remove everything under a store folder; "" when done, else why not. The live server may still be
    writing there (a connector's saves from the treatment before and from the warm-up land a moment after
    the reset), so what vanishes or refills meanwhile is removed again, a pass at a time."""
    error: OSError | None = None
    for _ in range(passes):
        try:
            for child in path.glob("*"):
                if child.is_dir() and not child.is_symlink():
                    shutil.rmtree(child)
                else:
                    child.unlink(missing_ok=True)
            return ""
        except OSError as exc:  # a file gone before its removal, or a folder refilled during it
            error = exc
            time.sleep(0.25)
    return f"still being written after {passes} passes ({error})"


def restart(server: Treatment, command: str) -> RestartPhase:
    """Restart a server between phases with the user's command ({config} filled in; no shell); what it did."""
    started = time.monotonic()
    argv = shlex.split(command.replace("{config}", server.deployed_as))
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
        code, tail = done.returncode, (done.stdout + done.stderr).strip().splitlines()[-3:]
    except (OSError, subprocess.TimeoutExpired) as exc:
        code, tail = None, [f"{type(exc).__name__}: {exc}"]
    return RestartPhase(restart_exit=code, seconds=round(time.monotonic() - started, 1), tail=tail if code else [])


def warm_up(server: Treatment, timeout_s: float = WARM_UP_S) -> None:
    """One throwaway request before the reset, so an idle server's slow first request is not measured (and the
    reset probe has a prompt the server held); its whole answer within `timeout_s`."""
    try:
        probe.complete(server, timeout_s)
    except (urllib.error.URLError, OSError, ValueError):
        pass  # a dead server shows up as failed records, with reasons, in the treatment itself


def machine() -> Machine:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    mem_kb = next(int(line.split()[1]) for line in Path("/proc/meminfo").read_text().splitlines()
                  if line.startswith("MemTotal"))
    return Machine(cpu=cpu, cores=os.cpu_count(), memory_gib=round(mem_kb / 2**20, 1), arch=platform.machine(),
                   os=platform.platform(), python=platform.python_version(), gpu=gpus())


def gpus() -> str | None:
    """GPU name, memory and driver from nvidia-smi; None on a machine without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return "; ".join(line.strip() for line in out.stdout.splitlines() if line.strip()) or None


def run_locust(server: Treatment, workload: Path, records: Path, users: int, processes: int, rate: float,
               timeout_s: float, remote: LocustWorkers | None = None, stats: Path | None = None,
               spec: Path | None = None) -> LocustPhase:
    """One headless Locust run of a workload file against one server; returns its status. Locust reads what to
    replay from a LocustSpec written to `spec` (default: beside the records). With `stats`, Locust's own CSV
    tables are kept under that prefix.

    remote: Locust's distributed mode across hosts: this process is the master, one worker per host started over
    ssh with the same options (the repository, the venvs, the workload and the spec at the same paths there);
    workers send their records to the master."""
    spec = Path(spec or Path(records).with_suffix(".spec.json")).resolve()
    spec.parent.mkdir(parents=True, exist_ok=True)
    write_json(spec, LocustSpec(
        workload=str(Path(workload).resolve()), records=str(Path(records).resolve()), config=server.config,
        block_size=server.manifest.block_size, model=server.manifest.served_model_name,
        workers=len(remote.hosts) if remote else max(1, processes), rate=rate, fault=server.fault,
        prompt_ids=server.role == "golden"))
    kvscope_args = ["-f", str(LOCUSTFILE), "--host", server.url, locustspec.FLAG, str(spec)]
    cmd = [sys.executable, "-m", "locust", *kvscope_args, "--headless", "-u", str(users), "-r", str(users),
           "-t", f"{int(timeout_s)}s", "--stop-timeout", "30", "--only-summary", "--loglevel", "WARNING"]
    if stats is not None:
        stats.parent.mkdir(parents=True, exist_ok=True)
        cmd += ["--csv", str(stats)]  # its HTML report embeds ~1 MB of scripts per phase: left out
    workers = []
    if remote:
        cmd += ["--master", "--master-bind-host", remote.master_host, "--expect-workers", str(len(remote.hosts)),
                "--expect-workers-max-wait", "120"]
        worker = [sys.executable, "-m", "locust", *kvscope_args, "--worker", "--master-host", remote.master_host,
                  "--loglevel", "WARNING"]
        files = [f"{k}={os.environ[k]}" for k in (auth.KEY_FILE_ENV, "SSL_CERT_FILE") if os.environ.get(k)]
        if files:  # the key file (never the key) and a CA file, at the same paths on every host
            worker = ["env", *files, *worker]
        ssh = ["ssh", "-F", remote.ssh_config] if remote.ssh_config else ["ssh"]
        workers = [subprocess.Popen([*ssh, host, shlex.join(worker)], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE, text=True, preexec_fn=orphans.dies_with_me())
                   for host in remote.hosts]
    elif processes > 1:
        cmd += ["--processes", str(processes)]
    started = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 180,  # kills it on Ctrl-C,
                              preexec_fn=orphans.dies_with_me())  # and the kernel does after a kill -9
    except BaseException:
        for w in workers:
            w.kill()
        raise
    worker_errors = []
    for w in workers:
        try:
            _, err = w.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            w.kill()
            _, err = w.communicate()
        if w.returncode not in (0, 1):
            worker_errors += err.strip().splitlines()[-3:]
    lost = [line for line in proc.stderr.splitlines() if SESSION_LOST in line]
    return LocustPhase(
        locust_exit=proc.returncode, seconds=round(time.monotonic() - started, 1),
        locust_stderr_tail=proc.stderr.strip().splitlines()[-5:] if proc.returncode not in (0, 1) else [],
        worker_errors=worker_errors, sessions_lost=len(lost), sessions_lost_tail=lost[-3:])


def _phase(server: Treatment, workload: Path, reqs: list[Request], records: Path, locust: Path, spec: Path,
           opts) -> LocustPhase:
    base = server.url
    before = _snapshot(base)
    row = run_locust(server, workload, records, opts["users"], opts["processes"], opts["rate"], opts["timeout_s"],
                     opts["remote"], locust, spec)
    after = _snapshot(base)
    row.metrics_delta = metrics.delta(before, after) if before is not None and after is not None else None
    row.metrics_error = None if row.metrics_delta is not None else "server did not answer /metrics"
    log = DeploymentFolder(Path(server.run_dir or ".")).server(server.deployed_as).log
    if row.metrics_error and log.exists():  # the server died mid-run: say why, from its own log
        row.server_error = servers.first_error(log.read_text(errors="replace"))
    row.sessions = len(sessions(reqs))
    row.requests = len(reqs)
    return row


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


def connector_log(server: Treatment, name: str) -> Path | None:
    """Where a server's connector writes a log (its kv-transfer-config's `name`: a canary's fault_log,
    kvscope's load_log), if anywhere."""
    extra = (server.manifest.kv_transfer_config or {}).get("kv_connector_extra_config", {})
    return Path(extra[name]) if extra.get(name) else None


def _done(status_path: Path) -> set[tuple[str, str]]:
    if not status_path.exists():
        return set()
    return {(row.config, row.scenario) for row in read_jsonl(status_path, StatusRow)}


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


def variants(scenario_names: list[str], users: list[int], repeats: int) -> dict[str, tuple[str, int, int]]:
    """Label -> (scenario, users, repeat) of every treatment column of a run: a scenario's name alone, with
    `@u<users>` under a load sweep and `#<repeat>` when repeated (each repeat replays the same requests)."""
    return {name + (f"@u{u}" if len(users) > 1 else "") + (f"#{r}" if repeats > 1 else ""): (name, u, r)
            for r in range(1, repeats + 1) for u in users for name in scenario_names}


def run(deployments: list[Path], results: Path, scenarios_file: Path, configs: list[str], scenario_names: list[str],
        users: int | list[int] = 4, processes: int = 1, rate: float = 0.0, timeout_s: float = 1800,
        command: str = "", run_id: str | None = None, remote: LocustWorkers | None = None, resume: bool = False,
        endpoints: list[Treatment] | None = None, repeats: int = 1, exact: bool = False,
        queries: int | None = None, restart_cmd: str | None = None) -> Path:
    """Run every scenario on every chosen server, deployed (`deployments`) or given as `endpoints`, at each
    load of `users` and `repeats` times; return the run folder. `exact`: the servers serve batch-invariant
    (deployed with EXACT=1, or endpoints their owner serves so), and the run is scored exactly. `queries`:
    every scenario's num_queries (more hits per treatment: a canary's power on more broken hits).
    `restart_cmd`: the command that restarts one config's server ({config} in it), for restart scenarios."""
    levels = [users] if isinstance(users, int) else list(users)
    if not levels or min(levels) < 1 or repeats < 1:
        raise ConfigError(f"--users {levels} and --repeats {repeats}: each must be at least 1")
    if remote and auth.api_key() and not os.environ.get(auth.KEY_FILE_ENV):
        raise ConfigError(f"Locust workers on other hosts read the API key from a file: set {auth.KEY_FILE_ENV} (the "
                          f"same path on every host) instead of {auth.KEY_ENV}; a key never goes on a command line")
    found, failed = load_deployments(deployments) if endpoints is None else (endpoints, {})
    by_name = {s.config: s for s in found}
    if len(by_name) != len(found):
        raise ConfigError("the same config is deployed on more than one host; give each host its own configs")
    missing = [c for c in configs if c not in by_name and c not in failed]
    if missing:
        raise ConfigError(f"config(s) {missing} are not deployed (deployed: {sorted(by_name)}); run `make deploy`")
    chosen = [by_name[c] for c in configs if c in by_name] if configs else found
    crashed = [failed[c] for c in (configs or failed) if c in failed]  # a row each in the report, with why
    if not any(s.role == "golden" for s in chosen):
        raise ConfigError("no golden config (role 'golden', e.g. baseline) among the configs: fidelity needs it")
    chosen = treatments(chosen)
    if endpoints is not None and exact:  # the owner of the endpoints says so; the control pair checks it
        chosen = [s.model_copy(update={"manifest": s.manifest.model_copy(update={"exact": True})}) for s in chosen]
    mode = serving_mode(chosen, exact)
    serving_path(chosen)
    all_scenarios = load_scenarios(scenarios_file)
    if queries is not None:
        if queries < 1:
            raise ConfigError(f"--queries {queries}: must be at least 1")
        all_scenarios = {n: sc.model_copy(update={"num_queries": queries}) for n, sc in all_scenarios.items()}
    unknown = [n for n in scenario_names if n not in all_scenarios]
    if unknown:
        raise ConfigError(f"unknown scenario(s) {unknown}; known: {sorted(all_scenarios)}")
    sharing = [s for s in chosen if s.manifest.writer and any(all_scenarios[n].shared for n in scenario_names)]
    if missing := [f"{s.config} (writer {s.manifest.writer})" for s in sharing if s.manifest.writer not in by_name]:
        raise ConfigError(f"shared scenarios send a config's prime phase to its writer's server, which is not "
                          f"deployed: {', '.join(missing)}")
    restarting = [n for n in scenario_names if all_scenarios[n].restart]
    if restarting and not restart_cmd:
        raise ConfigError(f"scenario(s) {restarting} restart servers: give --restart-cmd (make bench sets it), a "
                          "command with {config} that restarts that config's server")
    hashes = {s.manifest.model_hash for s in chosen}
    if len(hashes) != 1:
        raise ConfigError(f"deployed servers serve different models ({sorted(hashes)}); outputs are not comparable")

    run_id = run_id or datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    folder = Path(results) / run_id
    if folder.exists() and not resume:
        raise ConfigError(f"run folder {folder} exists: its records would be mixed with new ones; choose another "
                          "RUN_ID, or continue that run with --resume")
    rf = RunFolder(folder)
    if resume and not rf.run_json.exists():
        raise ConfigError(f"--resume: {folder} has no run.json; nothing to continue")
    if resume and (pids := orphans.writers(folder)):
        raise ConfigError(f"--resume: process(es) {', '.join(map(str, pids))} still writes into {folder} (the "
                          "interrupted bench's Locust, or another bench): their records would mix with the resumed "
                          "run's; wait for them to end, or stop them")
    rf.create()
    tokenizer = Tokenizer.from_file(str(Path(chosen[0].manifest.model_path) / "tokenizer.json"))
    capacity = min(s.manifest.kv_capacity_tokens or 0 for s in chosen) or None
    context = min((s.manifest.max_model_len for s in chosen if s.manifest.max_model_len), default=None)
    workloads = {n: generate(all_scenarios[n], tokenizer, capacity, context) for n in scenario_names}
    labels = variants(scenario_names, levels, repeats)
    phase_files = {}
    for label, (name, _, _) in labels.items():
        for phase in ("prime", "measure"):
            part = [r for r in workloads[name] if r.phase == phase]
            if part:
                phase_files[label, phase] = (rf.workload(label, phase), part)
    scenarios = {label: RunScenario(**{**all_scenarios[name].model_dump(), "users": u, "repeat": r})
                 for label, (name, u, r) in labels.items()}
    if resume and (changes := plan_changes(read_json(rf.run_json, RunInfo), chosen, scenarios, mode, phase_files)):
        raise ConfigError("--resume: the plan differs from run.json's (resume with the same scenarios, servers and "
                          "mode, or start another run):\n  " + "\n  ".join(changes))
    for path, part in phase_files.values():
        write_jsonl(part, path)
    if not resume:
        write_json(rf.run_json, RunInfo(
            run_id=run_id, command=command, machine=machine(), servers=chosen, crashed=crashed, scenarios=scenarios,
            load=Load(users=levels[0] if len(levels) == 1 else levels, repeats=repeats, processes=processes,
                      rate_sessions_per_s=rate, locust_worker_hosts=remote.hosts if remote else []),
            kv_capacity_tokens_for_sizing=capacity, mode=mode))

    opts = {"processes": processes, "rate": rate, "timeout_s": timeout_s, "remote": remote,
            "restart_cmd": restart_cmd}
    status_path = rf.status
    done = _done(status_path)
    total, step, where = len(chosen) * len(labels), 0, "the first treatment"
    try:
        for label, (name, level, _) in labels.items():
            for server in chosen:
                step += 1
                where = f"{server.config} x {label}"
                if (server.config, label) in done:
                    print(f"[{step}/{total}] {where}: done earlier (--resume)", flush=True)
                    continue
                users = all_scenarios[name].users or level
                restart = all_scenarios[name].restart and server.role == "candidate"
                store_fault = all_scenarios[name].store_fault if server.role == "candidate" else None
                writer = by_name.get(server.manifest.writer or "") if all_scenarios[name].shared else None
                _treatment(server, label, folder, phase_files,
                           {**opts, "users": users, "restart": restart, "writer": writer,
                            "store_fault": store_fault}, status_path,
                           f"[{step}/{total}] {where}")
        golden = next(s for s in chosen if s.role == "golden")
        where = "golden's continuations"
        print("golden scores the answers that split from its own ...", end="", flush=True)
        counts = continuations.collect(folder, golden, [s.config for s in chosen], list(labels),
                                       splits=mode != "exact")
        print(" " + ", ".join(f"{c} {n}" for c, n in counts.items() if n), flush=True)
    except BaseException as exc:  # Ctrl-C, or a crash: the folder says so; finished treatments stay intact
        why = f"{type(exc).__name__} during {where}" + (f": {exc}" if str(exc) else "")
        _set_interrupted(folder, why)
        raise Interrupted(folder, why, len(_done(status_path)), total) from exc
    _set_interrupted(folder, None)
    return folder


def _server_plan(server: Treatment) -> dict:
    """What a treatment's records depend on: where its server is, what it serves and how."""
    m = server.manifest
    return {"role": m.role, "deployed_as": m.config, "fault": server.fault, "scheme": server.scheme, "host": m.host,
            "port": m.port, "served_model_name": m.served_model_name, "model_hash": m.model_hash,
            "server_args": m.server_args, "block_size": m.block_size, "prefix_caching": m.prefix_caching,
            "exact": m.exact}


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


def plan_changes(info: RunInfo, servers_: list[Treatment], scenarios: dict[str, RunScenario], mode: Mode,
                 phase_files: dict) -> list[str]:
    """How a resume's plan differs from the one its run.json recorded (nothing: the same plan): the mode, the
    servers, the scenarios, and the workload files finished treatments replayed."""
    changes = [f"mode: {info.mode} in run.json, {mode} now"] if info.mode != mode else []
    if servers := _differences({s.config: _server_plan(s) for s in info.servers},
                               {s.config: _server_plan(s) for s in servers_}):
        changes.append("servers: " + ", ".join(servers))
    if differ := _differences({k: v.model_dump() for k, v in info.scenarios.items()},
                              {k: v.model_dump() for k, v in scenarios.items()}, fields=True):
        changes.append("scenarios: " + ", ".join(differ))
    workloads = [f"{label}.{phase}" for (label, phase), (path, part) in phase_files.items()
                 if not path.is_file() or read_workload(path) != part]
    if workloads:
        changes.append(f"workloads: {', '.join(workloads)} (generated otherwise now)")
    return changes


class Interrupted(Exception):
    """The bench stopped before its last treatment; the run folder says why and keeps what finished."""

    def __init__(self, folder: Path, why: str, finished: int, total: int):
        super().__init__(f"run interrupted ({why}); {finished} of {total} treatments finished and are kept in "
                         f"{folder}; continue it with --resume (make bench RESUME=1 RUN_ID={folder.name})")
        self.folder = folder

    @property
    def exit_code(self) -> int:
        """130 after Ctrl-C, 143 after SIGTERM (the shell's codes), 1 after a crash."""
        codes: dict[type, int] = {KeyboardInterrupt: 130, SystemExit: 143}
        return codes.get(type(self.__cause__), 1)


def _set_interrupted(folder: Path, why: str | None) -> None:
    run_json = RunFolder(folder).run_json
    info = read_json(run_json, RunInfo)
    if info.interrupted != why:
        write_json(run_json, info.model_copy(update={"interrupted": why}))


def reset_and_probe(server: Treatment) -> Reset:
    """Empty a server's tiers, then probe whether they are empty (the warm-up's prompt again). A server whose
    reset failed (one kvscope did not deploy has no /reset_prefix_cache) is not probed: its cache was never
    emptied, and the report says its cache state is not controlled."""
    cleared = reset(server)
    if cleared.reset_prefix_cache_http == 200:
        cleared.probe = probe.reset_probe(server)
    return cleared


def _treatment(server: Treatment, scenario: str, folder: Path, phase_files: dict, opts: dict, status_path: Path,
               progress: str) -> None:
    """Reset one server, run a scenario's phases on it, and append its status row."""
    rf = RunFolder(folder)
    records = rf.clear_records(server.config, scenario)  # a treatment cut short is run again
    print(f"{progress}: warm-up, reset", end="", flush=True)
    warm_up(server, min(WARM_UP_S, opts["timeout_s"]))  # an idle CPU server's first request is slow; keep that
    # out of cold TTFT
    cleared = reset_and_probe(server)
    writer = opts.get("writer")
    if writer is not None:  # a shared store: the writer stores what this server then loads
        cleared.writer, cleared.writer_reset = writer.config, reset(writer)
    row = StatusRow(config=server.config, scenario=scenario, reset=cleared)
    for phase in ("prime", "measure"):
        if phase == "measure" and opts.get("restart"):
            print(", restart", end="", flush=True)
            row.phases["restart"] = restart(server, opts["restart_cmd"])
        if phase == "measure" and opts.get("store_fault"):
            print(f", store fault {opts['store_fault']}", end="", flush=True)
            try:  # the tiers in front of the store emptied (its files stay), so the loads read the damage
                emptied: int | str = _post(f"{server.url}/reset_prefix_cache?reset_external=true")
            except (urllib.error.URLError, OSError) as exc:
                emptied = type(exc).__name__
            damaged = storefaults.damage(server, opts["store_fault"])
            damaged.reset_prefix_cache_http = emptied
            row.phases["store-fault"] = damaged
        if (scenario, phase) in phase_files:
            workload, part = phase_files[scenario, phase]
            target = server
            if phase == "prime" and writer is not None:
                target = writer.model_copy(update={"config": server.config})  # on the writer's server
                print(f", {phase} on {writer.config}", end="", flush=True)
            print(f", {phase} {len(part)} requests", end="", flush=True)
            row.phases[phase] = _phase(target, workload, part, records, rf.locust(server.config, scenario, phase),
                                       rf.locust_spec(server.config, scenario, phase), opts)
    if server.fault:
        row.fault_log = _keep_log(server, "fault_log", rf.faults(server.config, scenario))
    if connector_log(server, "load_log") is not None:
        row.load_log = _keep_log(server, "load_log", rf.loads(server.config, scenario))
    print(f" ({sum(p.seconds for p in row.phases.values()):.1f} s)", flush=True)
    append_jsonl(status_path, [row])


def _keep_log(server: Treatment, name: str, dest: Path) -> str:
    """Copy a connector's log of this treatment beside the records; say what happened."""
    src = connector_log(server, name)
    if src is None or not src.exists():
        return f"no {name} at {src}"
    dest.parent.mkdir(exist_ok=True)
    with open(src, "rb") as log, replacing(dest) as kept:  # a link at dest is replaced, not written through
        shutil.copyfileobj(log, kept)
    return "kept"
