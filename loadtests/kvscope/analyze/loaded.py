"""A run folder read once: every file the report scores, in memory. Scoring (report.analyze) and the
renderers take a LoadedRun and read nothing from disk."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from kvscope import files
from kvscope.artifacts import (
    ArtifactError,
    FaultEvent,
    LoadEvent,
    Record,
    Rows,
    RunInfo,
    StatusRow,
    read_json,
    read_jsonl,
)
from kvscope.run import continuations
from kvscope.run.records import read, request_key
from kvscope.runfolder import RunFolder

ConfigScenario = tuple[str, str]  # a treatment: (config, scenario)


class RunError(ValueError):
    """A run folder that cannot give a complete report; the message names the file."""


@dataclass(frozen=True)
class LoadedRun:
    folder: Path  # where it was read from: the report names it, and never reads it again
    run: RunInfo
    status: list[StatusRow]
    recs: dict[ConfigScenario, list[Record]]  # every server x scenario; [] where nothing was recorded
    unrecorded: frozenset[ConfigScenario]  # records file absent or empty
    continuations: dict[ConfigScenario, dict[str, tuple[int, list[dict]]]]  # as continuations.load gives them
    faults: dict[ConfigScenario, list[FaultEvent]]  # the fault logs the run kept
    loads: dict[ConfigScenario, list[LoadEvent]]  # the load logs the run kept
    expected: dict[str, int]  # measure-phase requests per scenario, from the workload files
    duplicates: dict[ConfigScenario, int]  # records that repeat a request already recorded: set aside
    cut_short: dict[str, int]  # file (in the folder) -> bytes of its last line, set aside: no newline (a full disk)
    workload_digest: str
    published_as: Path | None = None  # a published run's path in its checkout (RunFolder.published_as)
    records_glob: str = "records/*.jsonl"  # how the folder holds its records (gzipped once compressed)

    @property
    def name(self) -> Path:
        """How the report names the run: results/<id> for a published run, else the path it was read from."""
        return self.published_as or self.folder


def load(folder: Path) -> LoadedRun:
    """Read a run folder; a RunError names a file that keeps it from giving a complete report."""
    folder = Path(folder)
    rf = RunFolder(folder)
    if not rf.run_json.exists():
        raise RunError(f"{rf.run_json}: missing; not a kvscope run folder")
    rf.check_folders()
    run = read_json(rf.run_json, RunInfo)
    _check(rf.run_json, run)
    status = read_jsonl(rf.status, StatusRow) if rf.status.exists() else []
    treatments = [(s.config, scenario) for s in run.servers for scenario in run.scenarios]
    raw = _records(rf, run, status)
    recs, duplicates = _once(raw)
    faults: dict[ConfigScenario, list[FaultEvent]] = {
        t: read_jsonl(rf.faults(*t), FaultEvent) for t in treatments if rf.faults(*t).exists()}
    loads: dict[ConfigScenario, list[LoadEvent]] = {
        t: read_jsonl(rf.loads(*t), LoadEvent) for t in treatments if rf.loads(*t).exists()}
    files_read = {rf.status: status, **{rf.records(*t): rows for t, rows in raw.items()},
            **{rf.faults(*t): rows for t, rows in faults.items()}, **{rf.loads(*t): rows for t, rows in loads.items()}}
    return LoadedRun(
        folder=folder, run=run, status=status, recs=recs, duplicates=duplicates,
        cut_short={str(path.relative_to(folder)): rows.torn for path, rows in files_read.items()
                   if isinstance(rows, Rows) and rows.torn},
        unrecorded=_unrecorded(rf, run),
        continuations={t: continuations.load(folder, *t) for t in treatments},
        faults=faults, loads=loads,
        expected={s: _lines(rf.workload(s, "measure")) for s in run.scenarios},
        workload_digest=_digest(rf), published_as=rf.published_as,
        records_glob=rf.records_glob)


def _check(path: Path, run: RunInfo) -> None:
    """A run.json the report can score: one golden server, and blocks of at least one token."""
    if not run.servers:
        raise RunError(f"{path}: no servers; not a run kvscope can score")
    if (goldens := sum(s.role == "golden" for s in run.servers)) != 1:
        raise RunError(f"{path}: {goldens} golden servers; a run is scored against exactly one")
    if bad := [s.config for s in run.servers if s.manifest.block_size < 1]:
        raise RunError(f"{path}: servers {bad} have a block_size below 1 token")


def _once(recs: dict[ConfigScenario, list[Record]]) -> tuple[dict[ConfigScenario, list[Record]],
                                                               dict[ConfigScenario, int]]:
    """Each treatment's records with every request once (its first record; scoring keys answers by
    records.request_key, and a repeated record would count twice), and how many were set aside."""
    out, repeated = {}, {}
    for treatment, records in recs.items():
        first = {request_key(r.request_id, r.phase): r for r in reversed(records)}
        out[treatment] = [r for r in records if first[request_key(r.request_id, r.phase)] is r]
        if len(out[treatment]) < len(records):
            repeated[treatment] = len(records) - len(out[treatment])
    return out, repeated


def _records(rf: RunFolder, run: RunInfo, status: list[StatusRow]) -> dict[ConfigScenario, list[Record]]:
    recs: dict[ConfigScenario, list[Record]] = {}
    ran = {(row.config, row.scenario) for row in status}
    for server in run.servers:
        for scenario in run.scenarios:
            path = rf.records(server.config, scenario)
            if not path.exists():
                # A run cut short, or a golden treatment that ran and recorded nothing, reports what finished;
                # a folder without golden's records and no trace of its treatment is assembled wrongly.
                if server.role == "golden" and not run.interrupted and (server.config, scenario) not in ran:
                    raise RunError(f"{path}: golden records missing; fidelity cannot be scored without them")
                recs[server.config, scenario] = []
                continue
            try:
                recs[server.config, scenario] = read(path)
            except ArtifactError as exc:
                raise RunError(str(exc)) from exc
    return recs


def _unrecorded(rf: RunFolder, run: RunInfo) -> frozenset[ConfigScenario]:
    """The treatments whose records file is absent or empty."""
    return frozenset((s.config, scenario) for s in run.servers for scenario in run.scenarios
                     if not (path := rf.records(s.config, scenario)).exists() or not path.stat().st_size)


def _lines(path: Path) -> int:
    return sum(1 for _ in files.lines(path)) if path.exists() else 0


def _digest(rf: RunFolder) -> str:
    """Identity of a run's workload: the hash of its requests (without their schema version, so runs that
    replayed the same requests before schema versions existed compare equal)."""
    digest = hashlib.sha256()
    for name, path in rf.workload_files().items():  # named as the bench wrote them, gzipped since or not
        digest.update(name.encode())
        for line in files.lines(path):
            row = {k: v for k, v in json.loads(line).items() if k != "schema_version"}
            digest.update(json.dumps(row, ensure_ascii=False, sort_keys=True).encode() + b"\n")
    return digest.hexdigest()[:16]
