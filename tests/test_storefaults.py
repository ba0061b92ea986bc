"""Store faults at rest without a server: what each fault does to a store's files, what it leaves alone, and how
the report words what a tier did. test_bench's store-fault test runs them against kvscope-fs."""

from __future__ import annotations

import json
import os

import pandas as pd
import pytest

from kvscope.analyze import storefaults as outcomes
from kvscope.artifacts import LocustPhase, Manifest, StatusRow, StoreFaultPhase, Treatment
from kvscope.run import storefaults


def store(tmp_path, n: int = 3):
    """A deployment folder with one config's block store (n files in a sub-folder) and its load log."""
    blocks, log = tmp_path / "stores" / "fs" / "blocks", tmp_path / "stores" / "fs" / "log"
    (blocks / "ab").mkdir(parents=True)
    log.mkdir(parents=True)
    files = [blocks / "ab" / f"k{i}" for i in range(n)]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]) * 64)
    (log / "loads.jsonl").write_text("{}\n")
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "k").write_bytes(b"x" * 64)
    ktc = {"kv_connector_extra_config": {"fs_path": str(blocks), "load_log": str(log / "loads.jsonl")}}
    manifest = Manifest.model_construct(stores={"blocks": str(blocks), "log": str(log), "out": str(outside)},
                                        server_args=["--kv-transfer-config", json.dumps(ktc)])
    server = Treatment.model_construct(config="fs", manifest=manifest, run_dir=str(tmp_path))
    return server, files, log / "loads.jsonl", outside / "k"


@pytest.fixture(autouse=True)
def quick(monkeypatch):
    monkeypatch.setattr(storefaults, "STABLE_S", 0.01)


def test_a_bitflip_changes_one_exponent_bit_and_keeps_the_size(tmp_path):
    server, files, log, outside = store(tmp_path)
    done = storefaults.damage(server, "bitflip")
    assert done.files == 3 and done.fault == "bitflip"
    for i, f in enumerate(files):
        data = f.read_bytes()
        assert len(data) == 64 and [j for j in range(64) if data[j] != i] == [35] and data[35] == i ^ 0x40
    assert log.read_text() == "{}\n" and outside.read_bytes() == b"x" * 64  # logs and foreign paths untouched


def test_truncate_halves_and_swap_rotates_every_file(tmp_path):
    server, files, _, _ = store(tmp_path)
    storefaults.damage(server, "swap")
    assert [f.read_bytes()[0] for f in files] == [1, 2, 0]
    assert not list(files[0].parent.glob("*.kvscope-swap"))
    storefaults.damage(server, "truncate")
    assert [f.stat().st_size for f in files] == [32, 32, 32]


def test_an_unreadable_file_fails_its_read(tmp_path):
    server, files, _, _ = store(tmp_path)
    done = storefaults.damage(server, "unreadable")
    assert done.files == 3
    for f in files:
        with pytest.raises(OSError):
            f.read_bytes()  # EIO through /proc/self/mem as root; permission denied otherwise
    assert ("EIO" in done.how) == (os.geteuid() == 0)


def test_an_empty_store_damages_nothing_and_says_so(tmp_path):
    server, files, _, _ = store(tmp_path, n=1)
    done = storefaults.damage(server, "swap")  # one file has no other to swap with
    assert done.files == 0 and "1 files" in done.how


def row(fault: str, files: int, delta: dict | None) -> StatusRow:
    measure = LocustPhase(locust_exit=0, seconds=1.0, metrics_delta=delta)
    return StatusRow(config="fs", scenario=f"store-{fault}",
                     phases={"store-fault": StoreFaultPhase(fault=fault, files=files, how="h"), "measure": measure})


def test_the_report_says_what_the_tier_did_with_each_fault():
    status = [row("bitflip", 4, {"kvscope:connector_corrupt_total": 4.0, "kvscope:connector_io_errors_total": 0.0}),
              row("swap", 4, {"vllm:prompt_tokens_total": 9.0}), row("truncate", 4, {"kvscope:connector_corrupt_total": 0.0}),
              row("unreadable", 0, None)]
    scores = pd.DataFrame([
        {"config": "fs", "scenario": "store-bitflip", "phase": "measure", "cls": "identical", "cached_tokens": 0},
        {"config": "fs", "scenario": "store-swap", "phase": "measure", "cls": "FAIL", "cached_tokens": 64},
        {"config": "fs", "scenario": "store-swap", "phase": "measure", "cls": "identical", "cached_tokens": 0},
        {"config": "fs", "scenario": "store-truncate", "phase": "measure", "cls": "failed", "cached_tokens": None},
    ])
    said = outcomes.table(status, scores).set_index("fault").outcome
    assert said["bitflip"].startswith("detected and recomputed: 4 damaged blocks refused")
    assert said["swap"] == "served wrong: 1 of 2 answers FAIL"
    assert said["truncate"] == "failed the request: 1 of 1"
    assert said["unreadable"] == "not exercised: no file was damaged"
    assert outcomes.outcome(4, 3, 0, 0, 2, None).startswith("every answer equals golden's (2 cache hits); whether")
    assert outcomes.outcome(4, 3, 0, 0, 0, 0).endswith("reported no damage: not exercised")
    assert outcomes.outcome(4, 0, 0, 0, 0, 0) == "not exercised: no answer was recorded"  # Locust sent nothing


def test_a_store_left_empty_because_its_prime_phase_failed_is_not_measured():
    """A server down before the prime phase (an earlier fault crashed it: vLLM 0.26 on the H200) stored nothing:
    that row says the prime failed, not that the tier was spared or failed the damaged files' loads."""
    status = [row("truncate", 0, None), row("swap", 0, None), row("bitflip", 9, None)]
    scores = pd.DataFrame([
        {"config": "fs", "scenario": "store-truncate", "phase": "prime", "cls": "failed", "cached_tokens": None},
        {"config": "fs", "scenario": "store-truncate", "phase": "prime", "cls": "failed", "cached_tokens": None},
        {"config": "fs", "scenario": "store-truncate", "phase": "measure", "cls": "failed", "cached_tokens": None},
        {"config": "fs", "scenario": "store-swap", "phase": "prime", "cls": "identical", "cached_tokens": 0},
        {"config": "fs", "scenario": "store-bitflip", "phase": "prime", "cls": "failed", "cached_tokens": None},
        {"config": "fs", "scenario": "store-bitflip", "phase": "measure", "cls": "failed", "cached_tokens": None},
    ])
    said = outcomes.table(status, scores).set_index("fault").outcome
    assert said["truncate"] == "not measured: every prime request failed (2 of 2), this treatment stored nothing"
    assert said["bitflip"] == "not measured: every prime request failed (1 of 1), this treatment stored nothing"
    assert said["swap"] == "not exercised: no file was damaged"
    # its measure phase loaded an earlier treatment's damaged files and served wrong: that is said
    assert outcomes.outcome(3, 5, 2, 0, 2, 0, primes=4, primes_failed=4) == "served wrong: 2 of 5 answers FAIL"
