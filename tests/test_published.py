"""Every published run re-renders, from its raw records, to the report, tables and run.json it publishes: a
report in results/ can never silently disagree with the code."""

import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from conftest import REPO

from kvscope.analyze import plots, report

# the runs the checkout publishes (tracked), not a run folder `make bench` just wrote beside them
RUNS = sorted((REPO / p).parent for p in subprocess.run(["git", "ls-files", "results/*/run.json"], cwd=REPO,
                                                        capture_output=True, text=True, check=True).stdout.split())
SMALL = "2026-12-01-h200-vllm0.26-tiny-fp32-lmcache-mp-1user"  # a small published run: fast to re-render


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_a_published_run_rerenders_to_the_report_and_tables_it_publishes(run, tmp_path, monkeypatch):
    copy = shutil.copytree(run, tmp_path / "results" / run.name)
    derived = [f.name for f in sorted(run.iterdir()) if f.suffix in (".csv", ".png") or f.name == "report.md"]
    for name in derived:  # what the report writes is written anew, never compared with itself
        (copy / name).unlink()
    monkeypatch.chdir(tmp_path)  # the report names its folder as `make report RUN=results/<id>` gives it
    report.write(Path("results") / run.name)
    assert [f.name for f in sorted(copy.iterdir()) if f.suffix in (".csv", ".png") or f.name == "report.md"] == derived
    for name in [*derived, "run.json"]:
        if name.endswith(".png"):  # drawn by the pinned matplotlib alike: a pixel apart at most, as CPUs differ
            assert plots.drawn_alike((copy / name).read_bytes(), (run / name).read_bytes()), f"{run.name}/{name}"
        else:
            assert (copy / name).read_text() == (run / name).read_text(), f"{run.name}/{name}"


def test_a_loaded_run_scores_and_renders_with_none_of_its_input_files_left(tmp_path, monkeypatch):
    # the folder is read once (loaded.load); scoring and rendering read no input file again
    from kvscope.analyze import loaded

    name = "2026-12-06-cpu-vllm0.32-tiny-gemma3-sliding-window-n80"  # continuations, fault and load logs
    run = REPO / "results" / name
    copy = shutil.copytree(run, tmp_path / "results" / name)
    monkeypatch.chdir(tmp_path)
    data = loaded.load(Path("results") / name)
    assert data.faults and data.loads and any(data.continuations.values())
    inputs = ["records", "continuations", "faults", "loads", "workloads", "run.json", "status.jsonl.gz"]
    for entry in inputs:
        if (copy / entry).is_dir():
            shutil.rmtree(copy / entry)
        else:
            (copy / entry).unlink()
    for f in copy.iterdir():
        if f.suffix == ".csv" or f.name == "report.md":
            f.unlink()
    report.write_report(report.analyze(data))
    for f in sorted(run.iterdir()):
        if f.suffix == ".csv" or f.name in ("report.md", "run.json"):
            assert (copy / f.name).read_text() == f.read_text(), f.name


def test_the_results_index_names_each_runs_own_machine():
    # results/README.md once called an AMD EPYC run "Intel Xeon": its CPU, cores, memory and GPU come from run.json
    import re

    from kvscope.artifacts import RunInfo, read_json

    rows = [line for line in (REPO / "results" / "README.md").read_text().splitlines() if line.startswith("| [")]
    checked = 0
    for row in rows:
        name = row.split("](", 1)[0][3:]
        if not (REPO / "results" / name / "run.json").exists():  # a repro's folder: no bench, no run.json
            continue
        m = read_json(REPO / "results" / name / "run.json", RunInfo).machine
        machine = row.split(" | ")[2]
        for vendor in ("Intel", "AMD"):
            assert vendor in m.cpu or vendor not in machine, (name, m.cpu, machine)
        assert all(int(n) == m.cores for n in re.findall(r"(\d+)-core", machine)), (name, m.cores, machine)
        assert all(abs(float(g) - m.memory_gib) < 0.5 for g in re.findall(r"x86_64(?: VM)?, ([\d.]+) GiB", machine)), (
            name, m.memory_gib, machine)
        if m.gpu:
            assert m.gpu.split(",")[0].removeprefix("NVIDIA ") in machine, (name, m.gpu, machine)
        else:
            assert not re.search(r"NVIDIA|H[12]00|GB10", machine), (name, machine)
        checked += 1
    assert checked == len(RUNS)


def test_every_published_run_keeps_its_jsonl_files_gzipped():
    # results/ was 155 MB, 100 of them plain records in 30 of 49 runs, and 92 MB with the records gzipped: the
    # workloads, continuations and status.jsonl were the next 34 MB. A run is published with every JSONL file
    # gzipped (`kvscope compress RUN`, read alike); an empty file says nothing was recorded
    tracked = subprocess.run(["git", "ls-files", "results/*.jsonl"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()
    assert [p for p in tracked if (REPO / p).stat().st_size] == []


def test_results_publishes_no_regenerable_file_at_any_depth():
    # results/ held ~524 Locust CSVs and HTML pages that embed the PNGs again; a comparison's page in a run's
    # subfolder stayed after: report.html, comparison.html and locust/ are ignored wherever make writes them
    import subprocess

    def ignored(path: str) -> bool:
        return subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=REPO).returncode == 0

    tracked = subprocess.run(["git", "ls-files", "-ci", "--exclude-standard", "--", "results"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout
    assert tracked == ""
    for path in ("results/r/report.html", "results/r/locust/apc__s.measure_stats.csv",
                 "results/r/mode-cost/comparison.html", "results/r/part/report.html"):
        assert ignored(path), path
    for path in ("results/r/records/apc__s.jsonl", "results/r/report.md", "results/r/run.json",
                 "results/r/summary.csv", "results/r/ttft_cdf.png", "results/r/mode-cost/comparison.md"):
        assert not ignored(path), path


def test_every_relative_link_in_the_markdown_resolves_in_a_clone():
    # a loose build log was dropped for the facts in docker/README.md, and results/ keeps no regenerable page:
    # a link must name a tracked file or folder (an ignored report.html is not in a clone)
    import os
    import re
    import subprocess

    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout
    paths = {p for f in tracked.splitlines() for p in [f, *(str(d) for d in Path(f).parents)]}
    broken = []
    for name in (f for f in tracked.splitlines() if f.endswith(".md")):
        text = re.sub(r"```.*?```", "", (REPO / name).read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            path = os.path.normpath(Path(name).parent / target.split("#")[0])
            if not re.match(r"[a-z]+:|#", target) and path not in paths:
                broken.append((name, target))
    assert broken == []


def test_report_json_gives_a_published_runs_verdicts_and_gate_for_scripts(tmp_path):
    import json
    import shutil
    import subprocess
    import sys

    name = SMALL
    run = shutil.copytree(REPO / "results" / name, tmp_path / name)
    out = subprocess.run([sys.executable, "-m", "kvscope.cli", "report", str(run), "--json"], cwd=REPO,
                         capture_output=True, text=True, timeout=300)
    doc = json.loads(out.stdout)  # nothing but the document on stdout
    published = pd.read_csv(REPO / "results" / name / "verdicts.csv")
    assert [v["verdict"] for v in doc["verdicts"]] == list(published.verdict)
    assert doc["gate"]["exit"] == out.returncode and doc["gate"]["words"].endswith(f"(exit {out.returncode})")


def test_bench_report_json_prints_the_verdicts_alone_on_stdout_and_its_progress_on_stderr(tmp_path, capsys,
                                                                                          monkeypatch):
    # docs/fidelity.md said `kvscope bench --report` takes --json as `kvscope report` does; bench refused it
    import json

    from kvscope import cli
    from kvscope.run import plan, treatments

    name = SMALL
    run = shutil.copytree(REPO / "results" / name, tmp_path / name)

    def bench(*args, **kwargs):
        print("[1/1] golden x rag-zipf: warm-up, reset, measure 20 requests (1.0 s)")
        return run

    monkeypatch.setattr(plan, "build", lambda options: None)  # the report is under test, not the plan
    monkeypatch.setattr(treatments, "run", bench)
    code = cli.main(["bench", "--report", "--json", "--results", str(tmp_path)])
    out, err = capsys.readouterr()
    doc = json.loads(out)
    assert doc["gate"]["exit"] == code and doc["run"] == str(run) and "[1/1] golden" in err
    assert cli.main(["bench", "--json"]) == 2  # the verdicts come from the report
    assert "--json" in capsys.readouterr().err


def test_every_option_of_every_command_says_what_it_does():
    # kvscope's and the plumbing's (`python -m kvscope.plumbing VERB --help`, what the Ansible roles call)
    import argparse

    from kvscope import cli, plumbing

    def parsers(p):
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub in action.choices.values():
                    yield from parsers(sub)

    silent = [(p.prog, a.dest) for top in (cli.build_parser(), plumbing.build_parser()) for p in parsers(top)
              for a in p._actions if not a.help and not isinstance(a, argparse._SubParsersAction)]
    assert silent == []


def _committed_copy(tmp_path, name):
    """A published run in a git repository of its own, as results/<name> is in a clone."""
    import subprocess

    run = shutil.copytree(REPO / "results" / name, tmp_path / "results" / name)
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "publish"], check=True)
    return run


def test_report_refuses_to_rewrite_a_committed_report_that_the_code_renders_differently(tmp_path, monkeypatch, capsys):
    from kvscope import cli

    name = SMALL
    run = _committed_copy(tmp_path, name)
    stale = (run / "report.md").read_text() + "a line the code no longer writes\n"
    (run / "report.md").write_text(stale)
    before = {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()}
    monkeypatch.chdir(tmp_path)
    assert cli.main(["report", f"results/{name}"]) == 2
    assert "REWRITE=1" in capsys.readouterr().err
    assert {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()} == before  # nothing written
    cli.main(["report", f"results/{name}", "--rewrite"])
    assert (run / "report.md").read_text() == (REPO / "results" / name / "report.md").read_text()


def test_report_keeps_a_published_plot_that_it_draws_a_pixel_apart(tmp_path, monkeypatch):
    # as drawn on another CPU (numpy's log10 with or without AVX-512): alike, so the published bytes stay and
    # the checkout stays clean
    import io

    import numpy as np
    from PIL import Image

    from kvscope import cli

    run = _committed_copy(tmp_path, SMALL)
    png = run / "ttft_cdf.png"
    pixels = np.asarray(Image.open(png)).copy()
    pixels[:, 200:] = pixels[:, 199:-1].copy()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="png")
    png.write_bytes(buf.getvalue())
    monkeypatch.chdir(tmp_path)
    assert cli.main(["report", f"results/{SMALL}"]) != 2
    assert png.read_bytes() == buf.getvalue()


def test_report_rerenders_a_committed_report_it_renders_alike_and_writes_its_html(tmp_path, monkeypatch):
    from kvscope import cli

    name = SMALL
    run = _committed_copy(tmp_path, name)
    monkeypatch.chdir(tmp_path)
    cli.main(["report", f"results/{name}"])
    assert (run / "report.html").exists()
    assert (run / "report.md").read_text() == (REPO / "results" / name / "report.md").read_text()


def test_report_out_renders_elsewhere_and_leaves_the_run_folder_as_it_was(tmp_path, monkeypatch):
    from kvscope import cli

    name = SMALL
    run = _committed_copy(tmp_path, name)
    (run / "report.md").write_text("a report the code no longer renders\n")  # --out is not refused for it
    before = {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()}
    monkeypatch.chdir(tmp_path)
    assert cli.main(["report", f"results/{name}", "--out", str(tmp_path / "elsewhere")]) != 2
    assert {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()} == before
    assert (tmp_path / "elsewhere" / "report.md").read_text() == (REPO / "results" / name / "report.md").read_text()
    assert (tmp_path / "elsewhere" / "report.html").exists()


def test_report_names_a_published_run_as_its_checkout_does_however_the_command_spells_it(tmp_path, monkeypatch):
    from kvscope import cli

    name = SMALL
    run = _committed_copy(tmp_path, name)
    monkeypatch.chdir(run.parent)
    assert cli.main(["report", name]) != 2  # not refused: the same report, whatever the path's spelling
    assert cli.main(["report", str(run.resolve())]) != 2
    assert (run / "report.md").read_text() == (REPO / "results" / name / "report.md").read_text()


def test_report_refuses_a_published_run_whose_plot_or_table_it_renders_differently_and_rewrite_settles_it(
        tmp_path, monkeypatch, capsys):
    from kvscope import cli

    name = SMALL
    run = _committed_copy(tmp_path, name)
    (run / "notes.csv").write_text("a file of the user's, not the report's\n")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["report", f"results/{name}"]) != 2
    png = run / "hit_rates.png"
    good = png.read_bytes()
    for drawn in (good[:-8], (run / "ttft_cdf.png").read_bytes()):  # a broken file; a plot drawn differently
        png.write_bytes(drawn)
        capsys.readouterr()
        assert cli.main(["report", f"results/{name}"]) == 2
        assert "renders hit_rates.png differently" in capsys.readouterr().err
    png.write_bytes(good)
    (run / "sweep.csv").write_text("users\n1\n")  # a table the code does not write for this run
    assert cli.main(["report", f"results/{name}"]) == 2
    assert "renders sweep.csv differently" in capsys.readouterr().err
    assert cli.main(["report", f"results/{name}", "--rewrite"]) != 2
    assert not (run / "sweep.csv").exists() and (run / "notes.csv").exists()
    assert cli.main(["report", f"results/{name}"]) != 2


def test_report_out_takes_a_new_or_empty_folder_and_a_rollouts_report_refuses_the_options(tmp_path, monkeypatch,
                                                                                         capsys):
    from kvscope import cli

    name, other = SMALL, "2026-12-01-h200-vllm0.26-tiny-fp32-lmcache-mp5"
    run = shutil.copytree(REPO / "results" / other, tmp_path / "other" / other)  # a run of nobody's checkout
    _committed_copy(tmp_path, name)
    before = {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()}
    monkeypatch.chdir(tmp_path)
    assert cli.main(["report", f"results/{name}", "--out", str(run)]) == 2
    assert cli.main(["report", f"results/{name}", "--out", str(run), "--rewrite"]) == 2
    assert {f.name: f.read_bytes() for f in run.iterdir() if f.is_file()} == before
    (tmp_path / "a-file").write_text("not a folder\n")
    capsys.readouterr()
    assert cli.main(["report", f"results/{name}", "--out", str(tmp_path / "a-file")]) == 2
    assert "--out" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert cli.main(["report", f"results/{name}", "--out", str(tmp_path / "empty")]) != 2
    rollout = tmp_path / "rollout"
    rollout.mkdir()
    (rollout / "rollout.json").write_text("{}")
    for option in (["--out", str(tmp_path / "x")], ["--rewrite"]):
        capsys.readouterr()
        assert cli.main(["report", str(rollout), *option]) == 2
        assert option[0] in capsys.readouterr().err


def test_report_says_nothing_of_publishing_for_a_run_no_checkout_tracks(tmp_path, monkeypatch, capsys):
    from kvscope import cli

    name = SMALL
    outside = shutil.copytree(REPO / "results" / name, tmp_path / "outside" / name)
    untracked = _committed_copy(tmp_path / "repo", name).parent / "fresh"
    shutil.copytree(outside, untracked)
    for folder in (outside, untracked):
        (folder / "report.md").write_text("stale\n")
        capsys.readouterr()
        assert cli.main(["report", str(folder)]) != 2
        assert "published" not in capsys.readouterr().err
        assert (folder / "report.md").read_text() != "stale\n"


def test_bench_refuses_to_resume_a_published_run_before_it_runs_anything(tmp_path, capsys):
    from kvscope import cli

    name = SMALL
    run = _committed_copy(tmp_path, name)
    before = sorted(p.name for p in (run / "records").iterdir())
    assert cli.main(["bench", "--resume", "--run-id", name, "--results", str(tmp_path / "results")]) == 2
    assert "published run" in capsys.readouterr().err
    assert sorted(p.name for p in (run / "records").iterdir()) == before


def test_the_run_folder_knows_every_plot_the_report_draws():
    from kvscope.analyze import plots
    from kvscope.runfolder import PLOTS

    assert set(plots.CAPTIONS) == {f"{p}.png" for p in PLOTS}
