"""kvscope's connector through real vLLM servers: identical to golden with hits from disk (after a restart:
tests/test_bench.py), from a directory shared by two servers, and under injected faults, each fault counted
(RAM-tier hits: kvscope-ram in tests/test_cluster.py)."""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
import threading
import urllib.request
from pathlib import Path
from pydoc_data.topics import topics

import pytest
import yaml
from conftest import MATRIX, REPO, ansible, failure_of, servers_of
from tokenizers import Tokenizer

from kvscope.deploy import servers
from kvscope.run import metrics

pytestmark = pytest.mark.server

PORTS = {"baseline": 8199, "kvscope-fs": 8191, "kvscope-shared": 8193,
         "kvscope-shared-b": 8194, "kvscope-apc-tight": 8188}


def prompts(tag: str, n: int = 3) -> list[str]:
    names = sorted(topics)
    start = sum(map(ord, tag)) % 40
    return [f"[{tag} {i}] " + topics[names[start + i * 7]][:2400] for i in range(n)]


def complete(port: int, prompt: str, max_tokens: int = 16) -> tuple[list[int], int]:
    body = json.dumps({"model": "tiny-qwen3", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": max_tokens > 16, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.loads(resp.read())
    return out["choices"][0]["token_ids"], out["usage"]["prompt_tokens_details"]["cached_tokens"]


def scrape(port: int) -> dict[str, float]:
    return metrics.scrape(f"http://127.0.0.1:{port}")


@pytest.fixture(scope="module")
def golden(connector_run):
    answers: dict[tuple[str, int], list[int]] = {}  # the cache-off server's greedy answers, each asked once

    def ask(prompt: str, max_tokens: int = 16) -> list[int]:
        if (prompt, max_tokens) not in answers:
            answers[prompt, max_tokens] = complete(PORTS["baseline"], prompt, max_tokens)[0]
        return answers[prompt, max_tokens]
    return ask


@pytest.fixture(scope="module")
def connector_run(tmp_path_factory, model_dir):
    """The module's own servers, golden included (apart from the session's, so fewer run at once)."""
    doc = yaml.safe_load((MATRIX).read_text())
    by_name = {c["name"]: c for c in doc["configs"]}
    tight = json.loads(json.dumps(by_name["kvscope-fs"]))
    tight.update(name="kvscope-apc-tight", description="vLLM prefix caching on, chunked prefill, a KV cache "
                 "of 1984 tokens: concurrent long answers are preempted and resumed")
    tight["flags"] = {"--enable-prefix-caching": True, "--max-num-batched-tokens": 128, "--max-model-len": 1536,
                      "--kv-cache-memory-bytes": 2048 * 4096}  # 4 KiB of KV per token in the tiny model
    configs = [by_name["baseline"], by_name["kvscope-fs"], by_name["kvscope-shared"],
               by_name["kvscope-shared-b"], tight]
    for c in (tight, by_name["kvscope-shared"], by_name["kvscope-shared-b"]):  # files of 4 blocks, as beside a GPU:
        # a file stored by a step after the one that computed its first blocks, read by another server
        c["kv_transfer_config"]["kv_connector_extra_config"]["file_tokens"] = 256
    for c in configs:
        c["port"] = PORTS[c["name"]]
    doc["configs"] = configs
    own = tmp_path_factory.mktemp("matrix") / "matrix.yaml"
    own.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path_factory.mktemp("connector-run")
    extra = ("-e", f"kvscope_matrix={own}", "-e", "vllm_configs=" + ",".join(PORTS))
    result = ansible("deploy.yml", run_dir, *extra)
    if result.returncode != 0:
        ansible("teardown.yml", run_dir)
        pytest.fail(failure_of(result))
    yield run_dir, extra
    ansible("teardown.yml", run_dir)


def store_of(run_dir: Path, config: str) -> Path:
    return Path(servers_of(run_dir)[config]["stores"]["blocks" if "shared" not in config else "shared-blocks"])


def block_files(store: Path) -> list[Path]:
    return sorted(store.rglob("*.safetensors"))


def test_hits_from_disk_are_identical_to_golden(connector_run, golden):
    # Hits from disk after a restart: test_bench.py's restart scenario (the bench's restart command on the
    # session's kvscope-fs, the same metrics and golden's answers), one server start fewer here.
    run_dir, _ = connector_run
    port = PORTS["kvscope-fs"]
    for p in prompts("restart"):
        assert complete(port, p) == (golden(p), 0)
    assert block_files(store_of(run_dir, "kvscope-fs"))
    before = scrape(port)
    for p in prompts("restart"):
        tokens, cached = complete(port, p)
        assert tokens == golden(p) and cached > 0
    d = metrics.delta(before, scrape(port))
    assert d["vllm:prompt_tokens_cached_by_source_total{source=disk}"] > 0
    assert d["kvscope:connector_fs_hits_total"] > 0 and d["kvscope:connector_corrupt_total"] == 0


def test_corrupt_truncated_and_foreign_blocks_are_misses_and_counted(connector_run, golden):
    run_dir, _ = connector_run
    port, store = PORTS["kvscope-fs"], store_of(run_dir, "kvscope-fs")
    ps = prompts("faults")
    earlier = set(block_files(store))  # the restart test's blocks are in this store too
    for p in ps:
        complete(port, p)
    files = sorted(set(block_files(store)) - earlier)
    assert len(files) >= 6
    data = bytearray(files[0].read_bytes())
    data[-9] ^= 0xFF  # one value changed
    files[0].write_bytes(bytes(data))
    files[1].write_bytes(files[1].read_bytes()[:-100])  # truncated
    files[2].write_bytes(files[3].read_bytes())  # another block's bytes under this key
    before = scrape(port)
    for p in ps:
        assert complete(port, p)[0] == golden(p)
    d = metrics.delta(before, scrape(port))
    assert d["kvscope:connector_corrupt_total"] >= 3
    assert len(list(store.rglob("*.corrupt"))) >= 3
    for p in ps:  # the bad blocks were recomputed and stored again
        tokens, cached = complete(port, p)
        assert tokens == golden(p) and cached > 0


def test_blocks_computed_in_the_step_a_load_failed_are_never_served_later(connector_run, golden):
    # The step whose load fails still computes the rest of the prompt, on top of the block it lacked; those
    # blocks must not be stored (they were, verified and signed: a longer prompt then loaded them).
    run_dir, _ = connector_run
    port, store = PORTS["kvscope-fs"], store_of(run_dir, "kvscope-fs")
    text = prompts("after-fail", 1)[0]
    a, b, c = text[:800], text[:1600], text
    earlier = set(block_files(store))
    complete(port, a)
    first = min(set(block_files(store)) - earlier, key=lambda f: f.stat().st_mtime_ns)  # a's first block
    data = bytearray(first.read_bytes())
    data[-9] ^= 0xFF
    first.write_bytes(bytes(data))
    assert complete(port, b, 32)[0] == golden(b, 32)  # a's first block fails: b is recomputed
    tokens, cached = complete(port, c, 32)  # loads a's blocks and b's: every one must be right
    assert cached > 0 and tokens == golden(c, 32)


def test_store_removed_mid_run_keeps_serving_and_refills(connector_run, golden):
    run_dir, _ = connector_run
    port, store = PORTS["kvscope-fs"], store_of(run_dir, "kvscope-fs")
    shutil.rmtree(store)
    for p in prompts("removed"):
        assert complete(port, p) == (golden(p), 0)
    for p in prompts("removed"):
        tokens, cached = complete(port, p)
        assert tokens == golden(p) and cached > 0


def _mount(*args) -> bool:
    return subprocess.run(["mount", *args], capture_output=True).returncode == 0


def _fresh_store(run_dir: Path) -> Path:
    store = store_of(run_dir, "kvscope-fs")
    shutil.rmtree(store, ignore_errors=True)
    store.mkdir(parents=True)
    return store


def _limit_file_size(run_dir: Path, limit: int) -> None:
    """Set RLIMIT_FSIZE of the server's engine processes (the connector's save thread): a write past `limit`
    bytes fails with EFBIG, as one fails on a full disk (Python ignores SIGXFSZ). The API server, which
    writes the log, keeps its limit."""
    leader = servers_of(run_dir)["kvscope-fs"]["pid"]
    for pid in servers.group_members(leader):
        if pid != leader:
            resource.prlimit(pid, resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))


@pytest.mark.parametrize("full", ["tmpfs", "file-size-limit"])
def test_a_full_store_is_counted_and_outputs_stay_identical(connector_run, golden, full):
    run_dir, _ = connector_run
    port, store = PORTS["kvscope-fs"], _fresh_store(run_dir)
    if full == "tmpfs" and not _mount("-t", "tmpfs", "-o", "size=160k", "tmpfs", str(store)):
        pytest.skip("mounting a small tmpfs is not allowed here (needs root and CAP_SYS_ADMIN); "
                    "the file-size-limit case covers a full store without a mount")
    if full == "file-size-limit":
        _limit_file_size(run_dir, 4096)
    try:
        before = scrape(port)
        for p in prompts(f"full-{full}"):
            assert complete(port, p)[0] == golden(p)
        assert metrics.delta(before, scrape(port))["kvscope:connector_save_errors_total"] > 0
    finally:
        if full == "tmpfs":
            subprocess.run(["umount", str(store)])
        else:
            _limit_file_size(run_dir, resource.RLIM_INFINITY)


def test_a_read_only_store_is_counted_and_outputs_stay_identical(connector_run, golden):
    run_dir, _ = connector_run
    port, store = PORTS["kvscope-fs"], _fresh_store(run_dir)
    mounted = _mount("-t", "tmpfs", "-o", "size=1m,ro", "tmpfs", str(store))
    if not mounted and os.geteuid() == 0:
        pytest.skip("a read-only store needs a mount here: root ignores directory modes")
    if not mounted:
        store.chmod(0o500)  # a user's server cannot write into it, as into a read-only mount
    try:
        before = scrape(port)
        for p in prompts("readonly"):
            assert complete(port, p)[0] == golden(p)
        assert metrics.delta(before, scrape(port))["kvscope:connector_save_errors_total"] > 0
    finally:
        subprocess.run(["umount", str(store)]) if mounted else store.chmod(0o700)


def test_two_servers_share_one_store_and_write_the_same_keys_at_once(connector_run, golden):
    run_dir, _ = connector_run
    a, b = PORTS["kvscope-shared"], PORTS["kvscope-shared-b"]
    for p in prompts("shared"):
        assert complete(a, p)[0] == golden(p)
        tokens, cached = complete(b, p)  # b has never seen it: the blocks come from a's writes
        assert tokens == golden(p) and cached > 0
    racing = prompts("race", 4)
    results: dict = {}
    threads = [threading.Thread(target=lambda port=port, p=p: results.__setitem__((port, p), complete(port, p)))
               for p in racing for port in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(results[port, p][0] == golden(p) for p in racing for port in (a, b))
    store = store_of(run_dir, "kvscope-shared")
    assert not list(store.rglob("*.tmp")) and not list(store.rglob("*.corrupt"))
    for p in racing:
        for port in (a, b):
            tokens, cached = complete(port, p)
            assert tokens == golden(p) and cached > 0


def test_chunked_prefill_preemption_and_vllm_prefix_caching_stay_identical(connector_run, golden, model_dir):
    port = PORTS["kvscope-apc-tight"]
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    # six 500-token prompts sharing one block-sized header, 300-token answers: vLLM admits a prompt only when
    # all of it fits, so the 1984-token cache runs out in decode and vLLM preempts and later resumes requests
    names = sorted(topics)
    texts = [" ".join(topics[names[(7 * i + j) % len(names)]] for j in range(12)) for i in range(6)]
    batch = [tok.decode(tok.encode(f"{topics[names[3]][:300]}\n[tight {i}] {text}").ids[:500])
             for i, text in enumerate(texts)]

    def send_all() -> dict[str, tuple[list[int], int]]:
        out: dict = {}
        threads = [threading.Thread(target=lambda p=p: out.__setitem__(p, complete(port, p, 300))) for p in batch]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return out

    before = scrape(port)
    first = send_all()  # 128-token prefill chunks; 6 x 800 tokens of KV wanted, 1984 there
    middle = scrape(port)
    assert middle.get("vllm:num_preemptions_total", 0) > before.get("vllm:num_preemptions_total", 0), \
        "the KV cache was not tight enough to preempt: this test would not exercise resume"
    assert all(first[p][0] == golden(p, 300) for p in batch)
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{port}/reset_prefix_cache", data=b"",
                                                  method="POST"), timeout=60).read()  # vLLM's cache only
    second = send_all()  # now prefixes come back through the connector, chunk by chunk, with APC on
    after = scrape(port)
    assert all(second[p][0] == golden(p, 300) for p in batch)
    loaded = sum(v for k, v in after.items() if k.startswith("kvscope:connector_") and "_hits" in k) \
        - sum(v for k, v in middle.items() if k.startswith("kvscope:connector_") and "_hits" in k)
    assert loaded > 0 and after.get("kvscope:connector_corrupt_total", 0) == 0


SHARED = """scenarios:
  - name: shared-small
    kind: rag
    num_docs: 8
    doc_tokens_median: 120
    docs_per_query: 2
    num_queries: 6
    max_tokens: 12
    prime: replay
    shared: true
"""


def test_a_shared_scenario_stores_through_the_writer_and_the_reader_loads_it(connector_run, tmp_path):
    run_dir, _ = connector_run
    (tmp_path / "s.yaml").write_text(SHARED)
    out = subprocess.run([sys.executable, "-m", "kvscope.cli", "bench", "--deployment", str(run_dir / "deployment.json"),
                          "--results", str(tmp_path), "--scenarios-file", str(tmp_path / "s.yaml"), "--configs",
                          "baseline,kvscope-shared-b", "--scenarios", "shared-small", "--run-id", "sh", "--report",
                          "--min-hits", "2"], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    status = {json.loads(line)["config"]: json.loads(line) for line in (tmp_path / "sh" / "status.jsonl").open()}
    assert status["kvscope-shared-b"]["reset"]["writer"] == "kvscope-shared" and "writer" not in status["baseline"]["reset"]
    loads = [json.loads(line) for line in (tmp_path / "sh" / "loads" / "kvscope-shared-b__shared-small.jsonl").open()]
    assert sum(line.get("disk", 0) for line in loads) > 0  # its first loads: the files the writer stored
