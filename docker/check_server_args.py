"""Check rendered server arguments with vLLM's own parser, in the vLLM environment (no GPU needed).

Reads `kvscope render` output; for every server it parses `server_args` with the OpenAI server's argument
parser, builds the engine arguments from them, and builds a KVTransferConfig from the JSON of
--kv-transfer-config. Prints one line per server and exits 1 if any fails.

    .venv-vllm/bin/python docker/check_server_args.py runs/cuda/rendered.json
"""

from __future__ import annotations

import json
import sys


def main(path: str) -> int:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import AsyncEngineArgs
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ModuleNotFoundError:  # vLLM <= 0.28 (the CUDA wheels): the OpenAI server's own module
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    failures = 0
    for server in json.loads(open(path).read())["kvscope_servers"]:
        args = server["server_args"]
        try:
            parsed = make_arg_parser(FlexibleArgumentParser()).parse_args(args)
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
            print(f"{server['config']}: {type(exc).__name__}: {exc}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
