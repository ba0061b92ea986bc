"""The load generator's pacing against benchmarks/sse_server.py: a synthetic stream, since what is tested
here (when sessions are released) does not depend on vLLM, and vLLM on 2 cores cannot stream fast enough."""

from __future__ import annotations

import resource
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO

from kvscope.artifacts import Manifest, Treatment
from kvscope.run import orphans
from kvscope.run.records import read
from kvscope.run.treatments import run_locust
from kvscope.run.workload import Request, write_jsonl

PORT = 8187


@pytest.fixture(scope="module")
def sse_server():
    proc = subprocess.Popen([sys.executable, str(REPO / "loadtests" / "benchmarks" / "sse_server.py"), str(PORT), "16"])
    time.sleep(1.0)
    # only what run_locust reads: the synthetic server has no manifest
    server = Manifest.model_construct(config="sse", role="candidate", host="127.0.0.1", port=PORT, block_size=64,
                                      served_model_name="tiny")
    yield Treatment.model_construct(config="sse", manifest=server)
    proc.terminate()
    proc.wait()


def requests(n: int) -> list[Request]:
    return [Request(request_id=f"r{i}", scenario="o", phase="measure", session_id=f"r{i}", turn=0,
                    endpoint="completions", max_tokens=16, prompt="x") for i in range(n)]


def test_open_loop_releases_sessions_at_the_asked_rate(sse_server, tmp_path):
    write_jsonl(requests(20), tmp_path / "w.jsonl")
    run_locust(sse_server, tmp_path / "w.jsonl", tmp_path / "r.jsonl", users=8, processes=1, rate=10.0,
               timeout_s=60)
    recs = read(tmp_path / "r.jsonl")
    assert len(recs) == 20 and all(r.ok for r in recs)
    gaps = np.diff(sorted(r.start_unix_s for r in recs))
    assert 0.05 < float(np.mean(gaps)) < 0.2  # seeded Poisson arrivals at 10/s: mean gap 0.1 s


def test_closed_loop_sends_back_to_back(sse_server, tmp_path):
    write_jsonl(requests(20), tmp_path / "w.jsonl")
    run_locust(sse_server, tmp_path / "w.jsonl", tmp_path / "r.jsonl", users=1, processes=1, rate=0.0,
               timeout_s=60, stats=tmp_path / "locust" / "sse.measure")
    assert {p.name for p in (tmp_path / "locust").iterdir()} >= {"sse.measure_stats.csv", "sse.measure_failures.csv"}
    recs = read(tmp_path / "r.jsonl")
    assert len(recs) == 20 and all(r.ok and len(r.output_token_ids) == 16 for r in recs)
    starts = sorted(r.start_unix_s for r in recs)
    assert starts[-1] - starts[0] < 1.0  # no pacing: 20 short streams back to back


def test_records_that_cannot_be_written_are_counted_and_the_run_still_ends(sse_server, tmp_path, monkeypatch):
    write_jsonl(requests(6), tmp_path / "w.jsonl")
    dies_with_me = orphans.dies_with_me

    def no_file_can_grow():  # in Locust alone (its spec is written before): every write fails, as on a full disk
        die = dies_with_me()

        def in_the_child():
            die()
            resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
        return in_the_child

    monkeypatch.setattr(orphans, "dies_with_me", no_file_can_grow)
    row = run_locust(sse_server, tmp_path / "w.jsonl", tmp_path / "r.jsonl", users=2, processes=1, rate=0.0,
                     timeout_s=120)
    assert row.seconds < 60, row  # not the timeout: each lost session still counts as done
    assert row.sessions_lost == 6 and "File too large" in row.sessions_lost_tail[-1]
