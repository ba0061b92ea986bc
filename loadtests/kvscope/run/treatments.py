"""`make bench`: a checked plan (plan.py) carried out: every config x every scenario, with the cache state
controlled per treatment.

Per treatment (serverstate.py): reset every tier (POST /reset_prefix_cache?reset_external=true, and wipe the config's
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
from pathlib import Path

from kvscope import HARNESS, auth
from kvscope.artifacts import (
    LocustPhase,
    Machine,
    RunInfo,
    StatusRow,
    Treatment,
    append_jsonl,
    read_json,
    read_jsonl,
    write_json,
)
from kvscope.deploy import servers
from kvscope.deploy.folder import DeploymentFolder
from kvscope.files import replacing
from kvscope.run import continuations, locustspec, metrics, orphans, serverstate, storefaults
from kvscope.run.locustspec import LocustSpec, LocustWorkers
from kvscope.run.plan import PHASES, BenchPlan
from kvscope.run.records import SESSION_LOST
from kvscope.run.workload import sessions, write_jsonl
from kvscope.runfolder import RunFolder

LOCUSTFILE = HARNESS / "locustfile.py"


def _snapshot(base: str) -> dict[str, float] | None:
    try:
        return metrics.scrape(base)
    except (urllib.error.URLError, OSError):
        return None


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


def _phase(plan: BenchPlan, server: Treatment, label: str, phase: str, target: Treatment) -> LocustPhase:
    """One phase of a treatment: Locust against `target` (the server's own, or a shared store's writer), with
    the server's /metrics before and after."""
    rf = RunFolder(plan.folder)
    reqs = plan.phases(label)[phase]
    base = target.url
    before = _snapshot(base)
    row = run_locust(target, rf.workload(label, phase), rf.records(server.config, label), plan.users_of(label),
                     plan.processes, plan.rate, plan.timeout_s, plan.workers, rf.locust(server.config, label, phase),
                     rf.locust_spec(server.config, label, phase))
    after = _snapshot(base)
    row.metrics_delta = metrics.delta(before, after) if before is not None and after is not None else None
    row.metrics_error = None if row.metrics_delta is not None else "server did not answer /metrics"
    log = DeploymentFolder(Path(target.run_dir or ".")).server(target.deployed_as).log
    if row.metrics_error and log.exists():  # the server died mid-run: say why, from its own log
        row.server_error = servers.first_error(log.read_text(errors="replace"))
    row.sessions = len(sessions(reqs))
    row.requests = len(reqs)
    return row


def connector_log(server: Treatment, name: str) -> Path | None:
    """Where a server's connector writes a log (its kv-transfer-config's `name`: a canary's fault_log,
    kvscope's load_log), if anywhere."""
    extra = (server.manifest.kv_transfer_config or {}).get("kv_connector_extra_config", {})
    return Path(extra[name]) if extra.get(name) else None


def _done(status_path: Path) -> set[tuple[str, str]]:
    if not status_path.exists():
        return set()
    return {(row.config, row.scenario) for row in read_jsonl(status_path, StatusRow)}


def run(plan: BenchPlan) -> Path:
    """Carry out a plan (plan.build checked it): every scenario column on every server, golden's scoring of the
    answers that split from its own at the end; return the run folder."""
    folder, rf = plan.folder, RunFolder(plan.folder)
    rf.create()
    for label in plan.scenarios:
        for phase, part in plan.phases(label).items():
            write_jsonl(part, rf.workload(label, phase))
    if not plan.resume:
        write_json(rf.run_json, RunInfo(
            run_id=plan.run_id, command=plan.command, machine=machine(), servers=plan.servers, crashed=plan.crashed,
            scenarios=plan.scenarios, load=plan.load(), kv_capacity_tokens_for_sizing=plan.kv_capacity_tokens,
            mode=plan.mode))
    done = _done(rf.status)
    total, step, where = len(plan.servers) * len(plan.scenarios), 0, "the first treatment"
    try:
        for label in plan.scenarios:
            for server in plan.servers:
                step += 1
                where = f"{server.config} x {label}"
                if (server.config, label) in done:
                    print(f"[{step}/{total}] {where}: done earlier (--resume)", flush=True)
                    continue
                _treatment(plan, server, label, f"[{step}/{total}] {where}")
        golden = next(s for s in plan.servers if s.role == "golden")
        where = "golden's continuations"
        print("golden scores the answers that split from its own ...", end="", flush=True)
        counts = continuations.collect(folder, golden, [s.config for s in plan.servers], list(plan.scenarios),
                                       splits=plan.mode != "exact")
        print(" " + ", ".join(f"{c} {n}" for c, n in counts.items() if n), flush=True)
    except BaseException as exc:  # Ctrl-C, or a crash: the folder says so; finished treatments stay intact
        why = f"{type(exc).__name__} during {where}" + (f": {exc}" if str(exc) else "")
        _set_interrupted(folder, why)
        raise Interrupted(folder, why, len(_done(rf.status)), total) from exc
    _set_interrupted(folder, None)
    return folder


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


def _treatment(plan: BenchPlan, server: Treatment, label: str, progress: str) -> None:
    """Reset one server, run a column's phases on it, and append its status row."""
    rf = RunFolder(plan.folder)
    rf.clear_records(server.config, label)  # a treatment cut short is run again
    print(f"{progress}: warm-up, reset", end="", flush=True)
    serverstate.warm_up(server, min(serverstate.WARM_UP_S, plan.timeout_s))  # an idle CPU server's first request
    # is slow; keep that out of cold TTFT
    cleared = serverstate.reset_and_probe(server)
    writer = plan.writer(server, label)
    if writer is not None:  # a shared store: the writer stores what this server then loads
        cleared.writer, cleared.writer_reset = writer.config, serverstate.reset(writer)
    row = StatusRow(config=server.config, scenario=label, reset=cleared)
    phases = plan.phases(label)
    for phase in PHASES:
        if phase == "measure" and plan.restarts(server, label) and plan.restart_cmd:
            print(", restart", end="", flush=True)
            row.phases["restart"] = serverstate.restart(server, plan.restart_cmd)
        if phase == "measure" and (fault := plan.store_fault(server, label)):
            print(f", store fault {fault}", end="", flush=True)
            emptied = serverstate.empty_caches(server)  # the tiers in front of the store emptied (its files stay),
            # so the loads read the damage
            damaged = storefaults.damage(server, fault)
            damaged.reset_prefix_cache_http = emptied
            row.phases["store-fault"] = damaged
        if phase in phases:
            target = server
            if phase == "prime" and writer is not None:
                target = writer.model_copy(update={"config": server.config})  # on the writer's server
                print(f", {phase} on {writer.config}", end="", flush=True)
            print(f", {phase} {len(phases[phase])} requests", end="", flush=True)
            row.phases[phase] = _phase(plan, server, label, phase, target)
    if server.fault:
        row.fault_log = _keep_log(server, "fault_log", rf.faults(server.config, label))
    if connector_log(server, "load_log") is not None:
        row.load_log = _keep_log(server, "load_log", rf.loads(server.config, label))
    print(f" ({sum(p.seconds for p in row.phases.values()):.1f} s)", flush=True)
    append_jsonl(rf.status, [row])


def _keep_log(server: Treatment, name: str, dest: Path) -> str:
    """Copy a connector's log of this treatment beside the records; say what happened."""
    src = connector_log(server, name)
    if src is None or not src.exists():
        return f"no {name} at {src}"
    dest.parent.mkdir(exist_ok=True)
    with open(src, "rb") as log, replacing(dest) as kept:  # a link at dest is replaced, not written through
        shutil.copyfileobj(log, kept)
    return "kept"
