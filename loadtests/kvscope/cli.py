"""kvscope's command line: the verbs the Makefile and the Ansible roles call."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvscope import HARNESS
from kvscope.config import matrix as matrix_mod
from kvscope.config.render import parse_overrides, render
from kvscope.deploy import servers

EXIT_CODES = """exit codes of bench --report and report (the gate):
  0  every verdict is what its role expects (candidates and control PASS, canaries FAIL)
  1  the gate fails: a FAIL where PASS was expected, a canary kvscope missed too often, a crash
  2  bad input: the matrix, a selection, a scenario or a run folder (nothing was deployed or scored)
  3  inconclusive: nothing failed, but a verdict is INCOMPLETE, UNVERIFIED or INVALID"""
DEFAULT_MATRIX = HARNESS / "matrix.yaml"


def _names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def cmd_validate(args) -> int:
    m = matrix_mod.load(args.matrix)
    if args.configs:
        matrix_mod.select(m, _names(args.configs), args.platform)
    print(f"{args.matrix}: {len(m.configs)} configs valid: {', '.join(c.name for c in m.configs)}")
    return 0


def cmd_render(args) -> int:
    m = matrix_mod.load(args.matrix)
    chosen = matrix_mod.select(m, _names(args.configs), args.platform)
    model = Path(args.model).resolve()
    if not (model / "config.json").is_file():
        raise matrix_mod.ConfigError(f"model folder {model} has no config.json: run `make model` first")
    store_root = Path(args.run_dir).resolve() / "stores"
    overrides = parse_overrides(args.overrides)
    rendered = [render(m, c, args.platform, model, store_root, args.host, overrides, args.port_offset) for c in chosen]
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"kvscope_servers": rendered}, indent=2) + "\n")
    print(f"rendered {', '.join(r['name'] for r in rendered)} for {args.platform} into {out}")
    return 0


def cmd_build_model(args) -> int:
    from kvscope.deploy.model import build

    digest = build(Path(args.out), seed=args.seed, shape=args.shape)
    print(f"built {args.out} sha256={digest}")
    return 0


def cmd_probe(args) -> int:
    code, message = servers.probe(Path(args.pid_file), args.port, args.host)
    print(message)
    return code


def cmd_stop(args) -> int:
    pid_file = Path(args.pid_file)
    print(f"{pid_file}: {servers.stop(pid_file, args.grace_s)}")
    servers.write_deployment(pid_file.parent.parent)
    return 0


def cmd_manifest(args) -> int:
    from kvscope.deploy.model import model_hash

    run_dir = Path(args.run_dir)
    rendered = servers.rendered_servers(Path(args.rendered))[args.config]
    model = Path(args.model)
    doc = servers.manifest(args.config, rendered["port"], run_dir / args.config / "server.pid", rendered,
                           model, model_hash(model), args.host,
                           servers.package_versions(args.server_python) if args.server_python else None,
                           args.container)
    (run_dir / args.config / "manifest.json").write_text(json.dumps(doc, indent=2) + "\n")
    (run_dir / args.config / "failed.json").unlink(missing_ok=True)
    servers.write_deployment(run_dir)
    print(f"{args.config}: port {doc['port']} pid {doc['pid']} vLLM {doc['vllm_version']} "
          f"KV {doc['kv_capacity_tokens']} tokens")
    return 0


def cmd_failed(args) -> int:
    doc = servers.record_failure(Path(args.run_dir), args.config, args.why)
    servers.write_deployment(Path(args.run_dir))
    print(f"{args.config}: {doc['why']}: {doc['error']}")
    return 0


def cmd_status(args) -> int:
    rows = servers.status(Path(args.run_dir))
    if not rows:
        print(f"nothing deployed under {args.run_dir}")
    for row in rows:
        print(f"{row['config']:<16} port {row['port'] or '-':<6} pid {row['pid'] or '-':<8} {row['state']}")
    return 0


def cmd_bench(args) -> int:
    from kvscope.run import treatments as bench

    remote = None
    if args.worker_hosts:
        if not args.master_host:
            raise matrix_mod.ConfigError("--worker-hosts needs --master-host: the address workers reach this host at")
        remote = {"hosts": _names(args.worker_hosts), "ssh_config": args.ssh_config, "master_host": args.master_host}
    folder = bench.run([Path(d) for d in _names(args.deployment)], Path(args.results), Path(args.scenarios),
                       _names(args.configs), _names(args.scenarios_list), users=args.users, processes=args.processes,
                       rate=args.rate, timeout_s=args.timeout_s, command=" ".join(sys.argv), run_id=args.run_id,
                       remote=remote, resume=args.resume)
    print(f"records written to {folder}")
    return _report(folder, args) if args.report else 0


def _report(folder: Path, args) -> int:
    from kvscope.analyze import report

    code = report.write(folder, args.min_hits, args.max_failed)
    print(report.console(folder))
    print(f"report: {folder / 'report.md'}\ngate: {report.GATE_WORDS[code]}")
    return code


def cmd_report(args) -> int:
    return _report(Path(args.run), args)


def cmd_compare(args) -> int:
    from kvscope.analyze import report

    print(report.compare([Path(r) for r in _names(args.runs)], Path(args.out) if args.out else None))
    return 0


def cmd_image_info(args) -> int:
    from kvscope.deploy.images import info

    print(json.dumps(info(args.image)))
    return 0


def _gate_options(s) -> None:
    from kvscope.analyze.verdicts import MAX_FAILED_SHARE, MIN_VERIFIED_HITS

    s.add_argument("--min-hits", type=int, default=MIN_VERIFIED_HITS,
                   help="verified cache hits a config needs for PASS (fewer: UNVERIFIED)")
    s.add_argument("--max-failed", type=float, default=MAX_FAILED_SHARE,
                   help="share of failed requests a config may have before it is INCOMPLETE")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvscope", description=__doc__, epilog=EXIT_CODES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX, help="storage-config matrix YAML")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("validate", help="validate the matrix (and a selection for a platform)")
    s.add_argument("--configs", default="")
    s.add_argument("--platform", choices=["cpu", "cuda"], default="cpu")
    s.set_defaults(func=cmd_validate)

    s = sub.add_parser("render", help="validate, then render selected configs into server arguments (JSON)")
    s.add_argument("--configs", required=True)
    s.add_argument("--platform", choices=["cpu", "cuda"], required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--run-dir", required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--out", required=True)
    s.add_argument("--overrides", default="{}", metavar="JSON",
                   help='server flags over every config\'s, e.g. \'{"dtype": "bfloat16"}\'')
    s.add_argument("--port-offset", type=int, default=0, help="added to every config's port")
    s.set_defaults(func=cmd_render)

    s = sub.add_parser("build-model", help="build the tiny offline Qwen3 model")
    s.add_argument("--out", required=True)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--shape", choices=["tiny", "qwen3-4b"], default="tiny")
    s.set_defaults(func=cmd_build_model)

    s = sub.add_parser("probe", help="exit 0 healthy, 1 starting, 3 not running, 4 port held by another process")
    s.add_argument("--pid-file", required=True)
    s.add_argument("--port", type=int, required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.set_defaults(func=cmd_probe)

    s = sub.add_parser("stop", help="stop the process group recorded in a pid file")
    s.add_argument("--pid-file", required=True)
    s.add_argument("--grace-s", type=float, default=30.0)
    s.set_defaults(func=cmd_stop)

    s = sub.add_parser("manifest", help="write a live server's manifest into the run folder")
    s.add_argument("--run-dir", required=True)
    s.add_argument("--config", required=True)
    s.add_argument("--rendered", required=True)
    s.add_argument("--model", required=True)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--server-python", default=None, help="record the package versions of this interpreter")
    s.add_argument("--container", default=None, help="the server runs in this container (container runtime)")
    s.set_defaults(func=cmd_manifest)

    s = sub.add_parser("bench", help="run scenarios against deployed configs; records into results/<run-id>/")
    s.add_argument("--deployment", default="runs/local/deployment.json",
                   help="deployment.json of each host, comma-separated")
    s.add_argument("--results", default="results")
    s.add_argument("--scenarios-file", dest="scenarios", default=str(DEFAULT_MATRIX.parent / "scenarios.yaml"))
    s.add_argument("--configs", default="", help="comma-separated; default every deployed config")
    s.add_argument("--scenarios", dest="scenarios_list", default="rag-zipf,rag-relevance,multiturn,repeat-867")
    s.add_argument("--users", type=int, default=2, help="concurrent Locust users (closed loop)")
    s.add_argument("--processes", type=int, default=1, help="Locust worker processes (distributed mode)")
    s.add_argument("--worker-hosts", default="", help="Locust workers on these ssh hosts, one each (a cluster)")
    s.add_argument("--ssh-config", default="runs/netns/ssh/config", help="ssh config naming the worker hosts")
    s.add_argument("--master-host", default="", help="address the workers reach this (master) host at")
    s.add_argument("--rate", type=float, default=0.0, help="open loop: sessions per second (Poisson)")
    s.add_argument("--timeout-s", type=float, default=1800)
    s.add_argument("--run-id", default=None)
    s.add_argument("--resume", action="store_true", help="continue the run folder of --run-id")
    s.add_argument("--report", action="store_true", help="score and write the report when the run ends")
    _gate_options(s)
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("report", help="score a run folder and write report.md, CSV and PNG (no server needed)")
    s.add_argument("run")
    _gate_options(s)
    s.set_defaults(func=cmd_report)

    s = sub.add_parser("compare", help="put runs side by side (they must share a workload)")
    s.add_argument("runs", help="comma-separated run folders")
    s.add_argument("--out", default=None)
    s.set_defaults(func=cmd_compare)

    s = sub.add_parser("image-info", help="build arguments, labels and content tag of an image (JSON)")
    s.add_argument("--image", choices=["gb10", "cpu"], required=True)
    s.set_defaults(func=cmd_image_info)

    s = sub.add_parser("failed", help="record that a server did not come up, with its log's first error line")
    s.add_argument("--run-dir", required=True)
    s.add_argument("--config", required=True)
    s.add_argument("--why", required=True)
    s.set_defaults(func=cmd_failed)

    s = sub.add_parser("status", help="list the servers of a run folder and whether they run")
    s.add_argument("--run-dir", required=True)
    s.set_defaults(func=cmd_status)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except matrix_mod.ConfigError as exc:
        print(f"kvscope: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # report.RunError and unreadable records name their file
        print(f"kvscope: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
