"""kvscope: benchmark a KV-cache storage tier for TTFT, cache hit rate and output fidelity.

`make bench` deploys and calls `kvscope bench`; the Ansible roles call `python -m kvscope.plumbing`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import signal
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, cast, get_args

from kvscope import HARNESS, __version__, files
from kvscope.artifacts import Verdict
from kvscope.auth import redact_command
from kvscope.commandline import DEFAULT_MATRIX, names, run_cli
from kvscope.config import matrix as matrix_mod
from kvscope.deploy import servers
from kvscope.deploy.folder import LOCAL as LOCAL_DEPLOYMENT
from kvscope.rollout.folder import RolloutFolder
from kvscope.runfolder import RunFolder

if TYPE_CHECKING:
    from kvscope.run.plan import BenchOptions

EXIT_CODES = """exit codes of bench --report and report (the gate):
  0  every verdict is what its role expects (candidates and control PASS, canaries FAIL)
  1  the gate fails: a FAIL where PASS was expected, a canary kvscope missed too often, a crash
  2  bad input: the matrix, a selection, a scenario or a run folder (nothing was deployed or scored)
  3  inconclusive: nothing failed, but a verdict is INCOMPLETE, UNVERIFIED or INVALID; bench without
     --report: a treatment got no answer at all (a server that is down)
  130, 143, 1: bench stopped by Ctrl-C, by SIGTERM, or by a crash; run.json says why, the finished
     treatments are kept (scored when --report), and --resume continues the run"""
DEFAULT_SCENARIOS = "rag-zipf,rag-relevance,multiturn,repeat-867"


def cmd_validate(args) -> int:
    m = matrix_mod.load(args.matrix)
    if args.configs:
        platform, judged = _platform(args)
        try:
            matrix_mod.select(m, names(args.configs), platform)
        except matrix_mod.ConfigError as exc:
            raise matrix_mod.ConfigError(f"{exc}\n(judged for platform {platform} ({judged}))") from exc
        print(f"{args.configs}: judged for platform {platform} ({judged})")
    print(f"{args.matrix}: {len(m.configs)} configs valid: {', '.join(c.name for c in m.configs)}")
    return 0


def _platform(args) -> tuple[matrix_mod.Platform, str]:
    """The platform a selection is judged for, and whence: --platform, else the inventory's kvscope_platform
    (where it deploys), else the CPU."""
    if args.platform:
        return args.platform, "--platform"
    if args.inventory:
        from kvscope.deploy import inventory

        found = inventory.bench_hosts(args.inventory).platform
        if found is not None:
            if found not in get_args(matrix_mod.Platform):
                raise matrix_mod.ConfigError(f"inventory {args.inventory}: kvscope_platform {found!r} is not one of "
                                             f"{', '.join(get_args(matrix_mod.Platform))}")
            return cast(matrix_mod.Platform, found), f"kvscope_platform of inventory {args.inventory}"
    return "cpu", "the default"


def cmd_build_model(args) -> int:
    from kvscope.deploy.model import build

    digest = build(Path(args.out), seed=args.seed, shape_name=args.shape)
    print(f"built {args.out} sha256={digest}")
    return 0


def cmd_status(args) -> int:
    rows = servers.status(Path(args.run_dir))
    if not rows:
        print(f"nothing deployed under {args.run_dir}")
    for row in rows:
        print(f"{row['config']:<16} port {row['port'] or '-':<6} pid {row['pid'] or '-':<8} {row['state']}")
    return 0


def bench_options(args) -> BenchOptions:
    """What `kvscope bench` was asked for, typed; the recorded command line redacted."""
    from kvscope.run.plan import BenchOptions

    return BenchOptions(
        results=Path(args.results), scenarios_file=Path(args.scenarios), scenarios=names(args.scenarios_list),
        configs=names(args.configs), deployments=[Path(d) for d in names(args.deployment or "")],
        inventory=args.inventory, worker_hosts=names(args.worker_hosts), ssh_config=args.ssh_config,
        master_host=args.master_host, endpoints=names(args.endpoint), golden=args.golden, control=args.control,
        model_dir=Path(args.model_dir), ca_file=args.ca_file, users=args.users, repeats=args.repeats,
        processes=args.processes, rate=args.rate, timeout_s=args.timeout_s, queries=args.queries,
        restart_cmd=args.restart_cmd, run_id=args.run_id, resume=args.resume, exact=args.exact,
        command=redact_command(os.environ.get("KVSCOPE_COMMAND") or "kvscope " + shlex.join(sys.argv[1:])))


def cmd_bench(args) -> int:
    from kvscope.analyze.overview import parse_slo
    from kvscope.run import plan as bench_plan
    from kvscope.run import treatments

    parse_slo(args.slo)  # a mistyped objective stops the bench before it runs, not after
    if args.json and not args.report:
        raise matrix_mod.ConfigError("--json prints the report's verdicts: it goes with --report")
    plan = bench_plan.build(bench_options(args))
    if args.plan:
        print(plan.describe())
        return 0
    signal.signal(signal.SIGTERM, _terminated)  # a stopped bench says so in its run folder, as after Ctrl-C
    # --json: stdout holds the JSON document alone, the progress goes to stderr
    progress = contextlib.redirect_stdout(sys.stderr) if args.json else contextlib.nullcontext()
    try:
        with progress:
            folder = treatments.run(plan)
    except treatments.Interrupted as exc:
        if exc.exit_code == 1:
            traceback.print_exception(exc.__cause__)
        print(f"\n{exc}\nThe servers still run: `make status` lists them, `make teardown` stops them.",
              file=sys.stderr)
        if args.report:  # what finished, scored; every config cut short reads INCOMPLETE
            _report(exc.folder, args)
        return exc.exit_code
    print(f"records written to {folder}", file=sys.stderr if args.json else sys.stdout)
    if args.report:
        return _report(folder, args)
    if silent := unanswered(folder):
        print(f"kvscope: no answer at all: {', '.join(silent)} (is the server up?); their verdicts would be "
              f"{Verdict.INCOMPLETE}", file=sys.stderr)
        return 3
    return 0


def unanswered(folder: Path) -> list[str]:
    """The treatments of a run folder ('config x scenario') that got no answer at all."""
    from kvscope.artifacts import Record, StatusRow, read_jsonl

    def answered(path: Path) -> bool:
        return path.exists() and any(r.ok for r in read_jsonl(path, Record))

    rf = RunFolder(folder)
    rows = read_jsonl(rf.status, StatusRow) if rf.status.exists() else []
    return [f"{row.config} x {row.scenario}" for row in rows if not answered(rf.records(row.config, row.scenario))]


def _terminated(signum, frame):
    raise SystemExit(143)


def _report(folder: Path, args, out: Path | None = None, rewrite: bool = False) -> int:
    """Score FOLDER and write its report into OUT (the folder by default). A published run is named as its
    checkout names it (results/<id>), and rewritten only where this code renders it alike, or with REWRITE."""
    from kvscope.analyze import loaded, overview, report

    out = out or folder
    if out.resolve() != folder.resolve():
        _new_or_empty(out, "the report")
    run = loaded.load(folder)
    a = report.analyze(run, args.min_hits, args.max_failed, overview.parse_slo(args.slo))
    kept: dict[Path, bytes] = {}
    if out.resolve() == folder.resolve() and run.published_as is not None and not rewrite:
        if changed := report.rendered_differently(a, folder):
            raise loaded.RunError(
                f"{folder} is a published run (tracked by its checkout as {run.published_as}) and this code "
                f"renders {', '.join(changed)} differently: write the report elsewhere with --out DIR (make "
                "report OUT=DIR), or rewrite the published run with --rewrite (make report REWRITE=1) and commit it")
        # its plots are drawn alike, perhaps a pixel apart (another CPU): the published bytes stay
        kept = {f: files.read_bytes(f, files.MAX_READ_BYTES) for f in RunFolder(folder).derived()
                if f.suffix == ".png"}
    code = report.write_report(a, out)
    for path, data in kept.items():
        files.replace(path, data)
    if args.json:  # the verdicts and the gate, nothing else on stdout
        print(report.as_json(a, code))
        return code
    print(report.console(a))
    print(f"report: {RunFolder(out).report_md}\ngate: {report.GATE_WORDS[code]}")
    return code


def cmd_report(args) -> int:
    if RolloutFolder(args.run).record.exists():  # a rollout's record (kvscope rollout): rollout.md
        from kvscope.rollout import report as rollout_report

        if args.json or args.out or args.rewrite:
            raise matrix_mod.ConfigError("--json, --out and --rewrite are for a bench run's report; a rollout's "
                                         "rollout.md is written beside its rollout.json")

        return rollout_report.main(Path(args.run))
    return _report(Path(args.run), args, Path(args.out) if args.out else None, args.rewrite)


def cmd_compress(args) -> int:
    rf = RunFolder(Path(args.run))
    if not rf.run_json.exists():
        raise matrix_mod.ConfigError(f"{args.run}: not a kvscope run folder (no run.json)")
    tracked = rf.tracked()
    if tracked is None or tracked:
        raise matrix_mod.ConfigError(f"{args.run}: " + ("git cannot tell whether it is a published run" if tracked
                                     is None else f"a published run (its checkout tracks {len(tracked)} of its "
                                     "files); its records stay as committed"))
    done = rf.compress()
    before, after = sum(size for _, size in done), sum(path.stat().st_size for path, _ in done)
    print(f"{len(done)} JSONL files gzipped: {before / 1e6:.1f} MB -> {after / 1e6:.1f} MB; the report names "
          f"the gzipped records once re-written: make report RUN={args.run}")
    return 0


def cmd_compare(args) -> int:
    from kvscope.analyze import comparison

    if args.out:
        _new_or_empty(Path(args.out), "the comparison")
    print(comparison.write([Path(r) for r in names(args.runs)], Path(args.out) if args.out else None))
    return 0


def _new_or_empty(out: Path, what: str) -> None:
    """--out names a folder that is new or empty: WHAT writes its files there, and overwrites nobody's."""
    from kvscope.analyze.loaded import RunError

    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise RunError(f"--out {out}: not a new or empty folder; {what} writes into one")


def _hits(text: str) -> int:
    if int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least 1 (a cache that is never hit proves nothing)")
    return int(text)


def _share(text: str) -> float:
    if not 0 <= float(text) <= 1:
        raise argparse.ArgumentTypeError(f"{text}: a share, from 0 to 1")
    return float(text)


def _gate_options(s) -> None:
    from kvscope.analyze.verdicts import MAX_FAILED_SHARE, MIN_VERIFIED_HITS

    s.add_argument("--min-hits", type=_hits, default=MIN_VERIFIED_HITS,
                   help="verified cache hits a config needs for PASS (fewer: UNVERIFIED)")
    s.add_argument("--max-failed", type=_share, default=MAX_FAILED_SHARE,
                   help="share of failed requests a config may have before it is INCOMPLETE")
    s.add_argument("--slo", default="", metavar="ttft=MS,tpot=MS",
                   help="service-level objective: the summary adds the share of requests that met it, and goodput")


def _matrix_option(s) -> None:
    """--matrix after a subcommand that reads it, as well as before (the global option's default stands)."""
    s.add_argument("--matrix", type=Path, default=argparse.SUPPRESS, help="storage-config matrix YAML")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvscope", description=__doc__, epilog=EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"kvscope {__version__}")
    p.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX, help="storage-config matrix YAML")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("validate", help="validate the matrix (and a selection for a platform)")
    _matrix_option(s)
    s.add_argument("--configs", default="", help="a selection to check for --platform, comma-separated")
    s.add_argument("--platform", choices=["cpu", "cuda"], default=None,
                   help="the platform the selection runs on (default: the inventory's kvscope_platform, else cpu)")
    s.add_argument("--inventory", default=None, help="the Ansible inventory the selection deploys to")
    s.set_defaults(func=cmd_validate)

    s = sub.add_parser("bench", help="run scenarios against deployed configs; records into results/<run-id>/")
    s.add_argument("--deployment", default=None,
                   help="deployment.json of each host, comma-separated (default: the inventory's "
                        "kvscope_bench_deployment, else runs/local/deployment.json)")
    s.add_argument("--inventory", default=None,
                   help="the Ansible inventory deployed: where its hosts' deployment.json lie and its Locust "
                        "workers (kvscope_bench_deployment, group locust_workers, kvscope_ssh_config, "
                        "kvscope_locust_master); the flags below win")
    s.add_argument("--endpoint", default="", metavar="[NAME=]URL,...",
                   help="bench OpenAI-compatible servers kvscope did not deploy (instead of --deployment)")
    s.add_argument("--golden", default="", metavar="[NAME=]URL", help="with --endpoint: the cache-off reference")
    s.add_argument("--control", default=None, metavar="[NAME=]URL",
                   help="with --endpoint: a second cache-off server, to measure the noise floor")
    s.add_argument("--model-dir", default="models/tiny-qwen3",
                   help="with --endpoint: a folder with the served model's tokenizer.json")
    s.add_argument("--ca-file", default=None, metavar="PEM",
                   help="with --endpoint: the CAs https endpoints' certificates are checked against (default: the "
                        "system's)")
    s.add_argument("--results", default="results", help="the run folder goes to RESULTS/<run-id>/")
    s.add_argument("--scenarios-file", dest="scenarios", default=str(HARNESS / "scenarios.yaml"),
                   help="the scenarios YAML (workloads) to pick --scenarios from")
    s.add_argument("--configs", default="", help="comma-separated; default every deployed config")
    s.add_argument("--scenarios", dest="scenarios_list", default=DEFAULT_SCENARIOS, help="comma-separated names")
    s.add_argument("--users", default="2", help="concurrent Locust users (closed loop); 1,4,16 sweeps the load")
    s.add_argument("--repeats", type=int, default=1, help="run every treatment this many times (the spread)")
    s.add_argument("--restart-cmd", default=os.environ.get("KVSCOPE_RESTART_CMD"), metavar="COMMAND",
                   help="restart scenarios: the command that restarts one config's server, {config} in it (no "
                        "shell; make bench sets it; default $KVSCOPE_RESTART_CMD)")
    s.add_argument("--queries", type=int, default=None,
                   help="queries per scenario (sessions for multiturn), over each scenario's num_queries")
    s.add_argument("--processes", type=int, default=1, help="Locust worker processes (distributed mode)")
    s.add_argument("--worker-hosts", default="",
                   help="Locust workers on these ssh hosts, one each (a cluster; default: the inventory's "
                        "locust_workers)")
    s.add_argument("--ssh-config", default=None,
                   help="ssh config naming the worker hosts (default: the inventory's kvscope_ssh_config, else "
                        "ssh's own)")
    s.add_argument("--master-host", default="",
                   help="address the workers reach this (master) host at (default: the inventory's "
                        "kvscope_locust_master)")
    s.add_argument("--rate", type=float, default=0.0, help="open loop: sessions per second (Poisson)")
    s.add_argument("--timeout-s", type=float, default=1800, help="the most each Locust phase of a treatment may run")
    s.add_argument("--run-id", default=None, help="the run folder's name (default: the time, UTC)")
    s.add_argument("--resume", action="store_true", help="continue the run folder of --run-id")
    s.add_argument("--report", action="store_true", help="score and write the report when the run ends")
    s.add_argument("--plan", action="store_true",
                   help="check everything and print the plan (servers, scenarios, load, run folder), then stop: "
                        "nothing is started or written")
    s.add_argument("--json", action="store_true",
                   help="with --report: print the verdicts, the detection power and the gate as JSON (for scripts) "
                        "instead of text; the progress goes to stderr")
    s.add_argument("--exact", action="store_true",
                   help="the servers serve batch-invariant (deployed with EXACT=1): equal means bitwise equal; "
                        "deployed servers in exact mode are scored so without it")
    _gate_options(s)
    s.set_defaults(func=cmd_bench)

    from kvscope.rollout.cli import add_parser as add_rollout

    _matrix_option(add_rollout(sub))

    s = sub.add_parser("report", help="score a run folder and write report.md, CSV and PNG (no server needed); "
                                      "a rollout's folder: rollout.md")
    s.add_argument("run", help="a run folder (results/<run-id>) or a rollout's")
    _gate_options(s)
    s.add_argument("--json", action="store_true",
                   help="print the verdicts, the detection power and the gate as JSON (for scripts) instead of text")
    s.add_argument("--out", default=None, metavar="DIR",
                   help="write report.md, report.html, the tables, plots and run.json into DIR (new or empty), "
                        "not the run folder")
    s.add_argument("--rewrite", action="store_true",
                   help="rewrite a published run's committed report even where this code renders it differently "
                        "(refused without it)")
    s.set_defaults(func=cmd_report)

    s = sub.add_parser("compress", help="gzip a run folder's JSONL files (records, workloads, status, ...) before "
                                        "publishing it (every reader takes either form; a published run is refused, "
                                        "and a compressed one is not resumed)")
    s.add_argument("run", help="a run folder (not yet committed)")
    s.set_defaults(func=cmd_compress)

    s = sub.add_parser("compare", help="put runs side by side (they must share a workload)")
    s.add_argument("runs", help="comma-separated run folders")
    s.add_argument("--out", default=None, help="a folder for comparison.md, comparison.html and its plot")
    s.set_defaults(func=cmd_compare)

    s = sub.add_parser("status", help="list the servers of a deployment folder and whether they run")
    s.add_argument("--run-dir", default=str(LOCAL_DEPLOYMENT), help="the deployment folder (deploy's kvscope_run_dir)")
    s.set_defaults(func=cmd_status)

    from kvscope.deploy.model import SHAPES

    s = sub.add_parser("build-model", help="build the tiny offline Qwen3 model (or another --shape)")
    s.add_argument("--out", required=True, help="the model folder to write")
    s.add_argument("--seed", type=int, default=0, help="the weights' random seed (the same seed, the same bytes)")
    s.add_argument("--shape", choices=list(SHAPES), default="tiny",
                   help="tiny (CPU tests), qwen3-4b (GPU runs), or a serving path's shape (docs/paths.md): "
                        "tiny-gemma3 (sliding window), tiny-deepseek-v2 (MLA), qwen3-32b-awq (int4 AWQ, GPU), "
                        "tiny-qwen3-next (hybrid linear attention + MTP head); all with random weights")
    s.set_defaults(func=cmd_build_model)
    return p


def main(argv: list[str] | None = None) -> int:
    return run_cli(build_parser(), argv)


if __name__ == "__main__":
    sys.exit(main())
