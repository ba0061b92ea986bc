"""What kvscope's two command lines share: `kvscope` (cli.py, the user's) and `python -m kvscope.plumbing` (the
Ansible roles'): the default matrix, comma-separated names, run folder names, and bad input as exit code 2."""

from __future__ import annotations

import argparse
import re
import sys

from kvscope import HARNESS
from kvscope.config import matrix as matrix_mod

DEFAULT_MATRIX = HARNESS / "matrix.yaml"
RUN_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # one folder name under --results, never a path


def names(text: str) -> list[str]:
    return [n.strip() for n in text.split(",") if n.strip()]


def run_cli(parser: argparse.ArgumentParser, argv: list[str] | None) -> int:
    """Parse, run, and turn bad input into exit code 2 with a message naming the item."""
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except matrix_mod.ConfigError as exc:
        print(f"kvscope: invalid configuration:\n{exc}", file=sys.stderr)
        return 2
    except ValueError as exc:  # RunError and ArtifactError name their file
        print(f"kvscope: {exc}", file=sys.stderr)
        return 2
