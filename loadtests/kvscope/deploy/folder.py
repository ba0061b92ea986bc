"""A deployment folder's layout, in one place: every file a deploy writes on a host and the bench, the status and
the rollout read (an inventory's kvscope_run_dir, runs/<inventory> by default; `make deploy DRY_RUN=1` renders
into runs/dry-run; a cluster host's is fetched into the run folder, kvscope.runfolder's hosts/<host>/).

    rendered.json            Rendered: what each server is started with (the vllm role copies it here)
    rendered-<host>.json     the render's output for one host, on the controller, before it is copied
    deployment.json          Deployment: the manifests and failures of the host (what `make bench` reads)
    stores/<config>/         a config's own stores; stores/shared/ the shared ones (an NFS mount on a cluster)
    <config>/server.pid      the server's "PID START BOOT_ID" (process runtime)
    <config>/server.definition  the digest of the flags and environment it started with (process runtime)
    <config>/server.log      its output
    <config>/manifest.json   Manifest: the live server, read off it
    <config>/failed.json     Failure: a server that did not come up, and why

The Ansible roles and the shell scripts spell these names too (YAML and bash cannot import them); a test checks
every one they spell against this module (tests/test_runfolder.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RENDERED = "rendered.json"
DEPLOYMENT = "deployment.json"
STORES = "stores"
SHARED_STORES = "shared"
PID, LOG, MANIFEST, FAILED = "server.pid", "server.log", "manifest.json", "failed.json"
DEFINITION = "server.definition"

LOCAL = Path("runs/local")  # the local inventory's deployment folder, from the repository root
DRY_RUN = Path("runs/dry-run")  # `make deploy DRY_RUN=1`'s: its rendered-<host>.json, apart from a live deployment's


@dataclass(frozen=True)
class ServerFolder:
    """One deployed server's files: <deployment folder>/<config>/."""

    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def config(self) -> str:
        return self.root.name

    @property
    def deployment(self) -> DeploymentFolder:
        return DeploymentFolder(self.root.parent)

    @property
    def pid(self) -> Path:
        return self.root / PID

    @property
    def definition(self) -> Path:
        return self.root / DEFINITION

    @property
    def log(self) -> Path:
        return self.root / LOG

    @property
    def manifest(self) -> Path:
        return self.root / MANIFEST

    @property
    def failed(self) -> Path:
        return self.root / FAILED

    @classmethod
    def of(cls, file: Path) -> ServerFolder:
        """The server folder holding one of its files (a pid file handed to `plumbing stop`)."""
        return cls(Path(file).parent)


@dataclass(frozen=True)
class DeploymentFolder:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def rendered(self) -> Path:
        return self.root / RENDERED

    def rendered_for(self, host: str) -> Path:
        return self.root / f"rendered-{host}.json"

    @property
    def deployment(self) -> Path:
        return self.root / DEPLOYMENT

    @property
    def stores(self) -> Path:
        return self.root / STORES

    @property
    def shared_stores(self) -> Path:
        return self.stores / SHARED_STORES

    def server(self, config: str) -> ServerFolder:
        return ServerFolder(self.root / config)

    def servers_with(self, name: str) -> list[ServerFolder]:
        """The server folders holding the file `name` (PID, MANIFEST, ...), by config name."""
        return [ServerFolder(f.parent) for f in sorted(self.root.glob(f"*/{name}"))]
