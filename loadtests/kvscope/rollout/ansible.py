"""A rollout's hands: kvscope's own playbooks, one batch of hosts at a time (`--limit`), each run in a session of
its own so that Ctrl-C reaches the rollout, which stops between steps, and not a playbook halfway through a task.

    state    ansible/rollout-state.yml: what each host serves (deployment, rendered definitions, health, images)
    change   teardown.yml for the rolled configs only, then deploy.yml with the new matrix (the batch's copy of it),
             configs or image
    restore  teardown.yml for the rolled configs, then deploy.yml with the definitions recorded before the change
"""

from __future__ import annotations

import base64
import json
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

from pydantic import ValidationError

from kvscope import REPO
from kvscope.artifacts import Deployment, Rendered, RenderedServer, write_json
from kvscope.auth import extra_var_secrets, redact_command
from kvscope.deploy.folder import DEPLOYMENT, RENDERED
from kvscope.rollout.folder import BatchFolder, host_state
from kvscope.rollout.record import HostState, ServerState, restorable

ANSIBLE_DIR = REPO / "ansible"
BIN = Path(sys.executable).parent
STATUS_LINE = re.compile(r"^(\S+)\s+port (\S+)\s+pid (\S+)\s+(.*)$")


class RolloutError(ValueError):
    """Bad input: the rollout changes nothing (exit 2)."""


def run(cmd: list[str], log: Path, env: dict[str, str] | None = None, secrets: list[str] | None = None) -> int:
    """Run `cmd` in a session of its own, its output into `log` after the command line (redacted: `secrets` and
    whatever else looks secret); on KeyboardInterrupt (a second Ctrl-C) stop its process group and re-raise."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        out.write(f"$ {redact_command(shlex.join(cmd), secrets or [])}\n")
        out.flush()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
        try:
            return proc.wait()
        except BaseException:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise


def _env() -> dict[str, str]:
    """kvscope's ansible.cfg; pipelining (fewer ssh round trips per task: a rollout runs many short playbooks)."""
    return {"ANSIBLE_PIPELINING": "True", **os.environ, "ANSIBLE_CONFIG": str(ANSIBLE_DIR / "ansible.cfg"),
            "ANSIBLE_NOCOLOR": "1"}


class Ansible:
    """The playbook runs of one rollout: `extra` are the user's extra vars (-e ...) for every playbook; the values
    they give secret-looking names are redacted in the logs."""

    def __init__(self, inventory: str, extra: list[str], matrix: Path, configs: list[str], image: str | None):
        self.inventory, self.extra, self.matrix, self.configs, self.image = inventory, extra, matrix, configs, image
        self.secrets = extra_var_secrets(extra)

    def playbook(self, name: str, hosts: list[str], extra: list[str], log: Path) -> int:
        cmd = [str(BIN / "ansible-playbook"), "-i", self.inventory, str(ANSIBLE_DIR / name), "--limit",
               ",".join(hosts)]
        for e in [*self.extra, *extra]:
            cmd += ["-e", e]
        return run(cmd, log, _env(), self.secrets)

    def state(self, hosts: list[str], dest: Path, log: Path) -> dict[str, HostState]:
        """What each host serves now; a host that could not be read gets a state with `error`."""
        dest.mkdir(parents=True, exist_ok=True)
        for old in dest.glob(host_state(Path(), "*").name):
            old.unlink()
        rc = self.playbook("rollout-state.yml", hosts, [f"rollout_state_to={dest.resolve()}"], log)
        out = {}
        for host in hosts:
            path = host_state(dest, host)
            if not path.exists():
                out[host] = HostState(host=host, run_dir="?", error=f"not read (rollout-state.yml exit {rc}; {log})")
                continue
            try:
                out[host] = parse_state(json.loads(path.read_text()))
            except (ValueError, ValidationError) as exc:
                out[host] = HostState(host=host, run_dir="?", error=f"{path}: {str(exc)[:300]}")
        return out

    def change(self, hosts: list[str], matrix: Path, log: Path) -> int:
        """Stop the rolled configs' servers on `hosts`, then deploy the new version of them from `matrix`, a copy
        of self.matrix whose relative paths stay those of self.matrix's folder."""
        configs = ",".join(self.configs)
        rc = self.playbook("teardown.yml", hosts, [f"teardown_configs={configs}"], log)
        if rc != 0:
            return rc
        new = [f"kvscope_matrix={matrix.resolve()}", f"vllm_matrix_dir={self.matrix.resolve().parent}",
               f"vllm_configs={configs}"]
        return self.playbook("deploy.yml", hosts, new + ([f"vllm_image={self.image}"] if self.image else []), log)

    def restore(self, before: HostState, folder: Path, log: Path) -> int:
        """Stop the rolled configs' servers on one host, then start exactly what it served before (nothing,
        where it served none of them)."""
        host = before.host
        rc = self.playbook("teardown.yml", [host], [f"teardown_configs={','.join(self.configs)}"], log)
        old = [s for c in self.configs if (s := before.serving(c)) is not None]
        groups: dict[tuple[str | None, str], list[ServerState]] = {}
        for s in old:
            assert s.rendered is not None and s.manifest is not None  # checked before the change
            groups.setdefault((s.image, s.manifest.model_path), []).append(s)
        for n, ((image, model), servers) in enumerate(groups.items()):
            source = BatchFolder(folder).restore_source(host, n)
            write_json(source, Rendered(kvscope_servers=[s.rendered for s in servers if s.rendered is not None]))
            extra = [f"vllm_rendered_source={source.resolve()}", f"vllm_configs={','.join(s.config for s in servers)}",
                     f"kvscope_model_dir={model}"] + ([f"vllm_image={image}"] if image else [])
            rc = self.playbook("deploy.yml", [host], extra, log) or rc
        return rc


def parse_state(doc: dict) -> HostState:
    """A host's rollout-state.yml file -> HostState: every server it runs or failed to start, with its health,
    its image and what restores it."""
    files = {name: json.loads(base64.b64decode(text)) for name, text in doc.get("files", {}).items()}
    deployment = Deployment.model_validate(files.get(DEPLOYMENT) or {})
    rendered: dict[str, RenderedServer] = {}
    if files.get(RENDERED):
        rendered = {r.config: r for r in Rendered.model_validate(files[RENDERED]).kvscope_servers}
    health = {m.group(1): m.group(4).strip() for line in doc.get("status", []) if (m := STATUS_LINE.match(line))}
    images = {}
    for line in doc.get("containers", []):
        config, image, status = (line.split("\t") + ["", ""])[:3]
        images[config] = image
        health[config] = "healthy" if "(healthy)" in status else status.lower() or "unknown"
    servers = {m.config: ServerState(config=m.config, health=health.get(m.config, "stopped"), manifest=m,
                                     rendered=restorable(m, rendered), image=images.get(m.config))
               for m in deployment.servers}
    for f in deployment.failed:
        servers.setdefault(f.config, ServerState(config=f.config, health=f"failed: {f.why}: {f.error}"))
    return HostState(host=doc["host"], run_dir=doc["run_dir"], runtime=doc.get("runtime", "process"),
                     servers=servers)
