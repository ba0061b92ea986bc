"""The rollout itself: batches of hosts, each changed, gated, and kept or rolled back, the record written after
every step.

A batch goes pending -> changing -> gating -> passed, or on a gate that fails (FAIL, CRASHED, an inconclusive
verdict unless --inconclusive continue) -> rolling-back -> rolled-back (or rollback-failed, the worst outcome:
reported, never hidden). A batch's hosts are recorded before anything changes, and a host whose servers cannot
be restored exactly, or whose recorded definition the matrix's rules refuse (record.definition_errors), stops the
rollout before it is touched; so does a matrix file whose content is no longer the sha256 recorded at the start
(interrupted: re-running its --id with the recorded content resumes). A change deploys a read-only copy, in its
batch's folder, of the content just checked, not the file, which may change meanwhile;
the folders the matrix names (python_path) are not checked. Ctrl-C (or SIGTERM) stops between steps; during a
rollback it lets the rollback finish first; a second Ctrl-C aborts the step at once. Re-running with the rollout's
--id (and the options it started with) resumes from the batch's recorded state: finished batches are not rolled
again.
"""

from __future__ import annotations

import hashlib
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

from kvscope.artifacts import Treatment, Verdict, write_json
from kvscope.rollout import gate as gate_mod
from kvscope.rollout import report
from kvscope.rollout.ansible import RolloutError
from kvscope.rollout.ansible import run as run_child
from kvscope.rollout.folder import BatchFolder, RolloutFolder
from kvscope.rollout.record import (
    EXIT_BAD_INPUT,
    EXIT_INCONCLUSIVE,
    EXIT_OK,
    EXIT_ROLLBACK_FAILED,
    EXIT_STOPPED,
    Batch,
    GateResult,
    HostState,
    Rollout,
    Step,
    definition_errors,
    describe,
    now,
    restored,
    save,
)


class Ops(Protocol):
    """What the engine needs done on hosts (ansible.Ansible; fakes in the tests)."""

    def state(self, hosts: list[str], dest: Path, log: Path) -> dict[str, HostState]: ...

    def change(self, hosts: list[str], matrix: Path, log: Path) -> int: ...

    def restore(self, before: HostState, folder: Path, log: Path) -> int: ...


class Stopped(Exception):
    """Ctrl-C or SIGTERM, between steps."""

    def __init__(self, signal_name: str):
        super().__init__(signal_name)
        self.exit_code = 130 if signal_name == "Ctrl-C" else 143


class MatrixChanged(Exception):
    """The matrix file no longer holds what the rollout recorded at its start (its sha256)."""


class StopFlag:
    """Ctrl-C and SIGTERM ask the rollout to stop after the step it is in; a second one aborts that step."""

    def __init__(self) -> None:
        self.why: str | None = None
        self.deferred = False
        self.at = 0.0


    def install(self) -> None:
        signal.signal(signal.SIGINT, self._on)
        signal.signal(signal.SIGTERM, self._on)

    def _on(self, signum, frame) -> None:
        name = "Ctrl-C" if signum == signal.SIGINT else "SIGTERM"
        if self.why is not None:
            if time.monotonic() - self.at < 2:  # one signal, delivered twice (make forwards SIGTERM to its child)
                return
            raise KeyboardInterrupt
        self.why, self.at = name, time.monotonic()
        then = "the rollback finishes first" if self.deferred else "stopping after this step"
        print(f"\n{name}: {then}; the record says where, and re-running with its --id resumes it ({name} again "
              "aborts the step now)", flush=True)

    def check(self) -> None:
        if self.why is not None and not self.deferred:
            raise Stopped(self.why)

    @contextmanager
    def defer(self) -> Iterator[None]:
        self.deferred = True
        try:
            yield
        finally:
            self.deferred = False


Gate = Callable[[Rollout, Batch, str, Path], GateResult]


class Engine:
    def __init__(self, rollout: Rollout, folder: Path, ops: Ops, gate: Gate | None = None,
                 stop: StopFlag | None = None, out=print):
        self.r, self.folder, self.ops = rollout, Path(folder), ops
        self.layout = RolloutFolder(folder)
        self.gate = gate or run_gate
        self.stop = stop or StopFlag()
        self.out = out

    # the record

    def save(self) -> None:
        save(self.folder, self.r)

    @contextmanager
    def step(self, batch: Batch | None, name: str, what: str) -> Iterator[Step]:
        """Time a step, record it, say it in one line."""
        step = Step(name=name)
        where = f"batch {batch.index}/{len(self.r.batches)} {','.join(batch.hosts)}" if batch else "rollout"
        if batch is not None:
            step.log = self.layout.relative(self.layout.batch(batch.index).log(name))
            batch.steps.append(step)
        started = time.monotonic()
        self.save()
        try:
            yield step
        except BaseException:
            step.outcome = "aborted"
            raise
        finally:
            step.seconds = round(time.monotonic() - started, 1)
            if step.outcome == "running":
                step.outcome = "ok"
            self.save()
            self.out(f"{where}: {name:<9} {step.seconds:6.1f} s  {what}"
                     + ("" if step.outcome == "ok" else f": {step.outcome}"), flush=True)

    def log(self, step: Step) -> Path:
        return self.folder / step.log if step.log else self.layout.log("rollout")

    # the rollout

    def run(self) -> int:
        self.r.final = {}  # recorded again at the end; a resumed rollout's old one says nothing now
        try:
            if not self.r.initial:
                with self.step(None, "record", "every host, before anything changes") as step:
                    step.log = self.layout.relative(self.layout.log("initial"))
                    self.r.initial = self.ops.state(self.r.hosts, self.layout.state("initial"), self.log(step))
                self._choose_golden()
            for batch in self.r.batches:
                code = self._batch(batch)
                if code is not None:
                    return self._finish("rollback-failed" if code == EXIT_ROLLBACK_FAILED else "stopped", code)
            inconclusive = any(g.exit_code != 0 for b in self.r.batches for g in b.gates)
            return self._finish("completed", EXIT_INCONCLUSIVE if inconclusive else EXIT_OK)
        except Stopped as exc:
            self.r.interrupted = f"{exc} between steps"
            return self._finish("interrupted", exc.exit_code)
        except MatrixChanged as exc:
            self.r.interrupted = str(exc)
            return self._finish("interrupted", EXIT_BAD_INPUT)
        except KeyboardInterrupt:
            self.r.interrupted = "aborted during a step (a second Ctrl-C or SIGTERM)"
            self.r.outcome = "interrupted"
            self.save()
            self.out("\n".join(report.summary(self.r)), flush=True)
            return 130

    def _choose_golden(self) -> None:
        """The gates' reference: a golden server this rollout does not change (--golden, or the first found)."""
        if self.r.golden:
            host, config = self.r.golden["host"], self.r.golden["config"]
            s = self.r.initial.get(host, HostState(host=host, run_dir="?")).serving(config)
            if s is None or s.manifest is None or s.manifest.role != "golden":
                raise RolloutError(f"--golden {host}/{config}: no healthy golden-role server {config} on {host}")
        else:
            found = [(h, c) for h in self.r.hosts for c, s in self.r.initial[h].servers.items()
                     if s.health == "healthy" and s.manifest and s.manifest.role == "golden"]
            if not found:
                raise RolloutError("no healthy golden server (a cache-off reference, e.g. baseline) on any host: the "
                                   "gates compare every answer with one; deploy it first (make deploy) or name it "
                                   "with --golden HOST/CONFIG")
            host, config = found[0]
        if config in self.r.configs:
            raise RolloutError(f"{config} is the gates' golden server: it cannot be rolled by this rollout")
        self.r.golden = {"host": host, "config": config}
        self.save()

    def _batch(self, batch: Batch) -> int | None:
        """One batch, from the state it was left in; None to go on with the next batch, else an exit code."""
        if batch.state == "passed":
            return None
        if batch.state == "rolled-back":
            return EXIT_STOPPED
        folder = self.layout.batch(batch.index)
        if batch.state == "pending":
            self._check_matrix(batch)
            with self.step(batch, "record", "what the hosts serve before the change") as step:
                batch.before = self.ops.state(batch.hosts, folder.state("before"), self.log(step))
            self._check_restorable(batch)
            batch.state = "changing"
            self.save()
            self.stop.check()
        if batch.state == "changing":
            matrix = self._copy_matrix(batch)  # again: the record step took a while
            with self.step(batch, "change", f"stop the old {', '.join(self.r.configs)}, deploy the new") as step:
                rc = self.ops.change(batch.hosts, matrix, self.log(step))
                if rc != 0:
                    step.outcome = f"failed (exit {rc}; its log: {step.log})"
            batch.state = "gating"
            self.save()
            self.stop.check()
        if batch.state == "gating":
            with self.step(batch, "after", "what the hosts serve after the change") as step:
                batch.after = self.ops.state(batch.hosts, folder.state("after"), self.log(step))
            batch.gates = []
            for host in batch.hosts:
                with self.step(batch, f"gate-{host}", f"gate on {host}") as step:
                    result = self._gate(batch, host)
                    batch.gates.append(result)
                    step.outcome = report.gate_words(result)
                if result.exit_code == 0:
                    self.stop.check()
            if all(self._passes(g) for g in batch.gates):
                batch.state, batch.decision = "passed", "continue"
                self.save()
                self.stop.check()
                return None
            failed = next(g for g in batch.gates if not self._passes(g))
            batch.state, batch.reason = "rolling-back", f"{failed.host}: {report.gate_words(failed)}"
            self.save()
        return self._rollback(batch)

    def _passes(self, g: GateResult) -> bool:
        """A gate the rollout goes on after: exit 0, or inconclusive (exit 3) under `--inconclusive continue`
        where no verdict is INVALID (a golden that was not cache-off, a reset that did not reset: also exit 3)."""
        return g.exit_code == 0 or (g.exit_code == 3 and self.r.inconclusive == "continue"
                                    and Verdict.INVALID not in g.verdicts.values())

    def _check_matrix(self, batch: Batch) -> bytes:
        """The matrix file's content, refused (before anything of the batch is touched) unless its sha256 is the
        one recorded at the start."""
        try:
            content = Path(self.r.matrix).read_bytes()
            found = hashlib.sha256(content).hexdigest()
            now = f"sha256 {found[:12]}"
        except OSError as exc:
            content, found, now = b"", "", f"unreadable: {exc.strerror}"
        if found != self.r.matrix_sha256:
            raise MatrixChanged(f"{self.r.matrix} changed since the rollout started ({now}, recorded sha256 "
                                f"{self.r.matrix_sha256[:12]}); batch {batch.index} was not changed: put the recorded "
                                f"matrix back and re-run with --id {self.r.rollout_id} to resume, or roll the new one "
                                "as a rollout of its own")
        return content

    def _copy_matrix(self, batch: Batch) -> Path:
        """What the batch's change deploys: the checked content, written read-only into the batch's folder, so that
        an edit of the matrix file during the change (its teardown takes minutes) is not deployed."""
        content = self._check_matrix(batch)
        copy = self.layout.batch(batch.index).matrix
        copy.parent.mkdir(parents=True, exist_ok=True)
        copy.unlink(missing_ok=True)  # a resumed change's, read-only
        copy.write_bytes(content)
        copy.chmod(0o444)
        return copy

    def _check_restorable(self, batch: Batch) -> None:
        problems = [f"{h}: {s.error}" for h, s in batch.before.items() if s.error]
        problems += [f"{h}: {c} runs, but what it was started with is not recorded exactly (its manifest is redacted "
                     "and rendered.json holds another definition), so it could not be rolled back"
                     for h, s in batch.before.items() for c in self.r.configs
                     if (srv := s.serving(c)) is not None and srv.rendered is None]
        problems += [f"{h}: {c}: {why} (a rollback would deploy it)" for h, s in batch.before.items()
                     for c in self.r.configs if (srv := s.serving(c)) is not None and srv.rendered is not None
                     for why in definition_errors(srv)]
        if problems:
            raise RolloutError("nothing was changed on " + ", ".join(batch.hosts) + ":\n  " + "\n  ".join(problems))

    def _gate(self, batch: Batch, host: str) -> GateResult:
        after = batch.after[host]
        missing = {c: (after.servers[c].health if c in after.servers else "not deployed")
                   for c in self.r.configs if after.serving(c) is None}
        if missing:  # the new version did not come up: CRASHED, nothing to bench
            return GateResult(host=host, folder="", exit_code=1, verdicts=dict.fromkeys(missing, Verdict.CRASHED),
                              why=missing)
        try:
            return self.gate(self.r, batch, host, self.layout.batch(batch.index).root)
        except RolloutError as exc:  # no golden to compare with: no verdict, so the change does not stay
            golden = self.r.golden.get("config", "golden")
            return GateResult(host=host, folder="", exit_code=1, verdicts={golden: Verdict.CRASHED},
                              why={golden: str(exc)})

    def _rollback(self, batch: Batch) -> int:
        """Put the batch's hosts back to what they served before; verify it. During this, Ctrl-C waits."""
        folder = self.layout.batch(batch.index)
        with self.stop.defer():
            with self.step(batch, "rollback", "stop the new version, start what the hosts served before") as step:
                rcs = {h: self.ops.restore(batch.before[h], folder.root, self.log(step)) for h in batch.hosts}
                if any(rcs.values()):
                    step.outcome = "failed on " + ", ".join(f"{h} (exit {rc})" for h, rc in rcs.items() if rc)
            with self.step(batch, "restored", "what the hosts serve after the rollback") as step:
                batch.restored = self.ops.state(batch.hosts, folder.state("restored"), self.log(step))
            ok = not any(rcs.values()) and all(restored(batch.before[h], batch.restored[h], self.r.configs)
                                               for h in batch.hosts)
            batch.state = "rolled-back" if ok else "rollback-failed"
            batch.decision = "stopped, rolled back" if ok else "stopped, ROLLBACK FAILED"
            self.save()
        return EXIT_STOPPED if ok else EXIT_ROLLBACK_FAILED

    def _finish(self, outcome: str, code: int) -> int:
        try:
            with self.step(None, "record", "every host, at the end") as step:
                step.log = self.layout.relative(self.layout.log("final"))
                self.r.final = self.ops.state(self.r.hosts, self.layout.state("final"), self.log(step))
        except KeyboardInterrupt:
            pass
        self.r.outcome = outcome  # type: ignore[assignment]
        self.r.finished = now()
        self.save()
        report.write(self.folder, self.r)
        self.out("\n".join(report.summary(self.r)), flush=True)
        return code


def run_gate(r: Rollout, batch: Batch, host: str, folder: Path) -> GateResult:
    """The gate's bench in a child process: golden and the host's new servers, the fixed gate workload."""
    layout = BatchFolder(folder)
    layout.gate.mkdir(parents=True, exist_ok=True)
    run_id = host
    n = 1
    while layout.gate_run(run_id).exists():  # an earlier attempt (a resumed batch) stays beside it
        n += 1
        run_id = f"{host}.{n}"
    golden_host, golden_config = r.golden["host"], r.golden["config"]
    golden_state = batch.after.get(golden_host) or r.initial[golden_host]
    servers = [_treatment(golden_state, golden_config)] + [_treatment(batch.after[host], c) for c in r.configs]
    spec = gate_mod.GateSpec(results=str(layout.gate.resolve()), run_id=run_id,
                             scenarios_file=str((Path(r.gate["scenarios_file"])).resolve()), servers=servers,
                             users=r.gate.get("users", 2), timeout_s=r.gate.get("timeout_s", 600),
                             min_hits=r.gate.get("min_hits", 20), tier=r.gate.get("tier", "any"))
    write_json(layout.gate_spec(run_id), spec)
    code = run_child([sys.executable, "-m", "kvscope.rollout.gate", str(layout.gate_spec(run_id))],
                     layout.gate_log(run_id))
    gate_run = layout.gate_run(run_id)
    return gate_mod.result(host, gate_run, layout.rollout.relative(gate_run), code, r.configs, spec.tier)


def _treatment(state: HostState, config: str) -> Treatment:
    s = state.serving(config)
    if s is None or s.manifest is None:
        raise RolloutError(f"{state.host}: {config} is not serving ({describe(s)})")
    return Treatment(config=config, manifest=s.manifest, run_dir=state.run_dir)

