"""report.html in a real browser (Debian's chromium, headless): a hostile run folder runs no script and forges
no verdict, and the plots render. `make test-deps` installs chromium; without it these tests skip."""

import re
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image
from test_report import four, make_run
from test_report_hostile import edit_records, forged_run

from kvscope.analyze import report

CHROMIUM = shutil.which("chromium")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (`make test-deps`)")

MARK = "document.documentElement.setAttribute('data-pwned', '{}')"
PAYLOADS = (f"<script>{MARK.format('script')}</script>"
            f"<img src=x onerror=\"{MARK.format('onerror')}\"><svg onload=\"{MARK.format('svg')}\"></svg>")


def browse(page, tmp_path, *args) -> subprocess.CompletedProcess:
    """Chromium, headless, on a local page (root needs --no-sandbox; a profile of its own in tmp_path)."""
    return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                           f"--user-data-dir={tmp_path / 'profile'}", *args, page.resolve().as_uri()],
                          capture_output=True, text=True, timeout=120, check=True)


def dom(page, tmp_path) -> str:
    return browse(page, tmp_path, "--dump-dom", "--virtual-time-budget=2000").stdout


def test_the_marker_shows_when_a_script_runs(tmp_path):
    # the payloads in a page without the report's escaping and policy: what the tests below must not see
    page = tmp_path / "plain.html"
    page.write_text(f"<!doctype html><html><body>{PAYLOADS}</body></html>")
    assert 'data-pwned="' in dom(page, tmp_path)


def test_a_hostile_run_folder_runs_no_script_and_forges_no_verdict_in_a_browser(tmp_path):
    run = forged_run(tmp_path / "run")
    edit_records(run, "apc", lambda r: {**r, "error": r["error"] + PAYLOADS} if not r["ok"] else r)
    report.write(run, min_hits=1)
    shown = dom(run / "report.html", tmp_path)
    assert "<html" in shown and not re.search(r"<html[^>]*data-pwned", shown)  # no payload ran
    assert not re.search(r"<(script|svg)\b", shown) and not re.search(r"<[^>]*\son\w+=", shown)  # text alone
    assert not re.search(r"""(href|src)=["']?javascript:""", shown)
    assert len(re.findall(r"<h2[^>]*>Verdicts</h2>", shown)) == 1
    assert shown.count('class="verdict-pass"') == 2  # the control's PASS, in the summary and the verdicts
    assert "HTTP 500 | **PASS** |" in shown.replace("&amp;", "&")  # the forged cell, as text


def saturated(png) -> int:
    """Pixels of a strong colour: the plots' lines and cells (text is grey, the verdict colours pale)."""
    rgb = np.asarray(Image.open(png).convert("RGB")).astype(int)
    return int(((rgb.max(axis=2) - rgb.min(axis=2)) > 80).sum())


def test_the_plots_render_in_a_browser(tmp_path):
    run = make_run(tmp_path / "run", four())
    report.write(run, min_hits=1)
    page = run / "report.html"
    assert len(re.findall(r'<img [^>]*src="data:image/png;base64,', dom(page, tmp_path))) == 4
    broken = tmp_path / "broken.html"  # the same page, its images' data spoilt: what a blocked plot looks like
    broken.write_text(re.sub(r"base64,[A-Za-z0-9+/=]+", "base64,AAAA", page.read_text()))
    shots = {}
    for name, html in (("report", page), ("broken", broken)):
        browse(html, tmp_path, "--window-size=1280,4500", f"--screenshot={tmp_path / name}.png")
        shots[name] = saturated(tmp_path / f"{name}.png")
    assert shots["report"] > 20000 and shots["broken"] < 1000, shots
