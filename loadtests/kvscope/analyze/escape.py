"""Strings from a run folder (records, run.json, status.jsonl) as markdown that shows them as written.

A run folder is shared and may be edited: a record's error is what a server sent. Written into report.md as it
is, such a string could end a table cell (`|`) or a line, forge a verdict in bold, a table or a heading, or
add a link (`[x](javascript:...)`, `<...>`). md() is the one way the report writes such a string; markup the
report writes itself is never passed through it.
"""

from __future__ import annotations

import re

LINE_BREAKS = re.compile(r"[\x00-\x1f\x7f\x85\u2028\u2029]+")  # a line ends at any of these in some reader
# emphasis, code, table cells, and the "(" that would make "[text]" a link or an image; "_" inside a word
# emphasises nothing, and stays as it is
SPECIAL = re.compile(r"[\\`*|]|(?<=\])\(|(?<![A-Za-z0-9])_|_(?![A-Za-z0-9])")
ENTITIES = {"&": "&amp;", "<": "&lt;"}  # HTML and autolinks open with "<"; a ">" inside a line is text


class Md(str):
    """Markdown the report wrote itself (a verdict in bold, a code span): md() leaves it as it is."""


def md(value: object, code: bool = False) -> str:
    """VALUE on one line, as markdown text (code=False: every markup character escaped) or as a code span
    (code=True: fenced by more backticks than it holds, so nothing in it ends it; report.html's reader keeps
    a `|` inside a code span in its table cell, GitHub's splits the cell there)."""
    if isinstance(value, Md):
        return value
    text = LINE_BREAKS.sub(" ", str(value))
    if code:
        fence = "`" * (max(map(len, re.findall("`+", text)), default=0) + 1)
        pad = " " if text.startswith("`") or text.endswith("`") else ""
        return f"{fence}{pad}{text}{pad}{fence}"
    text = re.sub("[&<]", lambda m: ENTITIES[m.group(0)], text)
    return SPECIAL.sub(lambda m: "\\" + m.group(0), text)
