"""Tiny random MoE models of other families, written to disk the way real checkpoints are."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, save_model

import od_moe

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

# Every tiny model: small widths (multiples of 64, so 4-bit quantization applies), vocabulary and heads.
_TINY = {
    "vocab_size": 8192,
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "tie_word_embeddings": False,
}
MIXTRAL = {
    **_TINY,
    "model_type": "mixtral",
    "num_hidden_layers": 3,
    "num_local_experts": 16,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1e6,
}
QWEN2_MOE = {
    **_TINY,
    "model_type": "qwen2_moe",
    "num_hidden_layers": 3,
    "num_experts": 16,
    "num_experts_per_tok": 4,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
}
LLAMA = {**_TINY, "model_type": "llama", "num_hidden_layers": 2, "rms_norm_eps": 1e-5}


def _build(config, seed):
    mx.random.seed(seed)
    model_class, args_class = _get_classes(config)
    model = model_class(args_class.from_dict(config))
    mx.eval(model.parameters())
    return model


def _finish(path: Path, config: dict):
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        shutil.copy(od_moe.DEFAULT_MODEL / name, path / name)
    return path


def write_mlx_model(path, config, quantize=True, seed=0) -> Path:
    """MLX layout (stacked experts), 4-bit quantized by default."""
    path = Path(path)
    model = _build(config, seed)
    config = dict(config)
    if quantize:
        nn.quantize(
            model,
            group_size=64,
            bits=4,
            class_predicate=lambda _, m: hasattr(m, "to_quantized") and m.weight.shape[-1] % 64 == 0,
        )
        config["quantization"] = {"group_size": 64, "bits": 4, "mode": "affine"}
    save_model(path, model)
    return _finish(path, config)


def write_hf_mixtral(path, config=MIXTRAL, seed=0) -> Path:
    """Hugging Face layout: one float32 tensor per expert (`block_sparse_moe.experts.{e}.w1.weight`)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = _build(config, seed)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if ".switch_mlp." in name:
            prefix, rest = name.split(".switch_mlp.")
            proj = rest.split(".")[0]
            hf = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}[proj]
            for e in range(value.shape[0]):
                weights[f"{prefix}.experts.{e}.{hf}.weight"] = value[e]
        else:
            weights[name] = value
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    return _finish(path, config)
