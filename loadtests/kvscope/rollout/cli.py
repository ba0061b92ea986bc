"""`kvscope rollout`: the command, its options, and which rollout a run starts or resumes."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from datetime import UTC, datetime
from pathlib import Path

from kvscope.config import matrix as matrix_mod
from kvscope.deploy import inventory
from kvscope.rollout.ansible import Ansible, RolloutError
from kvscope.rollout.record import EXIT_BAD_INPUT, EXIT_CODES, Batch, Rollout, load, save, sha256

UNFINISHED = ("running", "interrupted", "rollback-failed")


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
    s.add_argument("--results", default="results", help="the rollout's record goes to RESULTS/<rollout-id>/")
    s.add_argument("--id", dest="rollout_id", default=None,
                   help="the rollout's id; an unfinished rollout of that id is resumed (default: the unfinished "
                        "rollout of this inventory, else a new one)")
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


def resumed(r: Rollout, candidate: Rollout) -> Rollout:
    """An unfinished rollout, running again as `candidate` (the same plan) asks: its matrix is read from where
    the command names it, the same content (sha256) wherever the recorded path now points."""
    return r.model_copy(update={"outcome": "running", "interrupted": None, "matrix": candidate.matrix})


def _unfinished(results: Path, inventory: str) -> list[Path]:
    found = []
    for path in sorted(results.glob("*/rollout.json")):
        try:
            r = load(path.parent)
        except ValueError:
            continue
        if r.outcome in UNFINISHED and r.inventory == inventory:
            found.append(path.parent)
    return found


def _new(args, configs: list[str], hosts: list[str], rollout_id: str) -> Rollout:
    golden = {}
    if args.golden:
        host, _, config = args.golden.partition("/")
        golden = {"host": host, "config": config}
    return Rollout(rollout_id=rollout_id,
                   command=os.environ.get("KVSCOPE_COMMAND") or "kvscope " + shlex.join(sys.argv[1:]),
                   inventory=args.inventory, configs=configs, matrix=str(args.matrix),
                   matrix_sha256=sha256(args.matrix), image=args.image, extra_vars=args.extra_vars,
                   serial=args.serial, inconclusive=args.inconclusive, hosts=hosts, golden=golden,
                   gate={"repeats": args.gate_repeats, "queries": args.gate_queries, "users": args.gate_users,
                         "timeout_s": args.gate_timeout_s, "min_hits": args.min_hits},
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


def cmd_rollout(args) -> int:
    from kvscope.rollout import gate, report
    from kvscope.rollout.engine import Engine, StopFlag

    results = Path(args.results)
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    try:
        _check_configs(Path(args.matrix), configs)
        hosts = inventory.servers(args.inventory)
        candidate = _new(args, configs, hosts, args.rollout_id or datetime.now(UTC).strftime("rollout-%Y%m%dT%H%M%SZ"))
        folder = results / candidate.rollout_id
        if args.rollout_id is None and (open_ := _unfinished(results, args.inventory)):
            folder = open_[-1]
        if (folder / "rollout.json").exists():
            r = load(folder)
            if _plan_key(r) != _plan_key(candidate):
                raise RolloutError(f"rollout {r.rollout_id} ({folder}, {r.outcome}) rolled {', '.join(r.configs)} "
                                   f"from {r.matrix} (sha256 {r.matrix_sha256[:12]}), image {r.image}, serial "
                                   f"{r.serial}: not this plan. Finish it first (re-run it with --id "
                                   f"{r.rollout_id}), or choose another --id")
            if r.outcome not in UNFINISHED:
                print(f"rollout {r.rollout_id} has finished ({r.outcome}); nothing is rolled again:")
                return report.main(folder)
            print(f"resuming rollout {r.rollout_id} ({r.outcome}" + (f": {r.interrupted}" if r.interrupted else "")
                  + f") from {folder}")
            r = resumed(r, candidate)
        else:
            r = candidate
            folder.mkdir(parents=True, exist_ok=False)
            scenarios = folder / "gate-scenarios.yaml"
            gate.write_scenarios(scenarios, args.gate_repeats, args.gate_queries)
            r.gate["scenarios_file"] = str(scenarios.resolve())
            save(folder, r)
            print(f"rollout {r.rollout_id}: {', '.join(configs)} from {args.matrix}"
                  + (f", image {args.image}" if args.image else "") + f" to {', '.join(hosts)}, {args.serial} "
                  f"host(s) at a time; record: {folder}")
    except (RolloutError, matrix_mod.ConfigError) as exc:
        print(f"kvscope rollout: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    stop = StopFlag()
    stop.install()
    ops = Ansible(r.inventory, r.extra_vars, Path(r.matrix), r.configs, r.image)
    try:
        return Engine(r, folder, ops, stop=stop).run()
    except RolloutError as exc:  # refused before a change: what was rolled stays, nothing else is touched
        print(f"kvscope rollout: {exc}", file=sys.stderr)
        r.outcome, r.interrupted = "stopped", f"refused: {exc}"
        save(folder, r)
        report.write(folder, r)
        print("\n".join(report.summary(r)))
        return EXIT_BAD_INPUT
