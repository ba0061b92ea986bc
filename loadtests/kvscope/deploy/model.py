"""Build kvscope's tiny offline Qwen3 model: no hub, no download, byte-identical on every build.

The tokenizer is a byte-level BPE trained on CPython's own offline prose (`pydoc_data.topics`); the weights
are seeded random normals. Two choices make the model useful for fidelity checks:
- init std 0.1 (not HF's 0.02), so logits are spread and greedy output depends on the context, and
- untied input/output embeddings, so every cached token's KV, not just the last token, shapes the answer.
A wrong KV block therefore changes the continuation, which is what kvscope needs to see.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# The default shape: 4 layers, hidden 256, head_dim 64 (a CPU attention size), ~19 MB in fp32. Deep enough
# that prefill, not HTTP and scheduling, dominates a cold TTFT on a CPU, so cache hits show as speed.
DEFAULT_SHAPE = {
    "vocab_size": 3072,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "max_position_embeddings": 8192,
}


# A Qwen3-4B-shaped model for GPU hosts, where a 2k-token prefill, not scheduling, dominates TTFT (~14 GB in
# fp32 on disk; serve it in bf16 with the flag override {"dtype": "bfloat16"}). 9 such servers fit one H200.
# Its context is Qwen3-4B's own (40960 positions), for the long-context sweep.
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": DEFAULT_SHAPE,
    "qwen3-4b": {**DEFAULT_SHAPE, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                 "max_position_embeddings": 40960},
    # Gemma 3's pattern at the tiny size: 5 sliding-window layers, then 1 global, a 128-token window (two of
    # the CPU configs' 64-token blocks), shorter than the workloads' prompts (~260 tokens and more).
    "tiny-gemma3": {**DEFAULT_SHAPE, "num_hidden_layers": 6, "sliding_window": 128,
                    "layer_types": ["sliding_attention"] * 5 + ["full_attention"]},
    # DeepSeek-V2-Lite's attention (MLA: one 512-wide latent vector + a 64-wide RoPE key a token; no q LoRA)
    # at the tiny size, every layer dense (no MoE: first_k_dense_replace = all layers).
    "tiny-deepseek-v2": {"vocab_size": 3072, "hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 4,
                         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 8192,
                         "kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128,
                         "qk_rope_head_dim": 64, "v_head_dim": 128},
    # UCM #867's Qwen3-32B-AWQ: its per-layer shapes and int4 AWQ (GEMM packing, groups of 128, fp16 scales),
    # 4 of its 64 layers (~1 GB); the tiny tokenizer's vocabulary. For GPU hosts (AWQ runs in fp16 or bf16).
    "qwen3-32b-awq": {**DEFAULT_SHAPE, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 4,
                      "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                      "max_position_embeddings": 40960,
                      "quantization_config": {"bits": 4, "group_size": 128, "quant_method": "awq",
                                              "version": "gemm", "zero_point": True}},
    # Qwen3-Next's hybrid pattern at the tiny size: 3 Gated DeltaNet (linear-attention) layers, then 1 gated
    # full-attention layer; sparse-MoE MLPs (4 experts, 2 a token, a shared expert) and one MTP layer
    # (`mtp.*`, the draft model of MTP speculative decoding). Its linear layers keep Qwen3-Next's two value
    # heads a key head; head sizes are the CPU attention size.
    "tiny-qwen3-next": {**DEFAULT_SHAPE, "full_attention_interval": 4,
                        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
                        "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 64,
                        "linear_value_head_dim": 64, "linear_conv_kernel_dim": 4, "num_experts": 4,
                        "num_experts_per_tok": 2, "moe_intermediate_size": 128, "shared_expert_intermediate_size": 128,
                        "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
                        "num_nextn_predict_layers": 1},
}
# The architecture of each shape (Qwen3 where not named)
ARCHITECTURE = {"tiny-gemma3": "gemma3", "tiny-deepseek-v2": "deepseek-v2", "qwen3-32b-awq": "qwen3-awq",
                "tiny-qwen3-next": "qwen3-next"}


def training_text() -> list[str]:
    """Offline English prose shipped with CPython (~465k characters)."""
    from pydoc_data.topics import topics

    return [topics[key] for key in sorted(topics)]


def build_tokenizer(out: Path, vocab_size: int, max_len: int = DEFAULT_SHAPE["max_position_embeddings"]):
    # NOTE: rayon's parallel merge counting can order ties differently between runs; one thread keeps
    # the merges, and so tokenizer.json, identical on every build.
    os.environ["RAYON_NUM_THREADS"] = "1"
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(), trainer=trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": max_len,
                "clean_up_tokenization_spaces": False,
                "chat_template": CHAT_TEMPLATE,
            },
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return tok


def qwen3_shapes(shape: dict) -> dict[str, tuple[int, ...]]:
    """Each Qwen3 tensor's name and shape, in qwen3_weights' order."""
    h, i, d = shape["hidden_size"], shape["intermediate_size"], shape["head_dim"]
    q_out, kv_out = shape["num_attention_heads"] * d, shape["num_key_value_heads"] * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape["vocab_size"], h)}
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                       p + "self_attn.q_proj.weight": (q_out, h), p + "self_attn.k_proj.weight": (kv_out, h),
                       p + "self_attn.v_proj.weight": (kv_out, h), p + "self_attn.o_proj.weight": (h, q_out),
                       p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,),
                       p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                       p + "mlp.down_proj.weight": (h, i)})
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (shape["vocab_size"], h)
    return shapes


def qwen3_weights(shape: dict, seed: int, std: float) -> dict[str, np.ndarray]:
    """Random Qwen3 weights with HF's parameter names; norms at 1, everything else N(0, std)."""
    rng = np.random.default_rng(seed)
    return {name: np.ones(dims, np.float32) if "norm" in name else (rng.standard_normal(dims) * std).astype(np.float32)
            for name, dims in qwen3_shapes(shape).items()}


def qwen3_config(shape: dict, tok, std: float) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        **shape,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "initializer_range": std,
        "torch_dtype": "float32",
        "use_cache": True,
        "bos_token_id": tok.token_to_id("<|endoftext|>"),
        "eos_token_id": tok.token_to_id("<|im_end|>"),
        "pad_token_id": tok.token_to_id("<|endoftext|>"),
    }


def gemma3_weights(shape: dict, seed: int, std: float) -> dict[str, np.ndarray]:
    """Qwen3's tensors (Gemma 3 has the same projections and q/k norms) plus Gemma's two feed-forward norms;
    every norm 0, as Gemma's RMSNorm scales by 1 + weight."""
    w = qwen3_weights(shape, seed, std)
    for layer in range(shape["num_hidden_layers"]):
        for norm in ("pre_feedforward_layernorm", "post_feedforward_layernorm"):
            w[f"model.layers.{layer}.{norm}.weight"] = np.ones(shape["hidden_size"], np.float32)
    return {name: np.zeros_like(t) if "norm" in name else t for name, t in w.items()}


def gemma3_config(shape: dict, tok, std: float) -> dict:
    config = qwen3_config(shape, tok, std)
    config.update(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_act=None,
                  hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=shape["head_dim"],
                  final_logit_softcapping=None, attn_logit_softcapping=None,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})
    del config["hidden_act"], config["rope_theta"]
    return config


def deepseek_v2_weights(shape: dict, seed: int, std: float) -> dict[str, np.ndarray]:
    """Random DeepSeek-V2 MLA weights (no q LoRA, dense MLPs) with HF's parameter names."""
    rng = np.random.default_rng(seed)
    h, i, heads = shape["hidden_size"], shape["intermediate_size"], shape["num_attention_heads"]
    nope, rope, v, rank = (shape[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"))

    def normal(*dims: int) -> np.ndarray:
        return (rng.standard_normal(dims) * std).astype(np.float32)

    w = {"model.embed_tokens.weight": normal(shape["vocab_size"], h)}
    for layer in range(shape["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        w[p + "input_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
        w[p + "self_attn.q_proj.weight"] = normal(heads * (nope + rope), h)
        w[p + "self_attn.kv_a_proj_with_mqa.weight"] = normal(rank + rope, h)
        w[p + "self_attn.kv_a_layernorm.weight"] = np.ones(rank, np.float32)
        w[p + "self_attn.kv_b_proj.weight"] = normal(heads * (nope + v), rank)
        w[p + "self_attn.o_proj.weight"] = normal(h, heads * v)
        w[p + "mlp.gate_proj.weight"] = normal(i, h)
        w[p + "mlp.up_proj.weight"] = normal(i, h)
        w[p + "mlp.down_proj.weight"] = normal(h, i)
    w["model.norm.weight"] = np.ones(h, np.float32)
    w["lm_head.weight"] = normal(shape["vocab_size"], h)
    return w


def deepseek_v2_config(shape: dict, tok, std: float) -> dict:
    config = qwen3_config(shape, tok, std)
    config.update(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2",
                  # no MoE: every layer is below first_k_dense_replace (the expert fields must still be numbers)
                  first_k_dense_replace=shape["num_hidden_layers"], n_routed_experts=1, n_shared_experts=1,
                  num_experts_per_tok=1, moe_intermediate_size=shape["intermediate_size"], moe_layer_freq=1,
                  topk_method="greedy", routed_scaling_factor=1.0)
    return config


def qwen3_awq_weights(shape: dict, seed: int, std: float) -> dict[str, np.ndarray]:
    """Qwen3's tensors with every projection int4 AWQ (GEMM layout: qweight and qzeros int32 [in, out / 8] and
    [in / group, out / 8], scales fp16 [in / group, out]); random nibbles around a zero point of 8, scaled to
    N(0, std)'s spread; everything else fp16."""
    rng = np.random.default_rng(seed)
    group = shape["quantization_config"]["group_size"]
    scale = np.float16(std / np.sqrt(np.mean((np.arange(16) - 8.0) ** 2)))
    w: dict[str, np.ndarray] = {}
    for name, t in qwen3_shapes(shape).items():
        if name.endswith("_proj.weight"):
            out, inp = t
            base = name.removesuffix(".weight")
            w[base + ".qweight"] = rng.integers(0, 2**32, (inp, out // 8), dtype=np.uint32).view(np.int32)
            w[base + ".qzeros"] = np.full((inp // group, out // 8), 0x88888888, np.uint32).view(np.int32)
            w[base + ".scales"] = np.full((inp // group, out), scale, np.float16)
        elif "norm" in name:
            w[name] = np.ones(t, np.float16)
        else:
            w[name] = (rng.standard_normal(t) * std).astype(np.float16)
    return w


def qwen3_awq_config(shape: dict, tok, std: float) -> dict:
    return {**qwen3_config(shape, tok, std), "torch_dtype": "float16"}


def qwen3_next_shapes(shape: dict) -> dict[str, tuple[int, ...]]:
    """Each Qwen3-Next tensor's name and shape as its checkpoints store them (vLLM's qwen3_next.py and
    qwen3_next_mtp.py load these): fused in_proj_qkvz / in_proj_ba, a depthwise conv1d, gated attention
    (q_proj twice as wide: query and gate), MoE experts one by one, and the MTP layer under `mtp.`."""
    h, d, heads, kv_heads = (shape[k] for k in ("hidden_size", "head_dim", "num_attention_heads",
                                                "num_key_value_heads"))
    key, value = (shape["linear_num_key_heads"] * shape["linear_key_head_dim"],
                  shape["linear_num_value_heads"] * shape["linear_value_head_dim"])
    v_heads, moe, shared = (shape[k] for k in ("linear_num_value_heads", "moe_intermediate_size",
                                               "shared_expert_intermediate_size"))

    def layer(p: str, kind: str) -> dict[str, tuple[int, ...]]:
        t: dict[str, tuple[int, ...]] = {p + "input_layernorm.weight": (h,),
                                         p + "post_attention_layernorm.weight": (h,)}
        if kind == "linear_attention":
            a = p + "linear_attn."
            t.update({a + "in_proj_qkvz.weight": (2 * key + 2 * value, h), a + "in_proj_ba.weight": (2 * v_heads, h),
                      a + "conv1d.weight": (2 * key + value, 1, shape["linear_conv_kernel_dim"]),
                      a + "dt_bias": (v_heads,), a + "A_log": (v_heads,),
                      a + "norm.weight": (shape["linear_value_head_dim"],), a + "out_proj.weight": (h, value)})
        else:
            a = p + "self_attn."
            t.update({a + "q_proj.weight": (2 * heads * d, h), a + "k_proj.weight": (kv_heads * d, h),
                      a + "v_proj.weight": (kv_heads * d, h), a + "o_proj.weight": (h, heads * d),
                      a + "q_norm.weight": (d,), a + "k_norm.weight": (d,)})
        m = p + "mlp."
        t[m + "gate.weight"] = (shape["num_experts"], h)
        for e in range(shape["num_experts"]):
            t.update({f"{m}experts.{e}.gate_proj.weight": (moe, h), f"{m}experts.{e}.up_proj.weight": (moe, h),
                      f"{m}experts.{e}.down_proj.weight": (h, moe)})
        t.update({m + "shared_expert.gate_proj.weight": (shared, h), m + "shared_expert.up_proj.weight": (shared, h),
                  m + "shared_expert.down_proj.weight": (h, shared), m + "shared_expert_gate.weight": (1, h)})
        return t

    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (shape["vocab_size"], h)}
    for i, kind in enumerate(shape["layer_types"]):
        shapes.update(layer(f"model.layers.{i}.", kind))
    shapes["model.norm.weight"] = (h,)
    shapes["lm_head.weight"] = (shape["vocab_size"], h)
    shapes["mtp.fc.weight"] = (h, 2 * h)
    for i in range(shape["num_nextn_predict_layers"]):
        shapes.update(layer(f"mtp.layers.{i}.", "full_attention"))
    shapes.update({f"mtp.{norm}.weight": (h,) for norm in ("norm", "pre_fc_norm_hidden", "pre_fc_norm_embedding")})
    return shapes


def qwen3_next_weights(shape: dict, seed: int, std: float) -> dict[str, np.ndarray]:
    """Random Qwen3-Next weights: its RMSNorms 0 (they scale by 1 + weight, as Gemma's) except the linear
    layers' gated norm (1), dt_bias 1 and A_log log(U(1, 16)) as Qwen3-Next initialises them, the rest
    N(0, std)."""
    rng = np.random.default_rng(seed)

    def tensor(name: str, dims: tuple[int, ...]) -> np.ndarray:
        if name.endswith(("linear_attn.norm.weight", "dt_bias")):
            return np.ones(dims, np.float32)
        if "norm" in name:
            return np.zeros(dims, np.float32)
        if name.endswith("A_log"):
            return np.log(rng.uniform(1, 16, dims)).astype(np.float32)
        return (rng.standard_normal(dims) * std).astype(np.float32)

    return {name: tensor(name, dims) for name, dims in qwen3_next_shapes(shape).items()}


def qwen3_next_config(shape: dict, tok, std: float) -> dict:
    config = qwen3_config(shape, tok, std)
    config.update(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", partial_rotary_factor=0.25)
    return config


BUILDERS = {"qwen3": (qwen3_config, qwen3_weights), "gemma3": (gemma3_config, gemma3_weights),
            "deepseek-v2": (deepseek_v2_config, deepseek_v2_weights),
            "qwen3-awq": (qwen3_awq_config, qwen3_awq_weights),
            "qwen3-next": (qwen3_next_config, qwen3_next_weights)}


def model_hash(model_dir: Path) -> str:
    """sha256 over every file's name and bytes, in name order: the model's identity in manifests."""
    digest = hashlib.sha256()
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def build(out: Path, seed: int = 0, std: float = 0.1, shape_name: str = "tiny") -> str:
    """Write the model into `out` (replacing what was there) and return its hash."""
    from safetensors.numpy import save_file

    shape = dict(SHAPES[shape_name])
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.iterdir():
        if stale.is_file():
            stale.unlink()
    tok = build_tokenizer(out, shape["vocab_size"], shape["max_position_embeddings"])
    shape["vocab_size"] = tok.get_vocab_size()
    config, weights = BUILDERS[ARCHITECTURE.get(shape_name, "qwen3")]
    (out / "config.json").write_text(json.dumps(config(shape, tok, std), indent=2, sort_keys=True) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": tok.token_to_id("<|im_end|>"), "do_sample": False}, indent=2) + "\n"
    )
    save_file(weights(shape, seed, std), str(out / "model.safetensors"), metadata={"format": "pt"})
    os.chmod(out / "model.safetensors", 0o644)  # safetensors writes 0600; a container's server reads it as its user
    return model_hash(out)
