"""The bench reads a cluster's hosts, addresses and Locust workers from the inventory's own variables
(deploy/inventory.py): the .mk files restated them, and a changed address had to be changed twice."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO

from kvscope.deploy import inventory
from kvscope.runfolder import RunFolder

INVENTORIES = REPO / "ansible" / "inventories"


def test_each_shipped_inventory_says_where_its_deployments_are_and_who_runs_locust_workers():
    netns = inventory.bench_hosts(str(INVENTORIES / "netns"))
    assert netns.deployments("r1") == [Path(f"runs/netns/kvh{i}/deployment.json") for i in (1, 2, 3)]
    assert (netns.workers, netns.master, netns.ssh_config) == (["kvh1", "kvh2"], "10.77.0.1",
                                                               "/var/lib/kvscope/netns/config")
    gb10 = inventory.bench_hosts(str(INVENTORIES / "gb10"))
    # each node's deployment.json as the collect role fetched it into the run folder
    assert gb10.deployments("r1") == [RunFolder(Path("results/r1")).host(f"spark-{i}").deployment for i in (1, 2, 3)]
    assert gb10.workers == ["loadgen", "spark-3"] and gb10.master == "192.168.50.20"
    assert gb10.ssh_config == str(Path.home() / ".ssh" / "config")  # ~ expanded: ssh -F does not
    for name, run_dir in (("local", "local"), ("cuda-processes", "cuda-processes")):
        one = inventory.bench_hosts(str(INVENTORIES / name))
        assert one.deployments(None) == [Path(f"runs/{run_dir}/deployment.json")] and one.workers == []


def write(tmp_path: Path, hosts: str, group_vars: str) -> str:
    (tmp_path / "group_vars").mkdir(exist_ok=True)
    (tmp_path / "hosts.yml").write_text(hosts)
    (tmp_path / "group_vars" / "all.yml").write_text(group_vars)
    return str(tmp_path)


TWO = ("all:\n  children:\n    vllm_servers:\n      hosts:\n        a:\n        b:\n"
       "    locust_workers:\n      hosts:\n        a:\n")


@pytest.mark.parametrize(("group_vars", "message"), [
    ("kvscope_bench_deployment: '{{ kvscope_run_dir }}/deployment.json'\nkvscope_locust_master: 10.0.0.1\n",
     "is a template"),
    ("kvscope_bench_deployment: runs/{node}/deployment.json\nkvscope_locust_master: 10.0.0.1\n",
     "only {host} and {run_id}"),
    ("kvscope_bench_deployment: results/{run_id}/{host}.json\nkvscope_locust_master: 10.0.0.1\n", "give --run-id"),
    # a hostile inventory's pattern: an attribute (a traceback), a width of 300 MB (all memory), Python's internals
    ("kvscope_bench_deployment: runs/{host.nope}.json\n", "only {host} and {run_id}"),
    ("kvscope_bench_deployment: 'runs/{host:>300000000}.json'\n", "only {host} and {run_id}"),
    ("kvscope_bench_deployment: 'runs/{host.__class__.__mro__}.json'\n", "only {host} and {run_id}"),
    ("kvscope_bench_deployment: 'runs/{host!r}.json'\n", "only {host} and {run_id}"),
])
def test_bench_settings_that_cannot_work_are_refused_with_the_variable_named(tmp_path, group_vars, message):
    with pytest.raises(inventory.InventoryError, match=message):
        inventory.bench_hosts(write(tmp_path, TWO, group_vars)).deployments(None)


def test_a_flag_wins_over_the_inventorys_setting_even_one_that_would_be_refused(tmp_path):
    from kvscope import cli
    from kvscope.config.matrix import ConfigError
    from kvscope.run.locustspec import LocustWorkers
    from kvscope.run.plan import deployments_and_workers

    inv = write(tmp_path, TWO, "kvscope_bench_deployment: '{{ x }}/deployment.json'\n")  # and no master
    args = cli.build_parser().parse_args(["bench", "--inventory", inv, "--deployment", "d.json",
                                          "--master-host", "10.0.0.9"])
    assert deployments_and_workers(cli.bench_options(args)) == ([Path("d.json")],
                                                               LocustWorkers(hosts=["a"], master_host="10.0.0.9"))
    args = cli.build_parser().parse_args(["bench", "--inventory", inv, "--deployment", "d.json"])
    with pytest.raises(ConfigError, match="need --master-host .or the inventory's kvscope_locust_master"):
        deployments_and_workers(cli.bench_options(args))


def test_a_setting_that_differs_between_hosts_is_refused(tmp_path):
    inv = write(tmp_path, TWO, "kvscope_locust_master: 10.0.0.1\n")
    (tmp_path / "host_vars").mkdir()
    (tmp_path / "host_vars" / "b.yml").write_text("kvscope_locust_master: 10.0.0.2\n")
    with pytest.raises(inventory.InventoryError, match="kvscope_locust_master differs between hosts"):
        _ = inventory.bench_hosts(inv).master


def test_the_bench_refuses_a_broken_inventory_before_it_starts_anything(tmp_path):
    inv = write(tmp_path, TWO, "kvscope_bench_deployment: runs/{host}/deployment.json\n")
    out = subprocess.run([sys.executable, "-m", "kvscope.cli", "bench", "--inventory", inv, "--results",
                          str(tmp_path / "results"), "--run-id", "r1"], cwd=REPO, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2 and "kvscope_locust_master" in out.stderr
    assert not (tmp_path / "results").exists()


def test_server_flags_over_several_lines_reach_the_deploy_as_one_command():
    # make cut a recipe at the line break of a JSON value (long_context printed two lines): the deploy broke
    out = subprocess.run(["make", "-n", "-B", "deploy", "INVENTORY=ansible/inventories/cuda-processes", "MODEL=/tmp/m",
                          'OVERRIDES={"dtype": "bfloat16",\n"max-num-seqs": 32}'], cwd=REPO, capture_output=True,
                         text=True, timeout=60).stdout
    line = next(x for x in out.splitlines() if "ansible/deploy.yml" in x)
    assert """-e '{"vllm_flag_overrides": {"dtype": "bfloat16", "max-num-seqs": 32}}'""" in line


def test_make_bench_hands_the_inventory_to_the_bench():
    out = subprocess.run(["make", "-n", "-B", "bench", "INVENTORY=ansible/inventories/netns"], cwd=REPO,
                         capture_output=True, text=True, timeout=60).stdout.replace("\\\n", " ")
    line = next(x for x in out.splitlines() if "kvscope.cli bench" in x)
    assert "--inventory 'ansible/inventories/netns'" in line and "--worker-hosts" not in line
    assert "--configs" not in line  # every config the hosts deployed (their host_vars), not CONFIGS


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU host would deploy for real")
def test_the_cuda_host_bench_runs_the_make_targets_with_the_hosts_python_up_to_the_gpu_check(tmp_path):
    # the CUDA-host scripts once had their own deploy and teardown; now make's, with the inventory's overlay.mk:
    # no environment made, the host's Python (here the harness's, first on PATH) runs Ansible and kvscope
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}", "RESULTS": str(tmp_path / "res"),
           "RUN_DIR": str(tmp_path / "run"), "PORT_OFFSET": "700"}
    out = subprocess.run(["bash", "loadtests/benchmarks/gpu/bench.sh", "tiny", "r1", "baseline,kvscope-fs",
                          '{"dtype": "float32"}', "2"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=600)
    text = out.stdout + out.stderr
    assert "ansible playbook -i 'ansible/inventories/cuda-processes' ansible/deploy.yml" in text
    assert "-e '{\"vllm_flag_overrides\": {\"dtype\": \"float32\"}}'" in text and "vllm_port_offset=700" in text
    assert "nvidia-smi" in text and "bench exit 2" in text  # the GPU preflight stopped it, nothing started
    assert ".venv-vllm" not in text and "pip install" not in text  # nothing set up first
    assert "ansible/teardown.yml" in text and not (tmp_path / "res" / "r1").exists()


@pytest.mark.server
@pytest.mark.slow  # ~3 minutes on 2 cores: `make test-slow`
def test_the_cuda_host_bench_deploys_benches_and_tears_down_through_make_on_a_cpu_copy_of_its_inventory(tmp_path):
    # the whole CUDA-host flow, with the cuda-processes inventory's settings but the CPU platform: the script runs
    # make bench (deploy, bench, report) and make teardown with the host's Python, and sets nothing up
    inv = tmp_path / "gpu-copy"  # its overlay.mk comes with it, whatever the folder is named
    shutil.copytree(INVENTORIES / "cuda-processes", inv)
    group_vars = (inv / "group_vars" / "all.yml").read_text().replace("kvscope_platform: cuda", "kvscope_platform: cpu")
    (inv / "group_vars" / "all.yml").write_text(
        group_vars.replace('vllm_process_python: "{{ kvscope_harness_python }}"',
                           f"vllm_process_python: {REPO / '.venv-vllm' / 'bin' / 'python'}"))
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}", "INVENTORY": str(inv),
           "RESULTS": str(tmp_path / "res"), "RUN_DIR": str(tmp_path / "run"), "PORT_OFFSET": "900",
           "SCENARIOS": "repeat-867", "QUERIES": "4"}
    out = subprocess.run(["bash", "loadtests/benchmarks/gpu/bench.sh", "tiny", "r1", "baseline,apc", "{}", "1"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=1200)
    text = out.stdout + out.stderr
    assert "gate: " in text and "bench exit" in text, text[-4000:]  # the gate's own exit: 2 hits are too few to verify
    report = (tmp_path / "res" / "r1" / "report.md").read_text()
    assert "apc" in report and "GOLDEN" in report and ".venv-vllm/.installed" not in text
    command = json.loads((tmp_path / "res" / "r1" / "run.json").read_text())["command"]
    assert command.startswith("make bench") and "INVENTORY=" in command  # the run records the make line
    assert not list((tmp_path / "run").glob("*/server.pid"))  # torn down


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU host would deploy for real")
def test_the_long_context_flags_reach_the_deploy_whole(tmp_path):
    # long_context printed its JSON on two lines; make cut the deploy's recipe at the line break, and
    # connector-bench.sh and trace-bench.sh deployed nothing
    env = {**os.environ, "PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}", "RUN_DIR": str(tmp_path / "run"),
           "KVSCOPE_MODEL_DIR": str(REPO / "models" / "tiny-qwen3")}
    out = subprocess.run(["bash", "-c", '. loadtests/benchmarks/gpu/env.sh && deploy baseline '
                          '"$(long_context 6442450944)"'], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300)
    text = out.stdout + out.stderr
    assert '"kv-cache-memory-bytes": 6442450944, "gpu-memory-utilization": 0.15}}' in text, text[-3000:]
    assert "unexpected EOF" not in text and "nvidia-smi" in text  # the whole command ran, to the GPU preflight


def test_connector_bench_refuses_an_unknown_part_and_deploys_nothing_for_the_parts_without_servers(tmp_path):
    env = {**os.environ, "PATH": f"{REPO / '.venv-vllm' / 'bin'}:{os.environ['PATH']}", "RUN_DIR": str(tmp_path / "run")}
    script = "loadtests/benchmarks/gpu/connector-bench.sh"
    bad = subprocess.run(["bash", script, str(tmp_path / "bad")], cwd=REPO, env={**env, "PARTS": "tests,sweep"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no part 'sweep' (tests,load,copy,ttft,bench)" in bad.stderr
    for pattern in ("t*", "?ests", "[t]ests"):  # a glob is no part's name, whatever the folder holds
        bad = subprocess.run(["bash", script, str(tmp_path / "bad")], cwd=REPO, env={**env, "PARTS": pattern},
                             capture_output=True, text=True, timeout=60)
        assert bad.returncode == 2 and f"no part '{pattern}'" in bad.stderr, bad.stdout + bad.stderr
    out = subprocess.run(["bash", script, str(tmp_path / "out")], cwd=REPO, env={**env, "PARTS": "tests"},
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "GPU tests exit" in out.stdout, out.stdout + out.stderr
    assert (tmp_path / "out" / "test_gpu.txt").exists() and not (tmp_path / "out" / "deploy.log").exists()
    assert not (tmp_path / "run").exists() and "connector_ttft" not in out.stdout  # no deploy, no sweep


def test_connector_bench_runs_the_parts_without_servers_before_it_deploys(tmp_path):
    """On an 80 GB card the five servers filled the GPU: the GPU tests and copy_paths.py ran out of its memory
    beside them. Here `make` stands in for the deploy and says whether the GPU tests had run by then."""
    tree, bin_dir, log = tmp_path / "tree", tmp_path / "bin", tmp_path / "make.log"
    tree.mkdir()
    for name in ("loadtests", "connector"):
        (tree / name).symlink_to(REPO / name)
    (tree / "models" / "qwen3-4b").mkdir(parents=True)
    (tree / "models" / "qwen3-4b" / "model.safetensors").touch()  # the script's model() builds none
    bin_dir.mkdir()
    (bin_dir / "make").write_text(f'#!/bin/sh\necho "$2" $(ls "{tmp_path / "out"}") >> "{log}"\nexit 1\n')
    (bin_dir / "make").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{REPO / '.venv-vllm' / 'bin'}:{os.environ['PATH']}",
           "RUN_DIR": str(tmp_path / "run"), "PARTS": "ttft,tests"}
    run = subprocess.run(["bash", "loadtests/benchmarks/gpu/connector-bench.sh", str(tmp_path / "out")],
                         cwd=tree, env=env, capture_output=True, text=True, timeout=600)
    assert log.exists(), run.stdout + run.stderr
    first = log.read_text().splitlines()[0].split()
    assert first[0] == "deploy" and "test_gpu.txt" in first[1:], log.read_text() + run.stdout + run.stderr
    # load_throughput.py and copy_paths.py, too slow to run here, stand before the deploy like the tests
    script = (REPO / "loadtests/benchmarks/gpu/connector-bench.sh").read_text()
    assert script.index("if want load") < script.index("if $servers") and script.index("if want copy") < \
        script.index("if $servers")


def validate(*variables: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVSCOPE_PYTHON": sys.executable}  # the host's Python of its overlay.mk: the harness's
    return subprocess.run(["make", "--no-print-directory", "validate", *variables], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)


def test_make_validate_judges_the_platform_the_inventory_deploys_to_and_says_which(tmp_path):
    matrix = tmp_path / "matrix.yaml"
    shutil.copy(REPO / "loadtests" / "kvscope" / "matrix.yaml", matrix)  # a matrix of one's own
    cuda = validate(f"MATRIX={matrix}", "CONFIGS=baseline,offload-cpu", "INVENTORY=ansible/inventories/cuda-processes")
    assert cuda.returncode == 0, cuda.stdout + cuda.stderr
    assert "judged for platform cuda (kvscope_platform of inventory ansible/inventories/cuda-processes)" in cuda.stdout
    cpu = validate(f"MATRIX={matrix}", "CONFIGS=baseline,offload-cpu")  # the embedded default: the CPU
    assert cpu.returncode == 2 and "runs on ['cuda'], not on this platform (cpu)" in cpu.stderr
    assert "judged for platform cpu (kvscope_platform of inventory ansible/inventories/local)" in cpu.stderr


def test_vault_encrypted_bench_variables_are_decrypted_as_ansible_does_or_refused_without_the_ciphertext(
        tmp_path, monkeypatch):
    password = tmp_path / "vault-pass"
    password.write_text("s3cret-pass\n")
    vaulted = subprocess.run([sys.executable, "-m", "ansible", "vault", "encrypt_string", "--vault-password-file",
                              str(password), "runs/{host}/deployment.json", "--name", "kvscope_bench_deployment"],
                             capture_output=True, text=True, timeout=120, check=True).stdout
    (tmp_path / "inv").mkdir()
    inv = write(tmp_path / "inv", TWO, vaulted + "kvscope_locust_master: 10.0.0.1\n")
    monkeypatch.delenv("ANSIBLE_VAULT_IDENTITY_LIST", raising=False)
    monkeypatch.setenv("ANSIBLE_VAULT_PASSWORD_FILE", str(password))  # how ansible-playbook takes it too
    assert inventory.bench_hosts(inv).deployments(None) == [Path("runs/a/deployment.json"),
                                                            Path("runs/b/deployment.json")]
    for env in ("", str(tmp_path / "wrong")):
        (tmp_path / "wrong").write_text("not-it\n")
        if env:
            monkeypatch.setenv("ANSIBLE_VAULT_PASSWORD_FILE", env)
        else:
            monkeypatch.delenv("ANSIBLE_VAULT_PASSWORD_FILE")
        with pytest.raises(inventory.InventoryError, match="kvscope_bench_deployment is vault-encrypted") as err:
            inventory.bench_hosts(inv).deployments(None)
        assert "ANSIBLE_VAULT" not in str(err.value).replace("ANSIBLE_VAULT_PASSWORD_FILE", "")  # no ciphertext


def test_an_inventory_carries_its_own_make_overlay_whatever_its_folder_is_named(tmp_path):
    # the Makefile once picked ansible/bench/<folder name>.mk: a copy of the netns inventory named otherwise lost
    # its steps, and any inventory named netns got them
    mine = tmp_path / "my-cluster"
    shutil.copytree(INVENTORIES / "netns", mine)
    impostor = tmp_path / "netns"
    shutil.copytree(INVENTORIES / "local", impostor)

    def deploy(inv: Path) -> str:
        return subprocess.run(["make", "-n", "-B", "deploy", f"INVENTORY={inv}", "MODEL=/tmp/m"], cwd=REPO,
                              capture_output=True, text=True, timeout=60).stdout

    assert "netns-hosts.sh up" in deploy(mine) and "netns-hosts.sh up" not in deploy(impostor)
    assert "netns-hosts.sh up" in deploy(INVENTORIES / "netns") and "netns-hosts.sh up" not in deploy(INVENTORIES / "local")
    # Ansible does not read the overlay as an inventory source
    assert inventory.read(str(mine))["_meta"]["hostvars"].keys() >= {"kvh1", "kvh2"}
