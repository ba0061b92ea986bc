"""Every published run re-scores, from its raw records, to the verdicts and detection power it publishes: a
report in results/ can never silently disagree with the code."""

import pandas as pd
import pytest
from conftest import REPO

from kvscope.analyze import report

RUNS = sorted(p.parent for p in (REPO / "results").glob("*/run.json"))


@pytest.mark.parametrize("run", RUNS, ids=[r.name for r in RUNS])
def test_a_published_run_rescores_to_what_it_publishes(run):
    a = report.analyze(run)
    published = pd.read_csv(run / "verdicts.csv")
    now = a.verdicts.reset_index(drop=True)
    assert list(now.config) == list(published.config)
    assert list(now.verdict) == list(published.verdict) and list(now.why.fillna("")) == list(published.why.fillna(""))
    if len(a.power):
        power = pd.read_csv(run / "power.csv")
        assert list(a.power.detected) == list(power.detected) and list(a.power.affected_hits) == list(power.affected_hits)


def test_the_results_index_names_no_other_cpu_than_each_runs_own():
    # results/README.md once called an AMD EPYC run "Intel Xeon": machine facts come from run.json
    from kvscope.artifacts import RunInfo, read_json

    rows = [line for line in (REPO / "results" / "README.md").read_text().splitlines() if line.startswith("| [")]
    for row in rows:
        name = row.split("](", 1)[0][3:]
        if not (REPO / "results" / name / "run.json").exists():  # a repro's folder: no bench, no run.json
            continue
        cpu = read_json(REPO / "results" / name / "run.json", RunInfo).machine["cpu"]
        machine = row.split(" | ")[2]
        for vendor in ("Intel", "AMD"):
            assert vendor in cpu or vendor not in machine, (name, cpu, machine)
