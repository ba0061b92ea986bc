"""`kvscope rollout`: the command, its options, and which rollout a run starts or resumes."""

from __future__ import annotations

import argparse
import fcntl
import math
import os
import shlex
import stat
import sys
from datetime import UTC, datetime
from pathlib import Path

from kvscope import files
from kvscope.auth import extra_var_secrets, redact_command
from kvscope.config import matrix as matrix_mod
from kvscope.deploy import inventory
from kvscope.rollout.ansible import Ansible, RolloutError
from kvscope.rollout.folder import RECORD, RolloutFolder
from kvscope.rollout.record import (
    EXIT_BAD_INPUT,
    EXIT_CODES,
    Batch,
    Rollout,
    definition_errors,
    load,
    save,
    sha256,
)

UNFINISHED = ("running", "interrupted", "rollback-failed")
GATE_OPTIONS = {"gate-repeats": "repeats", "gate-queries": "queries", "gate-users": "users",
                "gate-timeout-s": "timeout_s", "min-hits": "min_hits",
                "gate-tier": "tier"}  # option -> its key in the record's gate
GATE_DEFAULTS = {"tier": "any"}  # what a record made before the option holds


def add_parser(sub) -> argparse.ArgumentParser:
    s = sub.add_parser("rollout", help="roll configs to an inventory's hosts a batch at a time, each batch gated on "
                                       "the verdict; stop and roll back on a wrong answer",
                       epilog=EXIT_CODES, formatter_class=argparse.RawDescriptionHelpFormatter)
    s.add_argument("--inventory", required=True, help="the Ansible inventory whose vllm_servers are rolled")
    s.add_argument("--configs", required=True,
                   help="the configs to roll, comma-separated: their new definitions come from --matrix (a new "
                        "storage config or connector version) and --image (the container runtime)")
    s.add_argument("--image", default=None, help="the new image (container runtime)")
    s.add_argument("--serial", default="1", help="hosts per batch: a number, or a percentage of the hosts (25%%)")
    s.add_argument("--inconclusive", choices=["stop", "continue"], default="stop",
                   help="what an inconclusive gate (INCOMPLETE, UNVERIFIED) does")
    s.add_argument("--golden", default=None, metavar="HOST/CONFIG",
                   help="the gates' cache-off reference; default: the first healthy golden-role server found")
    s.add_argument("--gate-repeats", type=int, default=12, help="sends of UCM #867's request in the gate")
    s.add_argument("--gate-queries", type=int, default=16, help="RAG queries in the gate")
    s.add_argument("--gate-users", type=int, default=2, help="concurrent users of the gate's load")
    s.add_argument("--gate-timeout-s", type=float, default=600, help="the most one gate scenario may take")
    s.add_argument("--min-hits", type=int, default=20, help="verified cache hits a gate needs to PASS (the verdict's "
                                                           "own minimum, verdicts.MIN_VERIFIED_HITS)")
    s.add_argument("--gate-tier", choices=["any", "exact"], default="any",
                   help="the verdict tier a gate requires: exact fails a gate whose verdict is statistical (exact "
                        "mode with a control bitwise equal to golden is exact; docs/deploy.md#rollouts)")
    s.add_argument("--results", default="results", help="the rollout's record goes to RESULTS/<rollout-id>/")
    s.add_argument("--id", dest="rollout_id", default=None,
                   help="the rollout's id, a folder name; an unfinished rollout of that id is resumed, with the "
                        "options it was started with (default: a new rollout, refused while one of this inventory "
                        "is unfinished: a rollout is resumed by its id only)")
    s.add_argument("-e", "--extra-vars", action="append", default=[], metavar="KEY=VALUE",
                   help="extra vars for every playbook (as ansible-playbook -e)")
    s.set_defaults(func=cmd_rollout)
    return s


def batches(hosts: list[str], serial: str) -> list[Batch]:
    """Ansible's `serial`: a number of hosts, or a percentage of them (at least one)."""
    try:
        size = max(1, len(hosts) * int(serial[:-1]) // 100) if serial.endswith("%") else int(serial)
    except ValueError as exc:
        raise RolloutError(f"--serial {serial!r}: a number of hosts or a percentage (25%)") from exc
    if size < 1:
        raise RolloutError(f"--serial {serial!r}: at least one host per batch")
    return [Batch(index=i // size + 1, hosts=hosts[i:i + size]) for i in range(0, len(hosts), size)]


def _plan_key(r: Rollout) -> tuple:
    return (r.inventory, r.configs, r.matrix_sha256, r.image, r.serial)


def _options(r: Rollout) -> dict[str, object]:
    """The options that shape a rollout besides its plan, as its record holds them (extra vars redacted)."""
    return {"extra vars (-e)": r.extra_vars, "--inconclusive": r.inconclusive,
            "--golden": "/".join(r.golden.values()) or None,
            **{f"--{flag}": r.gate.get(key, GATE_DEFAULTS.get(key)) for flag, key in GATE_OPTIONS.items()}}


def differences(r: Rollout, candidate: Rollout) -> list[str]:
    """The options of `candidate` (the command) that differ from the record's; --golden only where the command
    names one (the record's may be the one found at the start)."""
    recorded, asked = _options(r), _options(candidate)
    if not candidate.golden:
        del asked["--golden"]
    return [f"{name} {recorded[name]!r} recorded, {value!r} now" for name, value in asked.items()
            if value != recorded[name]]


def resumed(r: Rollout, candidate: Rollout) -> Rollout:
    """An unfinished rollout, running again as `candidate` (the same plan and options) asks: its matrix is read
    from where the command names it, the same content (sha256) wherever the recorded path now points."""
    return r.model_copy(update={"outcome": "running", "interrupted": None, "matrix": candidate.matrix})


def rollback_errors(r: Rollout) -> list[str]:
    """Why the record's definitions of an unfinished batch's hosts (what its rollback would deploy) may not be
    deployed: the record is a file, and may have been edited since it was written."""
    errors = []
    for b in r.batches:
        if b.state in ("pending", "passed", "rolled-back"):
            continue
        for host in b.hosts:
            if host not in b.before:
                errors.append(f"{host}: batch {b.index} is {b.state}, but what the host served before is not recorded")
                continue
            errors += [f"{host}: {c}: {why}" for c in r.configs if (s := b.before[host].serving(c)) is not None
                       for why in definition_errors(s)]
    return errors


def _regular(path: Path) -> bool:
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False


def _unfinished(results: Path, inventory: str) -> list[Rollout]:
    """The unfinished rollouts of `inventory` recorded in `results` (a record that cannot be read is skipped)."""
    found = []
    for path in sorted(results.glob(f"*/{RECORD}")):
        if not _regular(path):
            continue
        try:
            r = load(path.parent)
        except ValueError:
            continue
        if r.outcome in UNFINISHED and r.inventory == inventory:
            found.append(r)
    return found


def _recorded(folder: Path) -> Rollout:
    """The record of the rollout in `folder` (one that --id names)."""
    if not _regular(RolloutFolder(folder).record):
        raise RolloutError(f"--id: {folder} is not a rollout's folder (no rollout.json file in it): choose another id")
    try:
        return load(folder)
    except ValueError as exc:
        raise RolloutError(f"--id: {folder}/rollout.json is not a rollout's record: {exc}") from exc


def lock(folder: Path, rollout_id: str) -> int:
    """Hold the rollout's lock (FOLDER/.lock, an flock) for this process's life: a second `kvscope rollout` of it
    is refused while this one runs. Returns the lock's file descriptor, which must stay open."""
    path = RolloutFolder(folder).lock
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise RolloutError(f"{path}: cannot open the rollout's lock ({exc.strerror}); it must be a file") from exc
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise RolloutError(f"{path}: the rollout's lock is not a file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RolloutError(f"rollout {rollout_id} is running ({path} is locked by another kvscope rollout): let it "
                           f"finish, or stop it (Ctrl-C) and resume it with --id {rollout_id}") from None
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_options(args) -> None:
    """The options' values, before anything runs."""
    from kvscope.commandline import RUN_ID

    if args.rollout_id is not None and not RUN_ID.match(args.rollout_id):
        raise RolloutError(f"--id {args.rollout_id!r} (ROLLOUT_ID): a folder name under --results, letters, digits, "
                           "'.', '_' and '-', starting with a letter or digit")
    least = {"--min-hits": (args.min_hits, 1), "--gate-queries": (args.gate_queries, 1),
             "--gate-users": (args.gate_users, 1),
             "--gate-repeats": (args.gate_repeats, 2)}  # a repeat is a hit from the second send on
    for flag, (value, minimum) in least.items():
        if value < minimum:
            raise RolloutError(f"{flag} {value}: at least {minimum}")
    if not (math.isfinite(args.gate_timeout_s) and args.gate_timeout_s > 0):
        raise RolloutError(f"--gate-timeout-s {args.gate_timeout_s:g}: a number of seconds above 0")


def _new(args, configs: list[str], hosts: list[str], rollout_id: str) -> Rollout:
    golden = {}
    if args.golden:
        host, _, config = args.golden.partition("/")
        golden = {"host": host, "config": config}
    secrets = extra_var_secrets(args.extra_vars)
    command = os.environ.get("KVSCOPE_COMMAND") or "kvscope " + shlex.join(sys.argv[1:])
    return Rollout(rollout_id=rollout_id, command=redact_command(command, secrets),
                   inventory=args.inventory, configs=configs, matrix=str(args.matrix),
                   matrix_sha256=sha256(args.matrix), image=args.image,
                   extra_vars=[redact_command(e, secrets) for e in args.extra_vars],
                   serial=args.serial, inconclusive=args.inconclusive, hosts=hosts, golden=golden,
                   gate={key: getattr(args, flag.replace("-", "_")) for flag, key in GATE_OPTIONS.items()},
                   batches=batches(hosts, args.serial))


def _check_configs(matrix: Path, configs: list[str]) -> None:
    m = matrix_mod.load(matrix)
    known = {c.name: c for c in m.configs}
    if unknown := [c for c in configs if c not in known]:
        raise RolloutError(f"{matrix}: no config {', '.join(unknown)} (known: {', '.join(known)})")
    if golden := [c for c in configs if known[c].role == "golden"]:
        raise RolloutError(f"{', '.join(golden)}: a golden config is the gates' reference, not something to roll")
    if not configs:
        raise RolloutError("--configs: name the configs to roll")


def _refuse_unfinished(results: Path, inventory_: str) -> None:
    """Without --id a new rollout starts, unless one of this inventory is unfinished: a record found in RESULTS is
    never resumed unasked (its extra vars reach every playbook)."""
    if found := _unfinished(results, inventory_):
        listed = ", ".join(f"{r.rollout_id} ({r.outcome}" + (f": {r.interrupted}" if r.interrupted else "") + ")"
                           for r in found)
        ids = " or ".join(f"--id {r.rollout_id}" for r in found)
        raise RolloutError(f"unfinished rollouts of {inventory_} in {results}: {listed}. A rollout is resumed by its "
                           f"id only: check that its record (rollout.md) is yours and re-run with {ids} (make "
                           f"rollout ROLLOUT_ID=...), or move its folder out of {results}")


def _open(args, results: Path, candidate: Rollout) -> tuple[Rollout, Path, int] | int:
    """The rollout this command runs, its folder and its lock, held; or the exit code of a finished rollout's
    report."""
    folder = results / candidate.rollout_id
    if args.rollout_id is None:
        _refuse_unfinished(results, args.inventory)
    new = not (folder.exists() or folder.is_symlink())
    if new:
        try:
            folder.mkdir(parents=True, exist_ok=False)
        except FileExistsError as exc:  # another rollout made it just now
            raise RolloutError(f"{folder} was made by another rollout meanwhile: choose another --id") from exc
    elif not folder.is_dir() or folder.is_symlink():
        raise RolloutError(f"--id: {folder} is not a rollout's folder: choose another id")
    else:
        _recorded(folder)  # before a lock file is made in someone else's folder
    fd = lock(folder, candidate.rollout_id)
    try:
        opened = _start(args, folder, candidate) if new else _resume(folder, candidate)
    except BaseException:
        os.close(fd)
        raise
    if isinstance(opened, int):
        os.close(fd)
        return opened
    return opened, folder, fd


def _start(args, folder: Path, r: Rollout) -> Rollout:
    """A new rollout, recorded in its new folder."""
    from kvscope.rollout import gate

    scenarios = RolloutFolder(folder).gate_scenarios
    gate.write_scenarios(scenarios, args.gate_repeats, args.gate_queries)
    r.gate["scenarios_file"] = str(scenarios.resolve())
    save(folder, r)
    print(f"rollout {r.rollout_id}: {', '.join(r.configs)} from {args.matrix}"
          + (f", image {args.image}" if args.image else "") + f" to {', '.join(r.hosts)}, {args.serial} "
          f"host(s) at a time; record: {folder}")
    return r


def _resume(folder: Path, candidate: Rollout) -> Rollout | int:
    """The rollout recorded in `folder` (its lock held), running as `candidate` asks: refused unless it is the
    same plan with the same options and every definition its rollback could deploy passes the matrix's rules;
    or the exit code of its report, when it has finished."""
    from kvscope.rollout import report

    try:  # what the rollout writes into its folder (rollout.md, logs, batches' copies) goes through no link
        files.check_tree(folder)
    except files.UnsafeFile as exc:
        raise RolloutError(f"rollout folder {folder}: {exc}") from exc
    r = _recorded(folder)  # again, now that no other rollout writes it
    if _plan_key(r) != _plan_key(candidate):
        raise RolloutError(f"rollout {r.rollout_id} ({folder}, {r.outcome}) rolled {', '.join(r.configs)} "
                           f"from {r.matrix} (sha256 {r.matrix_sha256[:12]}), image {r.image}, serial "
                           f"{r.serial}: not this plan. Finish it first (re-run it with --id "
                           f"{r.rollout_id}), or choose another --id")
    if r.outcome not in UNFINISHED:
        print(f"rollout {r.rollout_id} has finished ({r.outcome}); nothing is rolled again:")
        return report.main(folder)
    if diff := differences(r, candidate):
        raise RolloutError(f"rollout {r.rollout_id} ({folder}): this command's options differ from the record's: "
                           + "; ".join(diff) + ". Resume it with the recorded options (rollout.md lists them)")
    if errors := rollback_errors(r):
        raise RolloutError(f"rollout {r.rollout_id} ({folder}): its record holds definitions a rollback may "
                           "not deploy (the matrix's rules refuse them):\n  " + "\n  ".join(errors))
    print(f"resuming rollout {r.rollout_id} ({r.outcome}" + (f": {r.interrupted}" if r.interrupted else "")
          + f") from {folder}")
    return resumed(r, candidate)


def cmd_rollout(args) -> int:
    from kvscope.rollout import report
    from kvscope.rollout.engine import Engine, StopFlag

    results = Path(args.results)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    try:
        check_options(args)
        _check_configs(Path(args.matrix), configs)
        hosts = inventory.servers(args.inventory)
        candidate = _new(args, configs, hosts, args.rollout_id or datetime.now(UTC).strftime("rollout-%Y%m%dT%H%M%SZ"))
        opened = _open(args, results, candidate)
    except (RolloutError, matrix_mod.ConfigError) as exc:
        print(f"kvscope rollout: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if isinstance(opened, int):
        return opened
    r, folder, fd = opened
    try:
        stop = StopFlag()
        stop.install()
        # the command's extra vars: the record's are redacted, and equal to these once redacted (differences())
        ops = Ansible(r.inventory, args.extra_vars, Path(r.matrix), r.configs, r.image)
        try:
            return Engine(r, folder, ops, stop=stop).run()
        except RolloutError as exc:  # refused before a change: what was rolled stays, nothing else is touched
            print(f"kvscope rollout: {exc}", file=sys.stderr)
            r.outcome, r.interrupted = "stopped", f"refused: {exc}"
            save(folder, r)
            report.write(folder, r)
            print("\n".join(report.summary(r)))
            return EXIT_BAD_INPUT
    finally:
        os.close(fd)
