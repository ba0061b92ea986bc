"""What kvscope reads from an Ansible inventory besides what its playbooks do: the hosts of a group, and how
the bench reaches the deployment, as inventory variables of the inventory's own (one place for a cluster's
hosts and addresses, read by deploy, bench, rollout and teardown alike).

The bench's variables (group_vars or host_vars; literal values, since they are read without Ansible's
templating):
- kvscope_bench_deployment: where this machine finds each vLLM host's deployment.json, a path with `{host}`
  (the inventory's name of the host) and `{run_id}` (the bench's run id) in it; absent: the embedded default's
  runs/local/deployment.json. A cluster whose hosts keep their files elsewhere has them collected first
  (ansible/collect.yml, e.g. into results/{run_id}/hosts/{host}/).
- the group locust_workers: Locust workers, one on each of its hosts, reached over ssh, with
  kvscope_ssh_config (the ssh config naming them; absent: ssh's own) and kvscope_locust_master (the address
  they reach this machine, the master, at).
"""

from __future__ import annotations

import json
import os
import string
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from kvscope import REPO
from kvscope.config.matrix import ConfigError

VARS = ("kvscope_bench_deployment", "kvscope_ssh_config", "kvscope_locust_master", "kvscope_platform")


class InventoryError(ConfigError):
    """An inventory that cannot be read, or whose bench settings do not make sense (bad input: exit 2)."""


VAULT_PASSWORD_ENV = ("ANSIBLE_VAULT_PASSWORD_FILE", "ANSIBLE_VAULT_IDENTITY_LIST")  # as ansible-playbook reads them


def _ansible_env() -> dict[str, str]:
    return {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg"), "ANSIBLE_NOCOLOR": "1"}


def read(inventory: str) -> dict:
    """The inventory as `ansible-inventory --list` gives it (hosts by group, _meta.hostvars unrendered)."""
    env = _ansible_env()
    try:
        out = subprocess.run([sys.executable, "-m", "ansible", "inventory", "-i", inventory, "--list"],
                             capture_output=True, text=True, env=env, timeout=120)
    except subprocess.TimeoutExpired as exc:
        raise InventoryError(f"inventory {inventory}: ansible-inventory gave no answer in 120 s") from exc
    if out.returncode != 0:
        raise InventoryError(f"inventory {inventory}: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


def decrypt(inventory: str, name: str, ciphertext: str) -> str:
    """A vault-encrypted variable's value, decrypted by ansible-vault with the password Ansible takes from the
    environment ($ANSIBLE_VAULT_PASSWORD_FILE or $ANSIBLE_VAULT_IDENTITY_LIST); refused, without the
    ciphertext, where there is none or it does not fit."""
    why = f"inventory {inventory}: {name} is vault-encrypted"
    if not any(os.environ.get(v) for v in VAULT_PASSWORD_ENV):
        raise InventoryError(f"{why}, and no vault password is given: set ANSIBLE_VAULT_PASSWORD_FILE (as for "
                             "ansible-playbook), or give the value by its flag")
    try:  # a session of its own: no terminal to prompt on
        out = subprocess.run([sys.executable, "-m", "ansible", "vault", "decrypt", "--output", "-"], input=ciphertext,
                             capture_output=True, text=True, env=_ansible_env(), timeout=120, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        raise InventoryError(f"{why}: ansible-vault gave no answer in 120 s") from exc
    if out.returncode != 0:
        error = next((line for line in reversed(out.stderr.splitlines()) if "ERROR" in line), "no error line")
        raise InventoryError(f"{why}, and ansible-vault cannot decrypt it: {error[-300:]}")
    return out.stdout


def _literal(inventory: str, name: str, value) -> str:
    """A bench variable's value as text: a vault-encrypted one decrypted."""
    if isinstance(value, dict) and set(value) == {"__ansible_vault"}:
        return decrypt(inventory, name, str(value["__ansible_vault"]))
    return str(value)


def hosts(doc: dict, group: str) -> list[str]:
    """The hosts of `group` (its children's too), in the inventory's order."""

    def walk(name: str) -> list[str]:
        node = doc.get(name, {})
        return node.get("hosts", []) + [h for child in node.get("children", []) for h in walk(child)]

    return list(dict.fromkeys(walk(group)))


def servers(inventory: str) -> list[str]:
    """The vLLM hosts of an inventory (group vllm_servers); an inventory without any is an error."""
    return bench_hosts(inventory).servers


@dataclass
class BenchHosts:
    """Where the bench finds an inventory's deployment and runs its Locust workers. Each setting is checked
    when it is used, so a flag that replaces it is never refused for the inventory's value."""

    inventory: str
    servers: list[str]
    workers: list[str] = field(default_factory=list)
    found: dict[str, set[str]] = field(default_factory=dict)  # each variable's values over the hosts
    vaulted: set[str] = field(default_factory=set)  # variables given vault-encrypted: never shown in a message

    def value(self, name: str) -> str | None:
        """A bench variable's one literal value, None where no host has it."""
        seen = self.found.get(name, set())
        shown = "vault-encrypted values" if name in self.vaulted else ", ".join(sorted(seen))
        if len(seen) > 1:
            raise InventoryError(f"inventory {self.inventory}: {name} differs between hosts ({shown}); the bench "
                                 "takes one")
        value = next(iter(seen), None)
        if value is not None and ("{{" in value or "{%" in value):
            raise InventoryError(f"inventory {self.inventory}: {name} is a template ({shown}); the bench reads it "
                                 "without Ansible's templating: give a literal value")
        return value

    @property
    def ssh_config(self) -> str | None:
        value = self.value("kvscope_ssh_config")
        return os.path.expanduser(value) if value else None  # ssh -F does not expand ~

    @property
    def master(self) -> str | None:
        return self.value("kvscope_locust_master")

    @property
    def platform(self) -> str | None:
        """The platform the inventory deploys to (kvscope_platform: cpu or cuda)."""
        return self.value("kvscope_platform")

    def deployments(self, run_id: str | None) -> list[Path] | None:
        """Each vLLM host's deployment.json on this machine; None where the inventory does not say."""
        pattern = self.value("kvscope_bench_deployment")
        if pattern is None:
            return None
        try:  # a field is {host} or {run_id} as such: no attribute, index, conversion or width
            fields = [name if not (spec or conv) else f"{name}!{conv}:{spec}"
                      for _, name, spec, conv in string.Formatter().parse(pattern) if name is not None]
            if wrong := [f for f in fields if f not in ("host", "run_id")]:
                raise ValueError(f"{{{wrong[0]}}}")
        except ValueError as exc:
            shown = "(vault-encrypted)" if "kvscope_bench_deployment" in self.vaulted else f"{pattern!r} ({exc})"
            raise InventoryError(f"kvscope_bench_deployment {shown}: only {{host}} and {{run_id}} may be "
                                 "filled in") from exc
        if "run_id" in fields and run_id is None:
            raise InventoryError(f"kvscope_bench_deployment {pattern!r} names the run id: give --run-id")
        return [Path(pattern.format(host=h, run_id=run_id)) for h in self.servers]


def bench_hosts(inventory: str) -> BenchHosts:
    """The bench's settings of an inventory: its vLLM hosts, its Locust workers, and the values its hosts
    give each bench variable (one value for every host that has it, literal: checked where used)."""
    doc = read(inventory)
    found = hosts(doc, "vllm_servers")
    if not found:
        raise InventoryError(f"inventory {inventory}: no hosts in group vllm_servers")
    workers = hosts(doc, "locust_workers")
    hostvars = doc.get("_meta", {}).get("hostvars", {})
    given = {name: [v for h in found + workers if (v := hostvars.get(h, {}).get(name)) is not None] for name in VARS}
    vaulted = {name for name, vs in given.items() if any(isinstance(v, dict) for v in vs)}
    texts: dict[str, str] = {}  # each value read once (a ciphertext is decrypted once)

    def text(name: str, value) -> str:
        key = json.dumps(value, sort_keys=True, default=str)
        if key not in texts:
            texts[key] = _literal(inventory, name, value)
        return texts[key]

    values = {name: {text(name, v) for v in vs} for name, vs in given.items()}
    return BenchHosts(inventory, found, workers, values, vaulted)
