"""A run folder's layout, in one place: every file the bench writes and the report reads.

    run.json                                   RunInfo: command, machine, servers, scenarios, mode
    status.jsonl                               a StatusRow per treatment (resets, phases, logs kept)
    workloads/<scenario>.<phase>.jsonl         the requests replayed
    records/<config>__<scenario>.jsonl         a Record per answer
    continuations/<config>__<scenario>.jsonl   golden's scoring of answers that split from its own
    faults/<config>__<scenario>.jsonl          a canary treatment's fault log
    loads/<config>__<scenario>.jsonl           the connector's load log of a treatment
    (every .jsonl above as .jsonl.gz once `kvscope compress` gzipped it to publish; read alike)
    locust/<config>__<scenario>.<phase>*       Locust's own CSVs, and the LocustSpec it ran (.spec.json; not published)
    <table>.csv, <plot>.png, report.md/.html   what the report derives (TABLES, plots.py; report.html not published)
    hosts/<host>/                              a cluster host's deployment folder (kvscope.deploy.folder) as
                                               ansible/collect.yml fetched it: deployment.json, each server's
                                               manifest, failure and log (an inventory's kvscope_bench_deployment
                                               may name its deployment.json, as results/{run_id}/hosts/{host}/...)
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from kvscope import files
from kvscope.artifacts import ArtifactError
from kvscope.deploy.folder import DeploymentFolder

TABLES = ("scores", "summary", "verdicts", "overview", "power", "tiers", "sweep")
FOLDERS = ("records", "workloads", "continuations", "faults", "loads", "locust")
JSONL_FOLDERS = FOLDERS[:-1]  # their .jsonl files, and status.jsonl, are what compress() gzips
STATUS = "status.jsonl"
PLOTS = ("fidelity_matrix", "hit_rates", "ttft_cdf", "ttft_vs_cached", "load_sweep")


@dataclass(frozen=True)
class RunFolder:
    root: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "root", Path(self.root))

    def create(self) -> None:
        """The folders the bench writes into first (the others are made where their files are written)."""
        self.check_folders()
        for kind in ("records", "workloads"):
            (self.root / kind).mkdir(parents=True, exist_ok=True)

    def check_folders(self) -> None:
        """Refuse a folder of the run's files (records/, workloads/, ...) that is a link, or not a folder: the
        files in it are read and written through no link (UnsafeFile)."""
        for kind in FOLDERS:
            files.check_folder(self.root / kind)

    @property
    def run_json(self) -> Path:
        return self.root / "run.json"

    @property
    def status(self) -> Path:
        return self._held(self.root / STATUS)

    @property
    def workloads(self) -> Path:
        return self.root / "workloads"

    def workload(self, scenario: str, phase: str) -> Path:
        return self._held(self.workloads / f"{scenario}.{phase}.jsonl")

    def workload_files(self) -> dict[str, Path]:
        """Every workload file, by the name the bench wrote it under (sorted), in the form the folder holds it."""
        names = {p.name.removesuffix(".gz") for form in ("*.jsonl", "*.jsonl.gz") for p in self.workloads.glob(form)}
        return {name: self._held(self.workloads / name) for name in sorted(names)}

    @property
    def records_folder(self) -> Path:
        return self.root / "records"

    def records(self, config: str, scenario: str) -> Path:
        return self._held(self._per_treatment("records", config, scenario))

    def clear_records(self, config: str, scenario: str) -> Path:
        """Remove a treatment's records (a treatment cut short is run again); the path to append to."""
        plain = self._per_treatment("records", config, scenario)
        for path in (plain, _gzipped(plain)):
            path.unlink(missing_ok=True)
        return plain

    @property
    def records_glob(self) -> str:
        """How the folder holds its records, as a report names them."""
        forms = {p.name.endswith(".gz") for p in (self.root / "records").glob("*.jsonl*") if p.lstat().st_size}
        return " and ".join(f"records/*.jsonl{'.gz' if gz else ''}" for gz in sorted(forms)) or "records/*.jsonl"

    @property
    def compressed(self) -> bool:
        """Whether compress() gzipped more than the records (kvscope before 2026-12-06 gzipped those alone): the
        files a resume rewrites or appends to (the workloads, status.jsonl, continuations) are no longer plain."""
        return _gzipped(self.root / STATUS).exists() or any(
            any((self.root / kind).glob("*.jsonl.gz")) for kind in JSONL_FOLDERS if kind != "records")

    def compress(self) -> list[tuple[Path, int]]:
        """Gzip every non-empty JSONL file (records, workloads, continuations, fault and load logs, status.jsonl:
        the bulk of a published run; readers take either form), each file's gzip header naming the plain file;
        each file written with the plain file's size. An empty file stays: it says the treatment recorded
        nothing. Lines appended after an earlier compress are added after the gzipped ones. Every file is a
        regular file (no link), checked before anything is written; the gzipped file is on disk
        (files.replace) before the plain one goes, so a crash leaves the plain one whole."""
        self.check_folders()
        plains = sorted(p for kind in JSONL_FOLDERS for p in (self.root / kind).glob("*.jsonl"))
        plains += [self.root / STATUS] if os.path.lexists(self.root / STATUS) else []
        for path in plains + [_gzipped(p) for p in plains if os.path.lexists(_gzipped(p))]:
            files.check_regular(path)
        done = []
        for plain in plains:
            with files.open_read(plain) as src:
                size = os.fstat(src.fileno()).st_size
                if not size:
                    continue
                packed = _gzipped(plain)
                with files.replacing(packed) as out, gzip.GzipFile(plain.name, "wb", fileobj=out, mtime=0) as dst:
                    if packed.exists():  # a last line cut short is left out, as an append would cut it
                        dst.writelines(line for line in files.lines(packed) if line.endswith(b"\n"))
                    shutil.copyfileobj(src, dst)
            plain.unlink()
            done.append((packed, size))
        return done

    def continuations(self, config: str, scenario: str) -> Path:
        return self._held(self._per_treatment("continuations", config, scenario))

    def faults(self, config: str, scenario: str) -> Path:
        return self._held(self._per_treatment("faults", config, scenario))

    def loads(self, config: str, scenario: str) -> Path:
        return self._held(self._per_treatment("loads", config, scenario))

    def locust(self, config: str, scenario: str, phase: str) -> Path:
        return self.root / "locust" / f"{config}__{scenario}.{phase}"

    def locust_spec(self, config: str, scenario: str, phase: str) -> Path:
        """The LocustSpec of a treatment's phase, beside Locust's CSVs."""
        return self.root / "locust" / f"{config}__{scenario}.{phase}.spec.json"

    def host(self, name: str) -> DeploymentFolder:
        """A host's deployment folder as the collect role fetched it into the run folder."""
        return DeploymentFolder(self.root / "hosts" / name)

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

    def derived(self) -> list[Path]:
        """What the report writes that the folder holds: report.md, run.json, the tables and the plots (not the
        HTML page, which is not published)."""
        names = ["report.md", "run.json", *(f"{t}.csv" for t in TABLES), *(f"{p}.png" for p in PLOTS)]
        return [self.root / n for n in names if files.is_regular(self.root / n)]

    @property
    def published_as(self) -> Path | None:
        """A published run's path in the git checkout that tracks its report.md (results/<id> in a clone);
        None where none does: no git, not in a checkout, or not added. Where git cannot tell (its 'dubious
        ownership' refusal, or a timeout) it says so on stderr and the folder counts as unpublished."""
        if not self.root.is_dir():
            return None
        try:
            top = _git("-C", str(self.root), "rev-parse", "--show-toplevel")
            if top.returncode:
                if NOT_A_CHECKOUT not in top.stderr:
                    self._unsure(top.stderr.strip())
                return None
            inside = Path(os.path.relpath(self.root.resolve(), Path(top.stdout.strip()).resolve()))
            tracked = _git("--literal-pathspecs", "-C", top.stdout.strip(), "ls-files", "--error-unmatch",
                           str(inside / "report.md"))
        except FileNotFoundError:  # no git
            return None
        except (OSError, subprocess.SubprocessError) as exc:
            self._unsure(str(exc))
            return None
        return inside if tracked.returncode == 0 else None

    def _unsure(self, why: str) -> None:
        print(f"kvscope: cannot tell whether {self.root} is a published run: {why}", file=sys.stderr)

    def tracked(self) -> list[str] | None:
        """The folder's files its git checkout tracks ([] outside one, or without git); None where git cannot
        tell (a refusal or a timeout)."""
        try:
            out = _git("-C", str(self.root), "ls-files", ".")
        except FileNotFoundError:  # no git
            return []
        except (OSError, subprocess.SubprocessError):
            return None
        if out.returncode:
            return [] if NOT_A_CHECKOUT in out.stderr else None
        return out.stdout.split()

    def _per_treatment(self, kind: str, config: str, scenario: str) -> Path:
        return self.root / kind / f"{config}__{scenario}.jsonl"

    @staticmethod
    def _held(plain: Path) -> Path:
        """A JSONL file as the folder holds it: gzipped once compress() made it, else plain, as the bench writes
        it (the bench writes into no compressed folder: plan.build refuses to resume one). Both at once (lines
        appended after compress) is an error: neither holds them all."""
        packed = _gzipped(plain)
        if not packed.exists():
            return plain
        if plain.exists() and plain.stat().st_size:
            raise ArtifactError(f"{plain}: beside {packed.name}, written after the folder was compressed: "
                                "run `kvscope compress` on it again")
        return packed


NOT_A_CHECKOUT = "not a git repository"  # git's message outside a checkout (in English under LC_ALL=C)


def _git(*args: str) -> subprocess.CompletedProcess:
    """git's answer, its messages in English (to tell 'not a checkout' from a refusal)."""
    return subprocess.run(["git", *args], capture_output=True, text=True, timeout=30,
                          env={**os.environ, "LC_ALL": "C"})


def _gzipped(plain: Path) -> Path:
    return plain.with_name(plain.name + ".gz")
