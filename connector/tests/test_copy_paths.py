"""loadtests/benchmarks/copy_paths.py on the CPU at a toy size: it runs, every load writes the saved bytes (it
checks that itself), each load's time is split by the connector's counters, and --profile tells the forward thread's
time by function in a file hit, a RAM hit and a save. Nine blocks: their save at every other id is nine runs, beyond
MAX_RUNS, so the per-layer gather stores them (the script checks the bytes)."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_copy_paths_runs_and_splits_each_loads_time():
    out = subprocess.run([sys.executable, str(REPO / "loadtests" / "benchmarks" / "copy_paths.py"), "--device", "cpu",
                          "--blocks", "9", "--layers", "2", "--rounds", "2",
                          "--load-threads", "2", "--profile"], capture_output=True, text=True,
                         timeout=300, env={"PYTHONPATH": f"{REPO / 'connector'}:{REPO / 'loadtests'}",
                                           "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-2000:]
    split = re.findall(r"^(load: [^:]+): load ([\d.]+) ms: waiting for the load threads ([\d.]+), for the GPU "
                       r"([\d.]+), the rest (-?[\d.]+) \(mean of 3\)$", out.stdout, re.M)
    assert [name for name, *_ in split] == ["load: RAM hit, checked on the GPU (mix128)",
                                            "load: file hit (page cache), checked on the GPU",
                                            "load: RAM hit, checked on the host (XXH3, 4 threads)"], out.stdout
    for name, total, reads, device, rest in split:
        assert float(total) > 0 and float(rest) >= 0, name
        assert abs(float(reads) + float(device) + float(rest) - float(total)) <= 0.15, name  # rounding
    assert float(split[0][2]) == 0  # RAM hits checked on the GPU are looked up on the forward thread
    profile = out.stdout.split("file hit, the forward thread by function (cProfile, ms per step, mean of 2):\n")
    assert len(profile) == 2, out.stdout
    rows = re.findall(r"^ *([\d.]+) +([\d.]+) +(\d+)  (.+)$", profile[1], re.M)
    assert any(name.endswith("_load_on_device") for *_, name in rows), profile[1]  # the load's own frames
    assert "RAM hit, the forward thread by function" in profile[1] and "save, the forward thread" in profile[1]
    assert "the RAM tier filling" in out.stdout and "every other block id" in out.stdout
    assert re.search(r"^save: the forward thread's part, back to back, evicting: of it waiting for the save thread "
                     r"[\d.]+ ms, the pool growing [\d.]+ ms \(means of \d+ saves\); evictions [1-9]\d*$",
                     out.stdout, re.M), out.stdout  # a tier that did not evict would say 0
