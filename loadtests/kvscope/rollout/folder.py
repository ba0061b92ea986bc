"""A rollout folder's layout (results/<rollout-id>), in one place: every file `kvscope rollout` writes and
`kvscope report` reads.

    rollout.json                       Rollout: the record, rewritten after every step (via .rollout.json.tmp)
    rollout.md                         the report, from rollout.json alone
    .lock                              held by the rollout that runs
    gate-scenarios.yaml                the gate's workload, as the rollout started with it
    logs/<step>.log                    the playbook output of a step outside a batch (initial, final, rollout)
    state/<when>/<host>.json           what each host serves (initial, final), as rollout-state.yml wrote it
    batches/NN/matrix.yaml             the batch's read-only copy of the matrix it deploys
    batches/NN/logs/<step>.log         the playbook output of each step of the batch
    batches/NN/state/<when>/<host>.json   before, after and restored
    batches/NN/restore-<host>-<n>.json    the rendered definitions a rollback starts again
    batches/NN/gate/<run-id>/          the gate's bench run folder (kvscope.runfolder); <run-id>.spec.json and
                                       <run-id>.log beside it

The record names a step's log and a gate's run folder relative to the rollout folder (relative()).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

RECORD = "rollout.json"


def host_state(state: Path, host: str) -> Path:
    """One host's file in a state folder (state(when)), as rollout-state.yml writes it (its rollout_state_to)."""
    return Path(state) / f"{host}.json"


@dataclass(frozen=True)
class BatchFolder:
    """One batch's files: batches/NN/."""

    root: Path

    @property
    def rollout(self) -> RolloutFolder:
        return RolloutFolder(self.root.parent.parent)

    def log(self, step: str) -> Path:
        return self.root / "logs" / f"{step}.log"

    def state(self, when: str) -> Path:
        return self.root / "state" / when

    @property
    def matrix(self) -> Path:
        return self.root / "matrix.yaml"

    def restore_source(self, host: str, n: int) -> Path:
        return self.root / f"restore-{host}-{n}.json"

    @property
    def gate(self) -> Path:
        return self.root / "gate"

    def gate_run(self, run_id: str) -> Path:
        return self.gate / run_id

    def gate_spec(self, run_id: str) -> Path:
        return self.gate / f"{run_id}.spec.json"

    def gate_log(self, run_id: str) -> Path:
        return self.gate / f"{run_id}.log"


@dataclass(frozen=True)
class RolloutFolder:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    @property
    def record(self) -> Path:
        return self.root / RECORD

    @property
    def record_tmp(self) -> Path:
        return self.root / f".{RECORD}.tmp"

    @property
    def report(self) -> Path:
        return self.root / "rollout.md"

    @property
    def lock(self) -> Path:
        return self.root / ".lock"

    @property
    def gate_scenarios(self) -> Path:
        return self.root / "gate-scenarios.yaml"

    def log(self, step: str) -> Path:
        return self.root / "logs" / f"{step}.log"

    def state(self, when: str) -> Path:
        return self.root / "state" / when

    def batch(self, index: int) -> BatchFolder:
        return BatchFolder(self.root / "batches" / f"{index:02d}")

    def relative(self, path: Path) -> str:
        """`path` as the record names it: relative to the rollout folder."""
        return str(Path(path).relative_to(self.root))
