"""report.html: the report as one self-contained page (tables, plots inlined), readable offline.

Its text comes from run folders, which are shared and may be edited (a record's error is what a server
sent): HTML in it is shown as text, and the page's policy forbids scripts and fetching anything.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from html import escape

import markdown

from kvscope.artifacts import Verdict

STYLE = """
body { font: 14px/1.45 system-ui, sans-serif; max-width: 1200px; margin: 2em auto; padding: 0 1em; color: #222; }
table { border-collapse: collapse; margin: 0.8em 0; font-size: 12.5px; display: block; overflow-x: auto; }
th, td { border: 1px solid #ccc; padding: 3px 7px; text-align: left; vertical-align: top; }
body > table:first-of-type td:nth-child(3) { min-width: 22em; }  /* the summary's advice */
body > table:first-of-type td:nth-child(8) { white-space: nowrap; }  /* its confidence interval */
th { background: #f3f3f3; position: sticky; top: 0; }
tr:nth-child(even) td { background: #fafafa; }
img { max-width: 100%; border: 1px solid #ddd; }
code { background: #f4f4f4; padding: 0 3px; font-size: 12px; }
details summary { cursor: pointer; color: #555; }
h1 { font-size: 1.6em; } h2 { border-bottom: 1px solid #ddd; padding-bottom: 0.2em; margin-top: 1.6em; }
strong[class^="verdict-"] { padding: 0 4px; border-radius: 3px; }
.verdict-pass { background: #d8f0d8; } .verdict-fail, .verdict-crashed, .verdict-invalid { background: #f6d3d3; }
.verdict-unverified, .verdict-incomplete { background: #f8ebc4; } .verdict-golden { background: #e3e3e3; }
"""
# A verdict as the report writes it (in bold), coloured so that a page is read at a glance.
VERDICT = re.compile(f"<strong>({'|'.join(Verdict)})</strong>")
POLICY = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
# The one piece of HTML a report writes itself, the folded server flags, as it reads once HTML is text.
FOLD = re.compile(r'<p>&lt;details markdown="1"&gt;&lt;summary&gt;(.*?)&lt;/summary&gt;</p>')
UNFOLD = "<p>&lt;/details&gt;</p>"


def _inline(images: Mapping[str, bytes], match: re.Match) -> str:
    png = images.get(match.group(1))
    return match.group(0) if png is None else f'src="data:image/png;base64,{base64.b64encode(png).decode()}"'


def render(text: str, title: str, images: Mapping[str, bytes]) -> str:
    """One HTML page from the report's markdown, its PNGs (file name -> bytes) embedded; raw HTML in the text
    is escaped."""
    md = markdown.Markdown(extensions=["tables"])
    md.preprocessors.deregister("html_block")
    md.inlinePatterns.deregister("html")
    body = FOLD.sub(r"<details><summary>\1</summary>", md.convert(text)).replace(UNFOLD, "</details>")
    body = re.sub(r'src="([\w.-]+\.png)"', lambda m: _inline(images, m), body)
    body = VERDICT.sub(lambda m: f'<strong class="verdict-{m.group(1).lower()}">{m.group(1)}</strong>', body)
    return (f"<!doctype html>\n<html><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{POLICY}\"><title>{escape(title)}</title>"
            f"<style>{STYLE}</style></head><body>\n{body}\n</body></html>\n")
