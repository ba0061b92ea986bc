"""`kvscope bench --endpoint/--golden`: servers kvscope did not deploy, benched and scored all the same."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
from conftest import REPO

from kvscope.config.matrix import ConfigError
from kvscope.run import endpoints

GOLDEN, CANDIDATE = 8177, 8178
SMALL = ("scenarios:\n  - {name: rag-small, kind: rag, num_docs: 6, doc_tokens_median: 120, docs_per_query: 2, "
         "num_queries: 8}\n")


def test_endpoint_urls_are_named_and_anything_kvscope_cannot_address_is_refused():
    assert endpoints.parse("http://10.0.0.5:8000", "endpoint-1") == ("endpoint-1", "http", "10.0.0.5", 8000)
    assert endpoints.parse("llm-d=http://gateway/v1", "endpoint-2") == ("llm-d", "http", "gateway", 80)
    for bad in ("http://gateway:8000/prefix/v1", "Bad_Name=http://h:1", "gateway:8000"):
        with pytest.raises(ConfigError, match="endpoint"):
            endpoints.parse(bad, "endpoint-1")


def _start(port: int, model_dir, *flags: str) -> subprocess.Popen:
    """A vLLM server as a team would run it: by hand, no kvscope deployment, no dev-mode reset route."""
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env.pop("VLLM_SERVER_DEV_MODE", None)
    cmd = [str(REPO / ".venv-vllm" / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server", "--model",
           str(model_dir), "--port", str(port), "--dtype", "float32", "--enforce-eager", "--max-model-len", "4096",
           "--kv-cache-memory-bytes", str(64 << 20), "--block-size", "64", "--seed", "0",
           "--enable-prompt-tokens-details", *flags]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def _healthy(port: int, deadline: float) -> None:
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return
        except OSError:
            time.sleep(2)
    pytest.fail(f"the server on port {port} did not come up")


@pytest.mark.server
def test_servers_kvscope_did_not_deploy_are_benched_scored_and_their_uncontrolled_cache_said(tmp_path, model_dir):
    procs = [_start(GOLDEN, model_dir, "--no-enable-prefix-caching"), _start(CANDIDATE, model_dir)]
    try:
        deadline = time.monotonic() + 600
        for port in (GOLDEN, CANDIDATE):
            _healthy(port, deadline)
        (tmp_path / "small.yaml").write_text(SMALL)
        out = subprocess.run([sys.executable, "-m", "kvscope.cli", "bench", "--endpoint",
                              f"their-apc=http://127.0.0.1:{CANDIDATE}", "--golden", f"http://127.0.0.1:{GOLDEN}",
                              "--model-dir", str(model_dir), "--results", str(tmp_path), "--scenarios-file",
                              str(tmp_path / "small.yaml"), "--scenarios", "rag-small", "--run-id", "ext",
                              "--report", "--min-hits", "3"], cwd=REPO, capture_output=True, text=True, timeout=900)
        run = tmp_path / "ext"
        verdicts = {r["config"]: r for r in csv.DictReader((run / "verdicts.csv").open())}
        assert verdicts["golden"]["verdict"] == "GOLDEN", out.stdout[-3000:] + out.stderr[-3000:]
        assert verdicts["their-apc"]["verdict"] == "PASS" and int(verdicts["their-apc"]["verified_hits"]) >= 3
        servers = {s["config"]: s["manifest"] for s in json.loads((run / "run.json").read_text())["servers"]}
        assert servers["their-apc"]["served_model_name"] == str(model_dir)  # as the server names it (/v1/models)
        assert servers["their-apc"]["block_size"] == 64
        assert "`their-apc`: **cache state not controlled**" in (run / "report.md").read_text()
    finally:
        for p in procs:
            os.killpg(p.pid, 15)
            p.wait(timeout=60)
