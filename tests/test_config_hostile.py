"""A hostile matrix, override or inventory (issue 59): flag values that would be read as options, YAML that
grows past its size when its aliases are expanded, secrets redacted by what they are, not by a word."""

from __future__ import annotations

import json

import pytest
import yaml
from conftest import MATRIX as SHIPPED

from kvscope import auth
from kvscope.config import matrix, strict_yaml
from kvscope.config.render import parse_overrides, render


def cfg(doc, name):
    return next(c for c in doc["configs"] if c["name"] == name)


def load_with(tmp_path, name, flags) -> matrix.Matrix:
    doc = yaml.safe_load(SHIPPED.read_text())
    cfg(doc, name)["flags"].update(flags)
    path = tmp_path / "matrix.yaml"
    path.write_text(yaml.safe_dump(doc))
    return matrix.load(path)


SMUGGLED = ["--enable-prefix-caching", "--api-key=sk-1", "--host=0.0.0.0", "-O3"]


@pytest.mark.parametrize("value", SMUGGLED)
def test_a_flag_value_that_vllm_would_read_as_an_option_is_refused_in_the_matrix(tmp_path, value):
    with pytest.raises(matrix.ConfigError, match=r"config 'baseline': field 'flags'.*--trust-remote-code.* reads as "
                                                 "an option"):
        load_with(tmp_path, "baseline", {"--trust-remote-code": value})


@pytest.mark.parametrize("value", SMUGGLED)
def test_a_flag_value_that_vllm_would_read_as_an_option_is_refused_in_the_overrides(value):
    with pytest.raises(matrix.ConfigError, match="flag overrides: .*--disable-log-stats.* reads as an option"):
        parse_overrides(json.dumps({"disable-log-stats": value}))


def test_exact_mode_refuses_an_override_whose_value_would_lift_the_step_cap(tmp_path):
    m = matrix.load(SHIPPED)
    with pytest.raises(matrix.ConfigError, match="reads as an option"):
        render(m, m.get("kvscope-fs"), "cuda", tmp_path, tmp_path / "stores", "127.0.0.1", exact=True,
               overrides=parse_overrides('{"disable-log-stats": "--max-num-batched-tokens=8192", '
                                         '"trust-remote-code": "--attention-backend=FLASH_ATTN"}'))


def test_every_valued_flag_is_rendered_as_one_argument_so_its_value_is_never_an_option(tmp_path):
    m = matrix.load(SHIPPED)
    args = render(m, m.get("baseline"), "cuda", tmp_path, tmp_path / "stores", "127.0.0.1", exact=True,
                  overrides=parse_overrides('{"seed": -1}')).server_args
    assert "--dtype=float32" in args and "--seed=-1" in args and "--attention-backend=TRITON_ATTN" in args
    assert "--max-num-batched-tokens=255" in args and "--no-enable-prefix-caching" in args
    flags = args[8:]  # after kvscope's own --model, --served-model-name, --host and --port
    assert args[:8:2] == ["--model", "--served-model-name", "--host", "--port"]
    assert all(a.startswith("--") for a in flags), flags  # a switch alone, a valued flag with its value


def test_an_alias_bomb_of_big_scalars_is_refused_by_its_expanded_size():
    big = "x" * 30_000
    text = f"a: &a '{big}'\nb: &b [{', '.join(['*a'] * 10)}]\nc: &c [{', '.join(['*b'] * 10)}]\n" \
           f"d: [{', '.join(['*c'] * 10)}]\n"  # 1000 copies: 30 MB from 30 KB, in 1 100 nodes
    with pytest.raises(yaml.YAMLError, match="expand it to .* bytes"):
        strict_yaml.load(text)
    assert strict_yaml.load(f"a: &a '{big}'\nb: [*a, *a]\n")["b"][1] == big  # a few copies read


@pytest.mark.parametrize("text", ["base: &b {x: 1}\nother: &o {y: 2}\nm:\n  <<: *b\n  <<: *o\n",
                                  "base: &b {x: 1}\nm: &m\n  <<: *b\n  <<: *b\nn: {<<: *m}\n",
                                  "base: &b {x: 1}\nm: &m {z: 3}\nn:\n  <<: *m\n  w: 4\n  <<: *b\n"])
def test_two_merge_keys_in_one_mapping_are_refused(text):
    with pytest.raises(yaml.YAMLError, match="'<<' twice"):
        strict_yaml.load(text)
    assert strict_yaml.load("base: &b {x: 1}\nm:\n  <<: [*b]\n  y: 2\n")["m"] == {"x": 1, "y": 2}


def test_a_models_tokens_are_not_redacted_and_credential_tokens_are(tmp_path):
    m = matrix.load(SHIPPED)
    args = render(m, m.get("baseline"), "cpu", tmp_path, tmp_path / "stores", "127.0.0.1").server_args
    buckets = next(a for a in args if a.startswith("--custom-histogram-buckets"))
    assert "time_to_first_token" in buckets and auth.redact_args(args) == args  # nothing secret in it
    assert auth.redact_args(["--custom-histogram-buckets", '{"time_to_first_token": [0.1]}'])[1] == \
        '{"time_to_first_token": [0.1]}'
    doc = {"hf_token": "t1", "access_token": "t2", "token": "t3", "eos_token": "</s>", "inter_token_latency": [1]}
    out = json.loads(auth.redact_args(["--kv-transfer-config", json.dumps(doc)])[1])
    assert out == {**doc, "hf_token": auth.REDACTED, "access_token": auth.REDACTED, "token": auth.REDACTED}
    env = auth.redact_env({"HF_TOKEN": "x", "GITHUB_TOKEN": "y", "FIRST_TOKEN_MS": "5"})
    assert env == {"HF_TOKEN": auth.REDACTED, "GITHUB_TOKEN": auth.REDACTED, "FIRST_TOKEN_MS": "5"}
    assert auth.redact_command("kvscope x --hf-token t4 --token=t5") == \
        f"kvscope x --hf-token {auth.REDACTED} --token={auth.REDACTED}"


def test_a_json_value_given_with_its_flag_in_one_argument_is_redacted_by_key():
    out = auth.redact_args(['--speculative-config={"password": "pw-1", "n": 2}', "--dtype=float32"])
    assert out == ['--speculative-config={"n": 2, "password": "<redacted>"}', "--dtype=float32"]


def check_server_args(tmp_path, servers: list) -> str:
    """docker/check_server_args.py (vLLM's own parser, in the vLLM environment) over these rendered servers."""
    import subprocess

    from conftest import REPO

    path = tmp_path / "rendered.json"
    path.write_text(json.dumps({"kvscope_servers": [s.model_dump() for s in servers]}))
    out = subprocess.run([str(REPO / ".venv-vllm" / "bin" / "python"), str(REPO / "docker" / "check_server_args.py"),
                          str(path)], capture_output=True, text=True, timeout=600)
    return out.stdout


def test_vllms_parser_reads_what_kvscope_rendered_and_nothing_a_value_smuggled(tmp_path):
    # each server as rendered, then as the two-word rendering (`--flag value`) gave it with a smuggling value
    m = matrix.load(SHIPPED)
    golden = render(m, m.get("baseline"), "cuda", tmp_path, tmp_path / "stores", "127.0.0.1")
    exact = render(m, m.get("kvscope-fs"), "cuda", tmp_path, tmp_path / "stores", "127.0.0.1", exact=True)

    def smuggled(server, name, *args):
        return server.model_copy(update={"config": name, "server_args": [*server.server_args, *args]})

    out = check_server_args(tmp_path, [
        golden, exact,
        smuggled(golden, "cache-on", "--trust-remote-code", "--enable-prefix-caching"),
        smuggled(golden, "offload", "--disable-log-stats", "--kv-offloading-size=4"),
        smuggled(golden, "key", "--disable-log-stats", "--api-key=sk-1"),
        smuggled(golden, "host", "--disable-log-stats", "--host=0.0.0.0"),
        smuggled(golden, "positional", "--enforce-eager", "other-model"),
        smuggled(exact, "step-cap", "--disable-log-stats", "--max-num-batched-tokens=8192"),
        smuggled(exact, "backend", "--trust-remote-code", "--attention-backend=FLASH_ATTN"),
        smuggled(golden, "one-word", "--trust-remote-code=--enable-prefix-caching"),  # as kvscope renders it now
    ])
    lines = dict(line.split(": ", 1) for line in out.splitlines() if ": " in line)
    assert lines["baseline"] == "ok" and lines["kvscope-fs"].startswith("ok (attention backend TRITON_ATTN"), out
    assert "prefix caching" in lines["cache-on"] and "KV offloading" in lines["offload"], out
    assert "api_key" in lines["key"] and "sk-1" not in out, out
    assert "host" in lines["host"] and "model_tag" in lines["positional"], out
    assert "max_num_batched_tokens" in lines["step-cap"] and "attention_backend" in lines["backend"], out
    assert "ignored explicit argument" in lines["one-word"], out


@pytest.mark.parametrize("args", [["--kv-offloading-size=4"], ["--kv-offloading-size", "4"], ["--enable-prefix-caching"],
                                  ['--kv-transfer-config={"kv_connector": "X"}']])
def test_a_recorded_golden_with_a_cache_flag_in_either_spelling_is_not_cache_off(args):
    # servers are rendered `--flag=value` now; manifests of older runs hold `--flag value`
    from kvscope.analyze.verdicts import cache_off_problems
    from kvscope.artifacts import Manifest, Treatment

    golden = Treatment(config="baseline", manifest=Manifest(
        config="baseline", role="golden", port=8100, platform="cuda", served_model_name="m", server_args=args,
        vllm_version="0.28.0", kv_capacity_tokens=1, block_size=32, prefix_caching=False, model_path="/m",
        model_hash="h"))
    assert cache_off_problems(golden, [0]) == [f"it ran with {args[0].split('=')[0]}"]


MALFORMED_NAMES = ["--seed 1 --enable-prefix-caching", "--enable-prefix-caching ", "--seed=1 --enable-prefix-caching",
                   "--attention-backend=FLASH_ATTN", "--seed\n--enable-prefix-caching", "---enable-prefix-caching"]


@pytest.mark.parametrize("name", MALFORMED_NAMES)
def test_a_flag_name_that_is_not_one_option_is_refused_in_the_matrix_and_in_the_overrides(tmp_path, name):
    # vLLM's parser reads a word with a space as a positional argument, and '--x=v' as the value v: a name is one
    # option's name (dotted keys allowed), never a second word or a value; kvscope once dropped '=...' silently
    with pytest.raises(matrix.ConfigError, match="not an option's name"):
        load_with(tmp_path, "baseline", {name: True})
    if not name.startswith("---"):  # an override's leading dashes are its own, however many
        with pytest.raises(matrix.ConfigError, match="not an option's name"):
            parse_overrides(json.dumps({name.removeprefix("--"): True}))
    assert load_with(tmp_path, "baseline", {"--compilation-config.mode": 0})  # a dotted key is a name


@pytest.mark.parametrize("command", ["make bench OVERRIDES='{\"hf_token\": \"hf-secret-1234\"}'",
                                     "kvscope bench --overrides '{\"hf-token\": \"hf-secret-1234\"}'",
                                     "kvscope bench --overrides='{\"hf-token\": \"hf-secret-1234\"}'",
                                     "make deploy OVERRIDES='{hf_token: hf-secret-1234, dtype: bfloat16}'"])
def test_a_secret_in_a_json_value_of_a_recorded_command_is_redacted(command):
    # OVERRIDES may carry a credential flag's value (vLLM's --hf-token): the recorded command keeps none of it
    out = auth.redact_command(command)
    assert "hf-secret-1234" not in out and auth.REDACTED in out, out
    kept = "make bench OVERRIDES='{\"dtype\": \"bfloat16\", \"max-num-seqs\": 123456}'"
    assert auth.redact_command(kept) == kept
