"""JSONL files of dataclass rows: one row a line, and a bad line named by file and line number."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


def read(path: Path, cls: type[T], what: str) -> list[T]:
    """All rows of `path` as `cls`; a truncated or foreign line raises ValueError naming `path:line`."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            try:
                out.append(cls(**json.loads(line)))
            except (json.JSONDecodeError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: truncated or not a kvscope {what}: {exc}") from exc
    return out
