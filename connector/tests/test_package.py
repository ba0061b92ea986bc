"""The connector is a package of its own: it builds into a wheel with pip and nothing from the repository."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

CONNECTOR = Path(__file__).resolve().parent.parent


def test_builds_into_a_wheel_alone(tmp_path):
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the repository
    shutil.copytree(CONNECTOR, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(src)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("kvscope_connector-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("connector", "messages", "scheduler", "worker", "blocks", "fileformat", "store", "keys", "canary"):
        assert f"kvscope_connector/{module}.py" in names
    assert not any(n.startswith("tests/") for n in names)
    metadata = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("METADATA"))).decode()
    assert "Requires-Dist: xxhash" in metadata
