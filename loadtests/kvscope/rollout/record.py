"""The rollout record, results/<rollout-id>/rollout.json: the plan, every host's servers before and after each
batch, the gates' verdicts, the decisions and the time each step took. Written after every step, so a stopped
rollout says where it stopped and a re-run with its --id resumes from it.

    Rollout      the plan, the golden server the gates compare with, every host at the start and the end, batches
    Batch        its hosts, their servers before, after the change and after a rollback, gates, steps, decision
    HostState    what one host serves (a ServerState per config), as the rollout-state playbook read it
    GateResult   one host's gate: the bench's exit code, verdicts, and how many cache hits were wrong
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

from pydantic import Field, ValidationError

from kvscope.artifacts import Artifact, Manifest, RenderedServer, VerdictTier, read_json, write_json
from kvscope.auth import REDACTED, redact_args, redact_env
from kvscope.config.matrix import (
    FlagValue,
    Topology,
    arg_pairs,
    attention_backend_errors,
    cache_off_errors,
    flag_errors,
    whole_and_key_errors,
)
from kvscope.rollout.folder import RolloutFolder

BatchState = Literal["pending", "changing", "gating", "passed", "rolling-back", "rolled-back", "rollback-failed"]
Outcome = Literal["running", "completed", "stopped", "rollback-failed", "interrupted"]
GateTier = Literal["any", "exact"]  # the verdict tier a gate requires (--gate-tier)
# exit codes of `kvscope rollout` (and of `kvscope report` on a rollout folder)
EXIT_OK, EXIT_STOPPED, EXIT_BAD_INPUT, EXIT_INCONCLUSIVE, EXIT_ROLLBACK_FAILED = 0, 1, 2, 3, 4
EXIT_CODES = """exit codes of rollout (and of report on a rollout folder):
  0  rolled to every host, every gate passed
  1  stopped: a gate failed (FAIL, CRASHED, or inconclusive with --inconclusive stop); that batch was rolled back
     to what it served before and every other host left as it was
  2  bad input: the options, the inventory, the configs, no golden server, a host whose servers cannot be restored
     exactly, a matrix file edited since the rollout started (re-running its --id with the recorded content
     resumes it); or a rollout that is running, unfinished (without --id), resumed with other options than its
     record's, or whose record holds a definition the matrix's rules refuse
  3  rolled to every host, but some gate was inconclusive (--inconclusive continue)
  4  a rollback failed: a host serves neither the old nor the new version (the worst outcome; the lines say which)
  130, 143: stopped by Ctrl-C or SIGTERM between steps; the record says where, and re-running with its --id
     resumes it"""


ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # the matrix's EnvName


def now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


class ServerState(Artifact):
    """One config on one host: whether it serves, what it runs (redacted manifest, image), and what restores it."""

    config: str
    health: str  # "healthy", "running, not healthy", "failed: why", "stopped", ...
    manifest: Manifest | None = None
    rendered: RenderedServer | None = None  # exactly what it was started with: a rollback deploys this
    image: str | None = None  # container runtime


class HostState(Artifact):
    host: str
    run_dir: str
    runtime: str = "process"
    recorded_at: str = Field(default_factory=now)
    servers: dict[str, ServerState] = Field(default_factory=dict)
    error: str | None = None  # the host could not be read (unreachable, say)

    def serving(self, config: str) -> ServerState | None:
        s = self.servers.get(config)
        return s if s is not None and s.health == "healthy" else None


class Step(Artifact):
    name: str  # record, change, after, gate, rollback, restored
    started: str = Field(default_factory=now)
    seconds: float | None = None
    outcome: str = "running"  # ok, failed: why, interrupted
    log: str | None = None  # the playbook's output, relative to the rollout folder


class GateResult(Artifact):
    host: str
    folder: str  # the gate's bench run folder, relative to the rollout folder
    exit_code: int  # the bench's gate (verdicts.gate), or 1 when the new version did not start (CRASHED)
    verdicts: dict[str, str] = Field(default_factory=dict)  # config -> verdict
    why: dict[str, str] = Field(default_factory=dict)
    hits: int = 0  # scored cache hits of the rolled configs
    wrong_hits: int = 0  # of them, answers that differ from golden's (FAIL)
    verified_hits: int = 0
    tier: VerdictTier | None = None  # the verdict tier the gate judged on (its run.json's scorer); None: no verdict
    tier_required: GateTier = "any"  # --gate-tier: "exact" fails a gate whose verdict is statistical


class Batch(Artifact):
    index: int  # 1-based
    hosts: list[str]
    state: BatchState = "pending"
    before: dict[str, HostState] = Field(default_factory=dict)
    after: dict[str, HostState] = Field(default_factory=dict)
    restored: dict[str, HostState] = Field(default_factory=dict)
    gates: list[GateResult] = Field(default_factory=list)
    steps: list[Step] = Field(default_factory=list)
    decision: str | None = None  # continue, stopped and rolled back, rollback failed
    reason: str | None = None


class Rollout(Artifact):
    rollout_id: str
    command: str
    inventory: str
    configs: list[str]
    matrix: str
    matrix_sha256: str
    image: str | None = None
    extra_vars: list[str] = Field(default_factory=list)
    serial: str
    inconclusive: Literal["stop", "continue"] = "stop"
    gate: dict = Field(default_factory=dict)  # the gate's workload and options
    hosts: list[str]
    golden: dict[str, str] = Field(default_factory=dict)  # {"host": ..., "config": ...}
    started: str = Field(default_factory=now)
    finished: str | None = None
    outcome: Outcome = "running"
    interrupted: str | None = None
    initial: dict[str, HostState] = Field(default_factory=dict)
    final: dict[str, HostState] = Field(default_factory=dict)
    batches: list[Batch] = Field(default_factory=list)


def save(folder: Path, rollout: Rollout) -> None:
    """Write rollout.json atomically: a Ctrl-C never leaves half a record."""
    layout = RolloutFolder(folder)
    write_json(layout.record_tmp, rollout)
    os.replace(layout.record_tmp, layout.record)


def load(folder: Path) -> Rollout:
    return read_json(RolloutFolder(folder).record, Rollout)


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


# what a server is, for comparing and for the lines people read


def identity(s: ServerState | None) -> dict | None:
    """What makes a server the same version: arguments, environment, packages it installs, image (as recorded,
    redacted); None for no server."""
    if s is None or s.manifest is None:
        return None
    m = s.manifest
    return {"args": m.server_args, "env": m.env, "install": m.install, "image": s.image}


def digest(s: ServerState | None) -> str:
    ident = identity(s)
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:8] if ident else "-"


def restorable(manifest: Manifest, rendered: dict[str, RenderedServer]) -> RenderedServer | None:
    """What restores a running server exactly: its entry of the host's rendered.json when that is the very
    definition it runs (the manifest is that entry, redacted), else the manifest itself when nothing in it was
    redacted; None when neither is exact."""
    r = rendered.get(manifest.config)
    if (r is not None and r.port == manifest.port and redact_args(r.server_args) == manifest.server_args
            and redact_env(r.env) == manifest.env):
        return r
    if REDACTED in json.dumps([manifest.server_args, manifest.env]):
        return None
    return RenderedServer(**manifest.model_dump(include=set(RenderedServer.model_fields) - {"schema_version"}))


OWN_ARGS = ("--model", "--served-model-name", "--host", "--port")  # what the render puts first, in this order
KV_TRANSFER = "--kv-transfer-config"  # and last, from the config's kv_transfer_config


def definition_errors(s: ServerState) -> list[str]:
    """Why a rollback may not deploy what the record says restores `s` ([] when it may): it must be the
    definition its manifest records, with kvscope's own arguments first (and the kv-transfer config last) as
    the render puts them, and flags that the matrix's rules accept (none that kvscope owns, a golden or control
    server's cache off, ranks only from a topology the matrix accepts), as the render it came from checked them.
    A record is a file: it may have been edited."""
    r, m = s.rendered, s.manifest
    if r is None or m is None:
        return ["what it was started with is not recorded"]
    if (r.config != s.config or m.config != s.config or r.port != m.port or r.role != m.role
            or redact_args(r.server_args) != m.server_args or redact_env(r.env) != m.env):
        return ["its recorded definition is not the definition its manifest records"]
    pairs, errors = arg_pairs(r.server_args)
    own = dict(pairs[:len(OWN_ARGS)])
    if (list(own) != list(OWN_ARGS) or own["--served-model-name"] != r.served_model_name
            or own["--port"] != str(r.port)):
        return [f"its arguments do not start with kvscope's own ({', '.join(OWN_ARGS)}, in that order)"]
    rest = pairs[len(OWN_ARGS):]
    if rest and rest[-1][0] == KV_TRANSFER:  # the config's JSON, checked by the matrix's schema when rendered
        if r.role in ("golden", "control"):
            errors.append(f"a {r.role} server must be cache-off, but its record has a KV connector")
        rest = rest[:-1]
    if r.topology is not None:  # its ranks, last before the JSON as the render puts them, as its topology records
        if wrong := topology_errors(r.topology, r.role):
            return errors + wrong
        ranks, _ = arg_pairs(Topology.model_validate(r.topology).flags())
        if rest[-2:] != ranks:
            return [f"its topology flags are not the ranks its record names ({r.topology})"]
        rest = rest[:-2]
    flags: dict[str, FlagValue] = {}
    for flag, value in rest:
        if flag in flags:
            errors.append(f"flag '{flag}' is given twice")
        flags[flag] = value
    errors += flag_errors(flags) + whole_and_key_errors(flags) + attention_backend_errors(flags)
    if r.role in ("golden", "control"):
        errors += cache_off_errors(flags)
    return errors + [f"environment name {k!r} is not a plain variable name" for k in r.env if not ENV_NAME.match(k)]


def topology_errors(topology: dict, role: str) -> list[str]:
    """Why a recorded topology is not one the matrix accepts ([] when it is): whole ranks, more than one in all,
    and never on golden or control (they stay one unsharded server)."""
    if role in ("golden", "control"):
        return [f"a {role} server stays one unsharded server, but its record names a topology ({topology})"]
    try:
        ranks = Topology.model_validate(topology)
    except ValidationError as exc:
        return [f"its topology {topology} is not one the matrix accepts: "
                + "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())]
    return [] if ranks.ranks() > 1 else [f"its topology {topology} is one rank, not a sharded server"]


def connector(m: Manifest) -> str:
    """'KVScopeConnector (kvscope_connector.canary)', 'prefix cache', or 'no cache'."""
    if (ktc := m.kv_transfer_config) is not None:
        path = ktc.get("kv_connector_module_path")
        return ktc.get("kv_connector", "?") + (f" ({path})" if path else "")
    return "prefix cache" if m.prefix_caching else "no cache"


def describe(s: ServerState | None) -> str:
    """One server in a few words: 'kvscope-fs a1b2c3d4 KVScopeConnector (kvscope_connector), pid 123, healthy'."""
    if s is None:
        return "nothing"
    if s.manifest is None:
        return f"{s.config} ({s.health})"
    m = s.manifest
    where = f"image {s.image}" if s.image else f"pid {m.pid}"
    version = m.packages.get("kvscope-connector")
    return (f"{s.config} {digest(s)} {connector(m)}" + (f" kvscope-connector {version}" if version else "")
            + f", {where}, {s.health}")


def serves(state: HostState | None, configs: list[str]) -> str:
    if state is None:
        return "not recorded"
    if state.error:
        return f"unreadable ({state.error})"
    found = [describe(state.servers.get(c)) for c in configs if c in state.servers]
    return "; ".join(found) if found else f"no {', '.join(configs)}"


def same(a: HostState | None, b: HostState | None, configs: list[str] | None = None) -> bool:
    """Two recorded states serve the same versions of `configs` (default: every config of either), each either
    healthy in both or in neither."""
    if a is None or b is None:
        return False
    names = configs if configs is not None else sorted(set(a.servers) | set(b.servers))
    return all(identity(a.serving(c)) == identity(b.serving(c)) for c in names)


def restored(before: HostState | None, after: HostState | None, configs: list[str]) -> bool:
    """A rollback shown done: the host read, serving what it served before, and none of `configs` it did not
    serve then left there (a server that runs unhealthy, or one a failed teardown left, is not gone)."""
    return (before is not None and after is not None and after.error is None and same(before, after, configs)
            and not any(c in after.servers for c in configs if c not in before.servers))


def untouched(a: HostState | None, b: HostState | None) -> bool:
    """Not even restarted: the same versions, by the same processes (pid or container image)."""
    if not same(a, b) or a is None or b is None:
        return False
    pids = lambda st: {c: (s.manifest.pid if s.manifest else None) for c, s in st.servers.items()  # noqa: E731
                       if s.health == "healthy"}
    return pids(a) == pids(b)
