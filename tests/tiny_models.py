"""Tiny random MoE models of other families, written to disk the way real checkpoints are."""

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.utils import dequantize_model, load_model, save_model

import od_moe
from od_moe.model_surgery.mlx_lm_private import model_classes

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
E = 16  # experts per MoE layer in every family model
_SMALL = {
    **_TINY,
    "vocab_size": 1024,
    "hidden_size": 64,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
}
_SMALL.update(rope_theta=10000.0)
# fmt: off
# One tiny model per mlx-lm MoE family, as small as each class allows (a leading dense layer or a hybrid
# layer where the family has them). Token ids below 1024 only: prompts are given as ids.
FAMILIES = {
    "qwen3_moe": dict(
        num_hidden_layers=2, num_experts=E, num_experts_per_tok=4, decoder_sparse_step=1, mlp_only_layers=[],
        moe_intermediate_size=64, head_dim=32, norm_topk_prob=True,
    ),
    "qwen3_next": dict(  # linear-attention (gated delta net) layer + full attention, shared expert
        num_hidden_layers=2, full_attention_interval=2, linear_num_value_heads=2, linear_num_key_heads=1,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=E,
        num_experts_per_tok=4, decoder_sparse_step=1, shared_expert_intermediate_size=64, mlp_only_layers=[],
        moe_intermediate_size=64, partial_rotary_factor=0.25, head_dim=32, norm_topk_prob=True,
    ),
    "qwen2_moe": dict(
        num_hidden_layers=2, num_experts=E, num_experts_per_tok=4, moe_intermediate_size=64,
        shared_expert_intermediate_size=128,
    ),
    "deepseek_v2": dict(  # dense first layer, grouped (group-limited greedy) softmax routing, MLA
        num_hidden_layers=3, num_key_value_heads=2, n_routed_experts=E, num_experts_per_tok=4,
        n_shared_experts=1, moe_intermediate_size=64, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16,
        v_head_dim=32, qk_nope_head_dim=32, topk_method="group_limited_greedy", n_group=4, topk_group=2,
        first_k_dense_replace=1, routed_scaling_factor=1.5,
        rope_scaling={"factor": 1.0, "original_max_position_embeddings": 512, "mscale_all_dim": 0},
    ),
    "deepseek_v3": dict(  # sigmoid gate with score-correction bias, grouped top-k, dense first layer
        num_hidden_layers=3, num_key_value_heads=2, n_routed_experts=E, num_experts_per_tok=4,
        n_shared_experts=1, moe_intermediate_size=64, kv_lora_rank=64, q_lora_rank=64, qk_rope_head_dim=16,
        v_head_dim=32, qk_nope_head_dim=32, n_group=4, topk_group=2, first_k_dense_replace=1,
        routed_scaling_factor=2.5,
    ),
    "glm4_moe": dict(
        num_hidden_layers=3, n_routed_experts=E, num_experts_per_tok=4, n_shared_experts=1,
        moe_intermediate_size=64, head_dim=32, norm_topk_prob=True, n_group=1, topk_group=1,
        routed_scaling_factor=2.5, first_k_dense_replace=1, rope_scaling=None, use_qk_norm=True,
        attention_bias=True, partial_rotary_factor=0.5,
    ),
    "gpt_oss": dict(  # expert biases, clamped SwiGLU, router bias, sliding window
        num_hidden_layers=2, num_local_experts=E, num_experts_per_tok=4, intermediate_size=64, head_dim=32,
        sliding_window=4, layer_types=["sliding_attention", "full_attention"],
    ),
    "olmoe": dict(num_hidden_layers=2, intermediate_size=64, num_experts=E, num_experts_per_tok=4),
    "mixtral": dict(num_hidden_layers=2, intermediate_size=64, num_local_experts=E, num_experts_per_tok=2),
    "phimoe": dict(  # sparsemixer routing
        num_hidden_layers=2, intermediate_size=64, num_local_experts=E, num_experts_per_tok=2,
        original_max_position_embeddings=512,
    ),
    "granitemoe": dict(  # router at `router.layer`
        num_hidden_layers=2, intermediate_size=64, logits_scaling=2.0, attention_multiplier=0.1,
        embedding_multiplier=4.0, residual_multiplier=0.5, attention_bias=False, num_local_experts=E,
        num_experts_per_tok=4,
    ),
    "llama4": dict(  # sigmoid-scaled expert input, shared expert (the class wants 4 layers)
        text_config=dict(
            _SMALL, model_type="llama4_text", num_hidden_layers=4, attention_bias=False,
            attention_chunk_size=64, head_dim=32, interleave_moe_layer_step=1, intermediate_size=64,
            intermediate_size_mlp=128, num_experts_per_tok=1, num_local_experts=E, rope_scaling=None,
            use_qk_norm=True,
        ),
    ),
    "minimax": dict(  # sigmoid gate with score-correction bias
        num_hidden_layers=2, intermediate_size=64, num_experts_per_tok=4, num_local_experts=E,
        shared_intermediate_size=0, rotary_dim=16, head_dim=32,
    ),
    "hunyuan": dict(  # router at `gate.wg`, shared MLP
        num_hidden_layers=2, attention_bias=False, moe_topk=4, num_experts=E, num_shared_expert=1,
        use_mixed_mlp_moe=True, use_qk_norm=True, use_cla=False, cla_share_factor=2, moe_intermediate_size=64,
        rope_scaling={"alpha": 1.0, "factor": 1.0, "type": "dynamic"},
    ),
    "ernie4_5_moe": dict(  # sigmoid gate, dense first layer, shared expert
        num_hidden_layers=3, use_bias=False, moe_num_experts=E, moe_k=4, moe_intermediate_size=64,
        moe_num_shared_experts=1, moe_layer_start_index=1, moe_gate_act="sigmoid", head_dim=32,
    ),
    "dots1": dict(  # sigmoid + score-correction bias, grouped top-k, dense first layer, experts at `experts`
        num_hidden_layers=3, first_k_dense_replace=1, moe_intermediate_size=64, n_routed_experts=E,
        n_shared_experts=1, norm_topk_prob=True, num_experts_per_tok=4, routed_scaling_factor=2.0,
        head_dim=32, n_group=4, topk_group=2,
    ),
    "bailing_moe": dict(  # sigmoid + expert bias, grouped top-k, dense first layer, `gate.gate_proj`
        num_hidden_layers=3, moe_intermediate_size=64, num_experts=E, num_shared_experts=1,
        norm_topk_prob=True, num_experts_per_tok=4, first_k_dense_replace=1, score_function="sigmoid",
        moe_router_enable_expert_bias=True, n_group=4, topk_group=2, routed_scaling_factor=2.0,
        use_qk_norm=True,
    ),
    "jamba": dict(  # Mamba layer + attention layer
        num_hidden_layers=2, intermediate_size=64, attn_layer_offset=1, attn_layer_period=2,
        expert_layer_offset=0, expert_layer_period=1, mamba_d_conv=4, mamba_d_state=16, mamba_expand=2,
        num_experts=E, num_experts_per_tok=2,
    ),
    "lfm2_moe": dict(  # short-convolution layers, dense first layer, sigmoid + expert bias
        num_hidden_layers=3, moe_intermediate_size=64, num_experts=E, num_experts_per_tok=4,
        norm_topk_prob=True, use_expert_bias=True, num_dense_layers=1, norm_eps=1e-5, conv_bias=False,
        conv_L_cache=3, layer_types=["conv", "full_attention", "conv"],
    ),
    "gemma4_text": dict(  # GeGLU experts beside a dense MLP, router on the decoder layer
        num_hidden_layers=2, head_dim=32, global_head_dim=64, num_kv_shared_layers=0,
        hidden_size_per_layer_input=0, vocab_size_per_layer_input=1024, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"], enable_moe_block=True, num_experts=E,
        top_k_experts=2, moe_intermediate_size=64, tie_word_embeddings=True,
    ),
    "nemotron_h": dict(  # SwitchMLP with ReLU^2, Mamba-2 layers, sigmoid + score-correction bias
        hybrid_override_pattern=["M", "E", "*", "E"], attention_bias=False, mamba_num_heads=4,
        mamba_head_dim=16, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=1,
        mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True, head_dim=32,
        moe_intermediate_size=64, moe_shared_expert_intermediate_size=64, n_group=1, n_routed_experts=E,
        n_shared_experts=1, topk_group=1, num_experts_per_tok=4, norm_topk_prob=True,
        routed_scaling_factor=2.0, time_step_limit=[0.0, 1e9], time_step_min=0.001, time_step_max=0.1,
    ),
}
# fmt: on
FAMILIES = {name: {**_SMALL, "model_type": name, **config} for name, config in FAMILIES.items()}
FAMILIES["llama4"] = {"model_type": "llama4", "text_config": FAMILIES["llama4"]["text_config"]}
MIXTRAL = FAMILIES["mixtral"]
QWEN2_MOE = FAMILIES["qwen2_moe"]
LLAMA = {**_TINY, "model_type": "llama", "num_hidden_layers": 2, "rms_norm_eps": 1e-5}
# DBRX: experts as separate MLPs that mlx-lm runs one by one (od-moe refuses it); written unquantized
DBRX = {
    "model_type": "dbrx",
    "vocab_size": 1024,
    "d_model": 64,
    "n_layers": 1,
    "n_heads": 2,
    "ffn_config": {"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    "attn_config": {"kv_n_heads": 1, "clip_qkv": 8, "rope_theta": 10000.0},
}


def _build(config, seed):
    mx.random.seed(seed)
    model_class, args_class = model_classes(config)
    model = model_class(args_class.from_dict(config))
    # Routers and biases that mlx-lm initialises to zeros (DeepSeek-V3's gate, expert biases, score
    # corrections) would route every token alike and leave the bias paths untested: draw them at random.
    model.update(
        tree_unflatten(
            [
                (name, mx.random.normal(v.shape) * (0.1 if v.ndim == 1 else v.shape[-1] ** -0.5))
                for name, v in tree_flatten(model.parameters())
                if mx.issubdtype(v.dtype, mx.floating) and not mx.any(v).item()
            ]
        )
    )
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


def write_hf_per_expert(path, config=None, source=None, shards=3, seed=0) -> Path:
    """Hugging Face layout: one bfloat16 tensor per expert (`mlp.experts.{e}.gate_proj.weight`, Mixtral's
    `block_sparse_moe.experts.{e}.w1.weight`), sharded over `shards` files listed by an index.

    The model is a tiny random one of `config`, or the MLX model folder `source` dequantized (its
    config and tokenizer are kept)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if source is not None:
        model, config = load_model(Path(source))
        model = dequantize_model(model)
        config = {k: v for k, v in json.loads((Path(source) / "config.json").read_text()).items()}
        config.pop("quantization", None)
        config.pop("quantization_config", None)
    else:
        model = _build(config, seed)
    mixtral = {"gate_proj": "w1", "down_proj": "w2", "up_proj": "w3"}
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        value = value.astype(mx.bfloat16)
        if ".switch_mlp." in name:
            prefix, rest = name.split(".switch_mlp.")
            proj, part = rest.split(".")
            proj = mixtral[proj] if prefix.endswith("block_sparse_moe") else proj
            weights.update({f"{prefix}.experts.{e}.{proj}.{part}": value[e] for e in range(value.shape[0])})
        else:
            weights[name] = value
    names = sorted(weights)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        chunk = names[i * len(names) // shards : (i + 1) * len(names) // shards]
        mx.save_safetensors(str(path / file), {k: weights[k] for k in chunk})
        weight_map.update(dict.fromkeys(chunk, file))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    if source is not None:
        for name in TOKENIZER_FILES:
            shutil.copy(Path(source) / name, path / name)
        (path / "config.json").write_text(json.dumps(config, indent=1))
        return path
    return _finish(path, config)
