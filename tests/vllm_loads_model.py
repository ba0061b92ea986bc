"""Load model folders through vLLM's own model code and loader, as a server would, without serving; run by
.venv-vllm's python (tests/test_model_shapes.py). For each folder given, one JSON line: the config as
transformers reads it, and per model vLLM builds (the main model and, with an MTP head, its MTP draft) the
parameters no checkpoint tensor filled and the element counts of the tensors given and of the parameters.

vLLM's loader alone lets a missing tensor, or an expert's tensor of the wrong shape, pass where the module
exempts itself from its "weights not initialized" check. So every parameter starts as NaN: a parameter
still NaN after loading had no tensor (or too small a one), and the tensors given must hold exactly as
many elements as the parameters (none too large, none ignored). A load error is the line's `error`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig
from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.engine.arg_utils import EngineArgs
from vllm.model_executor.model_loader import get_model_loader
from vllm.utils.torch_utils import set_default_torch_dtype


def checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def load(vllm_config, model_config, tensors: dict[str, torch.Tensor]) -> dict:
    loader = get_model_loader(vllm_config.load_config)
    with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        model = loader.create_model(vllm_config=vllm_config, model_config=model_config)
    params = dict(model.named_parameters())
    for p in params.values():
        p.data.fill_(float("nan"))
    model.load_weights(iter(tensors.items()))
    return {"class": type(model).__name__, "unfilled": sorted(n for n, p in params.items() if p.isnan().any()),
            "given_elements": sum(t.numel() for t in tensors.values()),
            "parameter_elements": sum(p.numel() for p in params.values())}


def check(folder: Path) -> dict:
    hf = AutoConfig.from_pretrained(folder)
    out: dict = {"folder": folder.name, "config_class": type(hf).__name__,
                 "layer_types": getattr(hf, "layer_types", None)}
    mtp = getattr(hf, "num_nextn_predict_layers", 0) > 0
    spec = {"method": "mtp", "num_speculative_tokens": 1} if mtp else None
    cfg = EngineArgs(model=str(folder), dtype="float32", enforce_eager=True, max_model_len=1024,
                     speculative_config=spec).create_engine_config()
    tensors = checkpoint(folder)
    try:
        with set_current_vllm_config(cfg):
            # the main model loads all but the MTP head; the MTP draft its `mtp.*` layer and the shared
            # embeddings and LM head (qwen3_next_mtp.py's remap)
            out["main"] = load(cfg, cfg.model_config, {k: v for k, v in tensors.items() if not k.startswith("mtp.")})
            if mtp:
                shared = {k: v for k, v in tensors.items()
                          if k.startswith("mtp.") or k in ("model.embed_tokens.weight", "lm_head.weight")}
                out["mtp"] = load(cfg, cfg.speculative_config.draft_model_config, shared)
    except Exception as exc:  # noqa: BLE001 - the test reads vLLM's own error line
        out["error"] = f"{type(exc).__name__}: {exc}"[:500]
    return out


def main() -> None:
    with set_current_vllm_config(VllmConfig()):  # one process, no parallelism
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="tcp://127.0.0.1:0")
        initialize_model_parallel(1, 1)
    for folder in sys.argv[1:]:
        print(json.dumps(check(Path(folder))), flush=True)


if __name__ == "__main__":
    main()
