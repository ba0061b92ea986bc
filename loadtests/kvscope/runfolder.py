"""A run folder's layout, in one place: every file the bench writes and the report reads.

    run.json                                   RunInfo: command, machine, servers, scenarios, mode
    status.jsonl                               a StatusRow per treatment (resets, phases, logs kept)
    workloads/<scenario>.<phase>.jsonl         the requests replayed
    records/<config>__<scenario>.jsonl         a Record per answer
    continuations/<config>__<scenario>.jsonl   golden's scoring of answers that split from its own
    faults/<config>__<scenario>.jsonl          a canary treatment's fault log
    loads/<config>__<scenario>.jsonl           the connector's load log of a treatment
    locust/<config>__<scenario>.<phase>*       Locust's own CSVs
    <table>.csv, <plot>.png, report.md/.html   what the report derives (TABLES, plots.py)
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

TABLES = ("scores", "summary", "verdicts", "overview", "power", "tiers", "sweep")


@dataclass(frozen=True)
class RunFolder:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    def create(self) -> None:
        """The folders the bench writes into first (the others are made where their files are written)."""
        for kind in ("records", "workloads"):
            (self.root / kind).mkdir(parents=True, exist_ok=True)

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def status(self) -> Path:
        return self.root / "status.jsonl"

    @property
    def workloads(self) -> Path:
        return self.root / "workloads"

    def workload(self, scenario: str, phase: str) -> Path:
        return self.workloads / f"{scenario}.{phase}.jsonl"

    def records(self, config: str, scenario: str) -> Path:
        return self._per_treatment("records", config, scenario)

    def continuations(self, config: str, scenario: str) -> Path:
        return self._per_treatment("continuations", config, scenario)

    def faults(self, config: str, scenario: str) -> Path:
        return self._per_treatment("faults", config, scenario)

    def loads(self, config: str, scenario: str) -> Path:
        return self._per_treatment("loads", config, scenario)

    def locust(self, config: str, scenario: str, phase: str) -> Path:
        return self.root / "locust" / f"{config}__{scenario}.{phase}"

    def table(self, name: str) -> Path:
        if name not in TABLES:
            raise ValueError(f"{name}: not a table of a run folder ({', '.join(TABLES)})")
        return self.root / f"{name}.csv"

    def plot(self, name: str) -> Path:
        return self.root / f"{name}.png"

    @property
    def report_md(self) -> Path:
        return self.root / "report.md"

    @property
    def report_html(self) -> Path:
        return self.root / "report.html"

    @property
    def published(self) -> bool:
        """Its report.md is committed in the git checkout the folder lies in (results/<id> of a clone)."""
        try:
            return subprocess.run(["git", "-C", str(self.root), "ls-files", "--error-unmatch", "report.md"],
                                  capture_output=True, timeout=30).returncode == 0
        except (OSError, subprocess.SubprocessError):  # no git, or not a checkout
            return False

    def _per_treatment(self, kind: str, config: str, scenario: str) -> Path:
        return self.root / kind / f"{config}__{scenario}.jsonl"
