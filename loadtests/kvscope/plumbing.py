"""kvscope's plumbing: the verbs the Ansible roles call on each host (`python -m kvscope.plumbing VERB`).

Users call `kvscope` (cli.py) or `make`; these verbs read and write the deployment's artifacts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kvscope import artifacts
from kvscope.commandline import DEFAULT_MATRIX, names, run_cli
from kvscope.config import matrix as matrix_mod
from kvscope.config.render import (
    cpu_kv_errors,
    hybrid_errors,
    model_config,
    model_errors,
    parse_overrides,
    render,
    topology_errors,
)
from kvscope.deploy import servers
from kvscope.deploy.folder import DeploymentFolder, ServerFolder


def cmd_render(args) -> int:
    m = matrix_mod.load(args.matrix, args.matrix_dir)
    chosen = matrix_mod.select(m, names(args.configs), args.platform)
    model = Path(args.model).resolve()
    if errors := model_errors(model):
        raise matrix_mod.ConfigError(f"model {model} cannot be served: {'; '.join(errors)} "
                                     "(the tiny default: `make model`; your own: MODEL=/path/to/hf-model)")
    config = model_config(model)
    if errors := topology_errors(config, chosen) + hybrid_errors(config, chosen):
        raise matrix_mod.ConfigError(f"model {model}: {'; '.join(errors)}")
    store_root = DeploymentFolder(Path(args.run_dir).resolve()).stores
    overrides = parse_overrides(args.overrides)
    rendered = artifacts.Rendered(kvscope_servers=[
        render(m, c, args.platform, model, store_root, args.host, overrides, args.port_offset, args.exact,
               args.vllm_version or None, args.serving_path or None)
        for c in chosen])
    if args.max_gpu_share:
        claims = {r.config: r.gpu_share for r in rendered.kvscope_servers}
        if sum(claims.values()) > args.max_gpu_share:
            raise matrix_mod.ConfigError(
                f"these servers claim {sum(claims.values()):.2f} of the node's memory together ({claims}, from "
                f"--gpu-memory-utilization; vLLM's default is {artifacts.DEFAULT_GPU_SHARE}); a unified-memory node "
                f"(GB10) allows {args.max_gpu_share}, leaving the rest to the CPU side and the CPU-RAM KV tiers: lower "
                "it in the matrix or deploy fewer configs per node")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    artifacts.write_json(out, rendered)
    print(f"rendered {', '.join(r.config for r in rendered.kvscope_servers)} for {args.platform} into {out}")
    return 0


def _cpu_flags() -> set[str]:
    """This host's CPU feature flags (/proc/cpuinfo); none where it is not Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return {f for line in text.splitlines() if line.startswith("flags") for f in line.split(":", 1)[1].split()}


def cmd_cpu_check(args) -> int:
    """What this host's CPU cannot serve of a rendered.json, said before any server starts."""
    rendered = artifacts.read_json(Path(args.rendered), artifacts.Rendered)
    if errors := cpu_kv_errors(rendered.kvscope_servers, _cpu_flags()):
        raise matrix_mod.ConfigError("; ".join(errors))
    return 0


def cmd_probe(args) -> int:
    code, message = servers.probe(Path(args.pid_file), args.port, args.host, args.definition)
    print(message)
    return code


def cmd_wait(args) -> int:
    code, lines = servers.wait(Path(args.pid_file), args.port, args.host, args.timeout_s, args.poll_s)
    print("\n".join(lines))
    return code


def cmd_stop(args) -> int:
    pid_file = Path(args.pid_file)
    print(f"{pid_file}: {servers.stop(pid_file, args.grace_s)}")
    servers.write_deployment(ServerFolder.of(pid_file).deployment.root)
    return 0


def cmd_manifest(args) -> int:
    from kvscope.deploy.model import model_hash

    folder = DeploymentFolder(args.run_dir)
    server = folder.server(args.config)
    rendered = servers.rendered_servers(Path(args.rendered))[args.config]
    model = Path(args.model)
    python = args.server_python
    doc = servers.manifest(server.pid, rendered, model, model_hash(model), args.host,
                           servers.package_versions(python) if python else None, args.container,
                           servers.connector_imports(python, servers.connector_modules(rendered), rendered.env)
                           if python else None)
    artifacts.write_json(server.manifest, doc)
    server.failed.unlink(missing_ok=True)
    servers.write_deployment(folder.root)
    failed = {m: why for m, why in doc.connector_imports.items() if why != "ok"}
    print(f"{args.config}: port {doc.port} pid {doc.pid} vLLM {doc.vllm_version} KV {doc.kv_capacity_tokens} tokens"
          + (f"; connector modules that do not import: {failed}" if failed else ""))
    return 0


def cmd_failed(args) -> int:
    doc = servers.record_failure(Path(args.run_dir), args.config, args.why)
    servers.write_deployment(Path(args.run_dir))
    print(f"{args.config}: {doc.why}: {doc.error}")
    return 0


def cmd_image_info(args) -> int:
    from kvscope.deploy.images import info

    print(json.dumps(info(args.image, base=args.base)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvscope.plumbing", description=__doc__)
    p.add_argument("--matrix", type=Path, default=DEFAULT_MATRIX, help="storage-config matrix YAML")
    p.add_argument("--matrix-dir", type=Path, default=None,
                   help="the folder its relative paths are in (default: the matrix file's; a copy's: the original's)")
    sub = p.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("render", help="validate, then render selected configs into rendered.json")
    s.add_argument("--configs", required=True, help="the configs of the matrix to render, comma-separated")
    s.add_argument("--max-gpu-share", type=float, default=0.0,
                   help="refuse when the servers' --gpu-memory-utilization add up to more (a GB10's one pool)")
    s.add_argument("--platform", choices=["cpu", "cuda"], required=True, help="the platform the servers run on")
    s.add_argument("--model", required=True, help="the Hugging Face model folder the servers serve")
    s.add_argument("--run-dir", required=True, help="the deployment folder; the configs' stores go under its stores/")
    s.add_argument("--host", default="127.0.0.1", help="the address each server listens on")
    s.add_argument("--out", required=True, help="the rendered.json to write")
    s.add_argument("--overrides", default="{}", metavar="JSON",
                   help='server flags over every config\'s, e.g. \'{"dtype": "bfloat16"}\'')
    s.add_argument("--port-offset", type=int, default=0, help="added to every config's port")
    s.add_argument("--serving-path", default="", metavar="NAME",
                   help="a serving path of the matrix's 'paths' (fp8-kv, ...): its flags over every config's")
    s.add_argument("--exact", action="store_true",
                   help="serve batch-invariant: the platform's exact mode (matrix: platforms.<p>.exact)")
    s.add_argument("--vllm-version", default="",
                   help="the serving vLLM's version (exact mode's workarounds by release); empty: unknown, all apply")
    s.set_defaults(func=cmd_render)

    s = sub.add_parser("cpu-check", help="refuse what this host's CPU cannot serve (fp8 KV without AVX-512 or AMX)")
    s.add_argument("--rendered", required=True, help="the rendered.json its servers are to start from")
    s.set_defaults(func=cmd_cpu_check)

    s = sub.add_parser("probe", help="exit 0 healthy, 1 starting, 3 not running, 4 port held by another process, "
                                      "5 started from another definition")
    s.add_argument("--pid-file", required=True, help="the server.pid the server was started under")
    s.add_argument("--port", type=int, required=True, help="the port the server listens on")
    s.add_argument("--host", default="127.0.0.1", help="the address the server is reached at")
    s.add_argument("--definition", default=None,
                   help="the digest of the flags and environment it should run (server.definition records its own)")
    s.set_defaults(func=cmd_probe)

    s = sub.add_parser("wait", help="probe until healthy, dead or timed out; print each change of state once")
    s.add_argument("--pid-file", required=True, help="the server.pid the server was started under")
    s.add_argument("--port", type=int, required=True, help="the port the server listens on")
    s.add_argument("--host", default="127.0.0.1", help="the address the server is reached at")
    s.add_argument("--timeout-s", type=float, default=600.0, help="the most seconds to wait for healthy")
    s.add_argument("--poll-s", type=float, default=2.0, help="seconds between probes")
    s.set_defaults(func=cmd_wait)

    s = sub.add_parser("stop", help="stop the process group recorded in a pid file")
    s.add_argument("--pid-file", required=True, help="the server.pid the server was started under")
    s.add_argument("--grace-s", type=float, default=30.0, help="seconds from SIGTERM to SIGKILL")
    s.set_defaults(func=cmd_stop)

    s = sub.add_parser("manifest", help="write a live server's manifest into the run folder")
    s.add_argument("--run-dir", required=True, help="the deployment folder (deployment.json, <config>/)")
    s.add_argument("--config", required=True, help="the config whose server is live")
    s.add_argument("--rendered", required=True, help="the rendered.json the server was started from")
    s.add_argument("--model", required=True, help="the model folder it serves (its hash is recorded)")
    s.add_argument("--host", default="127.0.0.1", help="the address the server is reached at")
    s.add_argument("--server-python", default=None,
                   help="record the package versions of this interpreter (a shell-quoted command)")
    s.add_argument("--container", default=None, help="the server runs in this container (container runtime)")
    s.set_defaults(func=cmd_manifest)

    s = sub.add_parser("failed", help="record that a server did not come up, with its log's first error line")
    s.add_argument("--run-dir", required=True, help="the deployment folder (deployment.json, <config>/)")
    s.add_argument("--config", required=True, help="the config whose server did not come up")
    s.add_argument("--why", required=True, help="what the deployment saw, e.g. 'not healthy in time'")
    s.set_defaults(func=cmd_failed)

    s = sub.add_parser("image-info", help="build arguments, labels and content tag of an image (JSON)")
    s.add_argument("--image", choices=["gb10", "gb10-pypi", "cpu"], required=True, help="the image (docker/<image>/)")
    s.add_argument("--base", help="the image's base as built (docker/base/build.sh's output)")
    s.set_defaults(func=cmd_image_info)
    return p


if __name__ == "__main__":
    sys.exit(run_cli(build_parser(), sys.argv[1:]))
