"""Checkpoints with real MoE models' shapes, written from a pinned recipe: what `od-moe bench --shape` builds.

Each named shape is a real model's published Hugging Face `config.json` (the values below, with the
repository they come from: written from knowledge of those files and checked against copies of them, and
parameter counts, quoted in other public projects; no network here to read the originals), so expert
sizes, routing fan-out, attention and layer structure are the real ones; only the vocabulary is the
bundled tokenizer's 8192 tokens (its tokenizer is copied), and the weights are drawn from `RECIPE`, so a
shape's routing statistics are the same whoever builds it. Models are mlx-lm's own classes
(`mlx_lm_private.model_classes`), quantized as `mlx_lm.convert -q` quantizes them (4-bit affine, group 64,
with each model's own `quant_predicate`: 8-bit routers), so `mlx_lm.load` and `od_moe.load` read the
result like any converted checkpoint. gpt-oss-20b keeps its experts in MXFP4, as shipped
(`mxfp4_quantize`). `bundled-real-widths` is the bundled trained model padded to real widths instead
(`real_widths.py`).

Memory stays bounded: a checkpoint is written one weight at a time (one expert of a stacked weight),
drawn on worker threads, quantized, and written at its place in the shards (`shards.py`): building the
16.8 GB Qwen3-30B-A3B holds a few experts' float32 draws at once. A destination that already holds a
complete checkpoint of the same shape, layer count and recipe is kept.
Not here: running benchmarks on the checkpoints (`two_tier_grid.py`), the shards' writing (`shards.py`).
"""

import copy
import json
import os
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict, cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import quantize_model

from ..errors import UserError
from ..model_surgery.mlx_lm_private import model_classes
from ..model_surgery.routing import ROUTER_NAMES
from ..storage.model_files import DEFAULT_MODEL
from .real_widths import PADDED, Padding, pad_bundled
from .shards import SHARD_BYTES, Tensor, raw, safetensors_dtype, write_checkpoint


class _Quantization(TypedDict):
    """`RECIPE["quantization"]`: how mlx-lm quantizes the weights."""

    group_size: int
    bits: int
    mode: str


class _RecipeValues(TypedDict):
    """`RECIPE`'s entries (a plain dict, recorded in each checkpoint's config.json)."""

    version: int
    seed: int
    draw: str
    std: float
    router_std: float
    norm_weight: float
    dtype: str
    quantization: _Quantization


# Pinned: changing any value changes every checkpoint built from it (a recorded recipe then no longer
# matches, and the next build rewrites the files). The draws are numpy's PCG64 normals, one stream per
# tensor (per expert of a stacked weight) seeded from (seed, crc32 of the tensor's name, expert): a tensor's
# values depend on its name alone, not on the order of writing, the shards or the number of layers. numpy
# rather than mx.random.normal: numpy draws faster (MLX goes through its erfinv), and the draws are most
# of a build (docs/GPU.md, "A card smaller than the model").
RECIPE: _RecipeValues = {
    "version": 1,
    "seed": 0,
    "draw": "numpy PCG64 standard_normal float32, stream per tensor/expert from (seed, crc32(name), expert)",
    "std": 0.02,  # every matrix
    "router_std": 0.5,  # routers ("gate"/"router" modules of MoE blocks)
    "norm_weight": 1.0,  # every norm's weight; other vectors (biases, sinks, A_log, dt_bias) are 0
    "dtype": "bfloat16",  # stored float tensors (unquantized weights, affine scales and biases)
    "quantization": {"group_size": 64, "bits": 4, "mode": "affine"},  # routers 8 bits: mlx-lm's predicate
}
MXFP4 = {"group_size": 32, "bits": 4, "mode": "mxfp4"}


@dataclass(frozen=True)
class Shape:
    """A real model's configuration: `config` is its Hugging Face config.json (the keys mlx-lm reads) with
    the bundled tokenizer's vocabulary; `experts` quantizes its experts otherwise than `RECIPE` does."""

    source: str  # the Hugging Face repository the values are from
    config: dict
    experts: dict | None = None


# Token ids are the bundled tokenizer's (bos = eos = 0): the real ones lie outside its vocabulary.
_TOKENS = {"vocab_size": 8192, "bos_token_id": 0, "eos_token_id": 0, "tie_word_embeddings": False}
# fmt: off
SHAPES = {
    "qwen3-30b-a3b": Shape("Qwen/Qwen3-30B-A3B", dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_experts=128, num_experts_per_tok=8, decoder_sparse_step=1,
        mlp_only_layers=[], norm_topk_prob=True, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        attention_bias=False, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
        **_TOKENS,
    )),
    # 44 GB at 48 layers: fewer layers (`layers=`, --shape-layers) for small disks
    "qwen3-next-80b-a3b": Shape("Qwen/Qwen3-Next-80B-A3B-Instruct", dict(
        model_type="qwen3_next", hidden_size=2048, intermediate_size=5120, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_hidden_layers=48, num_experts=512, num_experts_per_tok=10,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        full_attention_interval=4,  # every 4th layer full attention, the others gated delta net
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, partial_rotary_factor=0.25,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, attention_bias=False, rms_norm_eps=1e-6,
        rope_theta=10000000.0, max_position_embeddings=262144, **_TOKENS,
    )),
    "mixtral-8x7b": Shape("mistralai/Mixtral-8x7B-v0.1", dict(
        model_type="mixtral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_local_experts=8, num_experts_per_tok=2, num_attention_heads=32, num_key_value_heads=8,
        rms_norm_eps=1e-5, rope_theta=1000000.0, max_position_embeddings=32768, **_TOKENS,
    )),
    "deepseek-v2-lite": Shape("deepseek-ai/DeepSeek-V2-Lite", dict(
        model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
        num_hidden_layers=27, first_k_dense_replace=1, moe_layer_freq=1, n_routed_experts=64,
        n_shared_experts=2, num_experts_per_tok=6, topk_method="greedy", n_group=1, topk_group=1,
        norm_topk_prob=False, routed_scaling_factor=1.0, scoring_func="softmax", num_attention_heads=16,
        num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_nope_head_dim=128,
        qk_rope_head_dim=64, v_head_dim=128, attention_bias=False, rms_norm_eps=1e-6, rope_theta=10000,
        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
                      "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707},
        max_position_embeddings=163840, **_TOKENS,
    )),
    "gpt-oss-20b": Shape("openai/gpt-oss-20b", dict(
        model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
        num_local_experts=32, num_experts_per_tok=4, num_attention_heads=64, num_key_value_heads=8,
        head_dim=64, attention_bias=True, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, swiglu_limit=7.0, rms_norm_eps=1e-5,
        rope_theta=150000, rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                                         "truncate": False},
        max_position_embeddings=131072, **_TOKENS,
    ), experts=MXFP4),
}
# fmt: on
NAMES = (*SHAPES, PADDED)


def _shape(name: str) -> Shape:
    if name not in SHAPES:
        raise UserError(f"unknown shape {name!r}: choose one of {', '.join(NAMES)}")
    return SHAPES[name]


def shape_config(name: str, layers: int | None = None) -> dict:
    """The named shape's config.json as written (before quantization), with its first `layers` layers
    when given (the real count otherwise)."""
    config = copy.deepcopy(_shape(name).config)
    full = config["num_hidden_layers"]
    if layers is None or layers == full:
        return config
    dense = config.get("first_k_dense_replace", 0)
    if not dense < layers <= full:
        raise UserError(f"{name} takes {dense + 1} to {full} layers (its first MoE layer is layer {dense})")
    config["num_hidden_layers"] = layers
    if "layer_types" in config:
        config["layer_types"] = config["layer_types"][:layers]
    return config


class _Recipe:
    """A named shape as mlx-lm would hold it converted: the model's tensors, which are quantized how, and
    how each is drawn. mlx-lm's model is only built lazily (its own initial weights are never computed):
    what is written is drawn job by job (`jobs`, `draw`, `finish`)."""

    def __init__(self, name: str, layers: int | None):
        self.name, self.shape = name, _shape(name)
        config = shape_config(name, layers)
        model_class, args_class = model_classes(config)
        model = model_class(args_class.from_dict(config))
        self.floats = dict(tree_flatten(model.parameters()))  # unquantized shapes, never evaluated
        modules = dict(model.named_modules())
        self.norms = {p for p, m in modules.items() if "norm" in type(m).__name__.lower()}
        own = getattr(model, "quant_predicate", None)
        experts = self.shape.experts

        def predicate(path, module):
            if experts and module.weight.ndim == 3:  # stacked experts (SwitchLinear)
                return dict(experts)
            return own(path, module) if own else True

        quant = RECIPE["quantization"]
        with open(os.devnull, "w") as quiet, redirect_stdout(quiet):  # it prints bits per weight
            model, self.config = quantize_model(
                model,
                config,
                quant["group_size"],
                quant["bits"],
                mode=quant["mode"],
                quant_predicate=predicate,
            )
        self.quantized = {
            p: (m.group_size, m.bits, m.mode) for p, m in model.named_modules() if hasattr(m, "group_size")
        }
        # tree_flatten without a destination gives a list of (name, value) pairs; its type also admits a dict
        parameters = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
        self.tensors = [
            Tensor(n, tuple(v.shape), safetensors_dtype(v), self._pieces(n, v)) for n, v in parameters
        ]

    def _pieces(self, name: str, value: mx.array) -> int:
        """Experts of a stacked expert module's arrays (drawn and written one expert at a time), else 1."""
        module = name.rsplit(".", 1)[0]
        stacked = module in self.quantized and self.floats[f"{module}.weight"].ndim == 3
        return value.shape[0] if stacked else 1

    def _draw(self, name: str, shape: tuple[int, ...], expert: int | None) -> np.ndarray:
        module = name.rsplit(".", 1)[0]
        if module in self.norms:
            return np.full(shape, RECIPE["norm_weight"] if name.endswith(".weight") else 0.0, np.float32)
        if len(shape) == 1:
            return np.zeros(shape, np.float32)
        std = RECIPE["router_std"] if module.rsplit(".", 1)[-1] in ROUTER_NAMES else RECIPE["std"]
        stream = [RECIPE["seed"], zlib.crc32(name.encode()), 0 if expert is None else expert + 1]
        values = np.random.default_rng(stream).standard_normal(shape, dtype=np.float32)
        values *= std
        return values

    def jobs(self):
        """(tensor name, piece or None) of every draw, in writing order: one per weight (per expert of a
        stacked weight); the scales and biases of a quantized weight come with it."""
        for t in self.tensors:
            module, array = t.name.rsplit(".", 1)
            if module in self.quantized and array in ("scales", "biases"):
                continue
            for piece in range(t.pieces) if t.pieces > 1 else (None,):
                yield t.name, piece

    def draw(self, job) -> tuple:
        """The float32 values of one job (runs on a worker thread: numpy only)."""
        name, piece = job
        shape = self.floats[name].shape
        return job, self._draw(name, tuple(shape if piece is None else shape[1:]), piece)

    def finish(self, job, values: np.ndarray) -> dict[str, np.ndarray]:
        """The stored arrays of a drawn job, by tensor name: quantized if its module is, else bfloat16."""
        name, _ = job
        module = name.rsplit(".", 1)[0]
        weight = mx.array(values).astype(mx.bfloat16)
        if module not in self.quantized or not name.endswith(".weight"):
            return {name: raw(weight)}
        group_size, bits, mode = self.quantized[module]
        parts: tuple[mx.array, ...]
        if mode == "mxfp4":
            parts = mxfp4_quantize(weight.astype(mx.float32))
        else:
            parts = mx.quantize(weight, group_size=group_size, bits=bits, mode=mode)
        return {
            f"{module}.{k}": raw(v) for k, v in zip(("weight", "scales", "biases"), parts) if v is not None
        }


# E2M1 values lie at 0, 0.5, 1, 1.5, 2, 3, 4, 6: the midpoints between neighbours, and whether a value
# exactly there rounds down (to the neighbour with an even code) or up
_E2M1_MIDPOINTS = (
    (0.25, "down"),
    (0.75, "up"),
    (1.25, "down"),
    (1.75, "up"),
    (2.5, "down"),
    (3.5, "up"),
    (5.0, "down"),
)


def mxfp4_quantize(w: mx.array) -> tuple[mx.array, mx.array]:
    """MXFP4 as the OCP Microscaling spec defines it, in mlx-lm's layout: per group of 32 along the last
    axis of float32 `w`, a shared scale 2^(floor(log2 max|w|) - 2) stored as E8M0 (uint8, exponent + 127)
    and each element rounded to the nearest E2M1 value (ties to even, beyond 6 saturating to 6), 8 codes
    per uint32, the first in the low bits. `mx.dequantize(..., mode="mxfp4")` reads it back. Written out
    because mx.quantize's mxfp4 on the CPU is a generic fallback (an argmin over a 16-entry table per
    element): 1.7 s for one gpt-oss expert projection, an hour for the model."""
    groups = w.reshape(-1, 32)
    amax = mx.max(mx.abs(groups), axis=-1, keepdims=True)
    exponent = (amax.view(mx.int32) >> 23) - 127 - 2  # floor(log2) of a normal float32, less E2M1's emax
    exponent = mx.clip(mx.where(amax > 0, exponent, -127), -127, 127)
    magnitude = mx.abs(groups) * ((127 - exponent) << 23).view(mx.float32)  # divided by 2^exponent, exactly
    # an array: 0 plus the first of the (non-empty) midpoints' arrays
    code = cast(
        mx.array,
        sum(
            ((magnitude > edge) if tie == "down" else (magnitude >= edge)).astype(mx.uint32)
            for edge, tie in _E2M1_MIDPOINTS
        ),
    )
    code = code | ((groups.view(mx.uint32) >> 31) << 3)  # the sign bit
    packed = mx.sum(code.reshape(-1, 8) << (mx.arange(8, dtype=mx.uint32) * 4), axis=-1)
    scales = (exponent + 127).astype(mx.uint8)
    return packed.reshape(*w.shape[:-1], -1), scales.reshape(*w.shape[:-1], -1)


def default_dest(workdir, name: str, layers: int | None = None) -> Path:
    """Where `od-moe bench --shape` keeps a shape in `workdir`."""
    return Path(workdir) / (name if layers is None else f"{name}-{layers}-layers")


def build_shape(
    name: str, dest, layers: int | None = None, shard_bytes: int = SHARD_BYTES, threads: int = 2
) -> Path:
    """Write the named shape's checkpoint into `dest` (its first `layers` layers if given) and return
    `dest`; a complete checkpoint of the same shape, layers and recipe already there is kept as it is.
    `threads` draw weights while the main thread quantizes and writes (host memory: about `threads` + 2
    experts' float32 draws)."""
    dest = Path(dest)
    if name == PADDED:
        _no_layers(layers)
        return pad_bundled(dest)
    recipe = _Recipe(name, layers)
    layers = recipe.config["num_hidden_layers"]
    record = {"shape": name, "source": recipe.shape.source, "layers": layers, "recipe": RECIPE}

    def produce():
        with ThreadPoolExecutor(threads) as pool:
            ahead = deque()
            for job in recipe.jobs():
                ahead.append(pool.submit(recipe.draw, job))
                if len(ahead) > threads:  # a few draws ahead, never the whole model
                    done, values = ahead.popleft().result()
                    yield done[1], recipe.finish(done, values)
            while ahead:
                done, values = ahead.popleft().result()
                yield done[1], recipe.finish(done, values)

    return write_checkpoint(
        dest, recipe.tensors, produce, recipe.config, record, f"building {name}", shard_bytes
    )


def checkpoint_nbytes(name: str, layers: int | None = None) -> int:
    """Bytes of the named shape's tensors as written (headers aside), from the shapes alone."""
    return sum(t.nbytes for t in _tensors(name, layers))


def expert_nbytes(name: str) -> int:
    """Bytes of one expert as written (weights, scales and biases of its projections, its biases), from
    the shapes alone."""
    stacked = [t for t in _tensors(name, None) if t.pieces > 1]
    first = stacked[0].name.split(".")[2]  # the first MoE layer's index
    return sum(t.nbytes // t.pieces for t in stacked if t.name.split(".")[2] == first)


def describe(name: str, layers: int | None = None) -> dict:
    """What the named shape's checkpoint holds, from the shapes alone: tensor bytes, layers, experts per
    MoE layer and their bytes each, experts per token, and where the configuration comes from."""
    if name == PADDED:
        config, source = json.loads((DEFAULT_MODEL / "config.json").read_text()), "the bundled model, padded"
    else:
        config, source = shape_config(name, layers), _shape(name).source
    experts = next(config[k] for k in ("num_experts", "num_local_experts", "n_routed_experts") if k in config)
    return {
        "bytes": checkpoint_nbytes(name, layers),
        "layers": config["num_hidden_layers"],
        "experts": experts,
        "expert_bytes": expert_nbytes(name),
        "top_k": config["num_experts_per_tok"],
        "source": source,
    }


def _no_layers(layers: int | None):
    if layers is not None:
        raise UserError(f"{PADDED} keeps the bundled model's 8 layers: leave out the layer count")


def _tensors(name: str, layers: int | None) -> list[Tensor]:
    if name == PADDED:
        _no_layers(layers)
        return Padding(DEFAULT_MODEL).tensors
    return _Recipe(name, layers).tensors
