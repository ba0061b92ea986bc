"""The pages that quote measurements quote the runs they link to: a number in README.md or docs/status.md on a
line that links to results/<run>/ is in that run's README.md, report.md or CSVs, and README's sample output is
copied from the report it names. Every repository path the docs name exists."""

import re

import pytest
from conftest import REPO

PAGES = ["README.md", "docs/status.md"]
RUN_LINK = re.compile(r"\]\((?:\.\./)?results/([\w.-]+)/[^)]*\)")
LINK = re.compile(r"\[[^\]]*\]\([^)]*\)")
SCIENTIFIC = re.compile(r"\d+(?:\.\d+)?e-?\d+")  # 3.6e-5 is spelt 3.58e-05 in a report: not compared
# 757, 1.29, 1,590 and 1.29x; not the digits of a name (H200, fp32, 8k, Qwen3-4B) or of a version (0.26.0)
NUMBER = re.compile(r"(?<![\w.])(\d{1,3}(?:,\d{3})+|\d+(?:\.\d+)?)(?!\.?\d|,\d{3}|[A-Za-wyz_])")
REPO_PATH = re.compile(r"(?<![\w/.-])(?:docker|loadtests|connector|ansible|tests)/[\w./-]*\w")


def numbers(line: str) -> list[str]:
    return NUMBER.findall(SCIENTIFIC.sub(" ", LINK.sub(" ", line)))


def run_text(run: str) -> str:
    folder = REPO / "results" / run
    files = [f for f in folder.rglob("*") if f.name in ("README.md", "report.md") or f.suffix == ".csv"]
    return "\n".join(f.read_text() for f in sorted(files))


def in_text(number: str, text: str) -> bool:
    return re.search(rf"(?<![\d.]){re.escape(number)}(?!\d)", text) is not None


def stray_numbers(page: str) -> list[str]:
    """'page:line: number not in run' for each number on a line that links to a run and is in none of them."""
    stray, texts = [], {}
    for n, line in enumerate((REPO / page).read_text().splitlines(), 1):
        runs = RUN_LINK.findall(line)
        for run in runs:
            if run not in texts:
                assert (REPO / "results" / run).is_dir(), f"{page}:{n}: links to results/{run}, which is no run"
                texts[run] = run_text(run)
        stray += [f"{page}:{n}: {x} not in {', '.join(runs)}" for x in numbers(line) if runs
                  and not any(in_text(x, texts[r]) for r in runs)]
    return stray


@pytest.mark.parametrize("page", PAGES)
def test_every_number_on_a_line_that_links_a_run_is_in_that_run(page):
    assert stray_numbers(page) == []


def test_a_planted_wrong_number_is_caught(tmp_path, monkeypatch):
    page = (REPO / "docs/status.md").read_text()
    assert "1.29" in page
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs/status.md").write_text(page.replace("1.29", "1.28", 1))
    (tmp_path / "results").symlink_to(REPO / "results")
    monkeypatch.setitem(globals(), "REPO", tmp_path)  # stray_numbers reads this module's REPO
    assert any(": 1.28 not in " in s for s in stray_numbers("docs/status.md"))


def test_the_readme_sample_output_is_copied_from_the_report_it_names():
    lines = (REPO / "README.md").read_text().splitlines()
    start = lines.index("```text")  # the sample output; the paragraph's last line names its run's report.md
    run = RUN_LINK.findall(next(line for line in reversed(lines[:start]) if line))
    assert run, "the line before README's sample output links to results/<run>/report.md"
    report = (REPO / "results" / run[0] / "report.md").read_text().splitlines()
    sample = lines[start + 1:lines.index("```", start)]
    assert [line for line in sample if line != "..." and line not in report] == []


@pytest.mark.parametrize("page", ["README.md", *sorted(p.relative_to(REPO).as_posix()
                                                      for p in (REPO / "docs").glob("*.md"))])
def test_every_repository_path_a_page_names_exists(page):
    named = set(REPO_PATH.findall((REPO / page).read_text()))
    assert sorted(p for p in named if not (REPO / p).exists()) == []


def test_the_readme_stays_a_front_page():
    # measurement history lives in each run's README and docs/status.md, not here (issue 62)
    assert len((REPO / "README.md").read_text().splitlines()) <= 130


def test_the_readme_docs_table_lists_every_page_in_docs():
    rows = [line for line in (REPO / "README.md").read_text().splitlines() if line.startswith("| [docs/")]
    listed = {line.split("](", 1)[1].split(")", 1)[0] for line in rows}
    assert {p.relative_to(REPO).as_posix() for p in (REPO / "docs").glob("*.md")} - listed == set()
