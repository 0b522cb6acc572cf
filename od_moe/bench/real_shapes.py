"""Checkpoints with real MoE models' shapes, written from a pinned recipe: what `od-moe bench --shape` builds.

Each named shape is a real model's published Hugging Face `config.json` (values below, with the repository
they come from), so expert sizes, routing fan-out, attention and layer structure are the real ones; only
the vocabulary is the bundled tokenizer's 8192 tokens (its tokenizer is copied), and the weights are drawn
from `RECIPE`, so the routing statistics of a shape are the same whoever builds it. Models are mlx-lm's own
classes (`mlx_lm.utils._get_classes`), quantized the way `mlx_lm.convert -q` quantizes them (4-bit affine,
group 64, with each model's own `quant_predicate`: 8-bit routers), so `mlx_lm.load` and `od_moe.load` read
the result like any converted checkpoint. gpt-oss-20b keeps its experts in MXFP4 as shipped.

`bundled-real-widths` is different: the bundled trained model (hidden 192, experts 64 wide) carried to
Qwen3-30B-A3B's widths (hidden 2048, experts 768 wide) with zeros, so its function and routing are the
bundled model's up to the bfloat16 rounding of its rescaled norm weights (`pad_bundled`, `_Padding`).

Writing is bounded in memory: one weight (one expert of a stacked weight) is drawn, quantized and written
at a time, straight into safetensors shards at offsets known from the shapes, so a 17 GB checkpoint needs
about one expert's float32 draw of host memory. The recipe is recorded in `config.json`; a destination
that already holds a complete checkpoint of the same shape, layer count and recipe is not rebuilt.
Not here: running benchmarks on the checkpoints (`two_tier_grid.py`, `foundation.py`), widening experts of a
trained model in place (`widen.py`).
"""

import copy
import json
import math
import os
import shutil
import struct
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from contextlib import redirect_stdout
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten
from mlx_lm.utils import _get_classes, quantize_model

from ..errors import UserError
from ..model_files import DEFAULT_MODEL
from ..progress import byte_progress
from ..routing import ROUTER_NAMES

# Pinned: changing any value changes every checkpoint built from it (and so a recorded recipe no longer
# matches, and the next build rewrites the files). The draws are numpy's PCG64 normals, one stream per
# tensor (per expert for stacked experts) seeded from (seed, crc32 of the tensor's name, expert): a tensor's
# values do not depend on the order of writing, the shards or the number of layers. numpy rather than
# mx.random.normal: on this CPU numpy draws a 768 x 2048 matrix in 12 ms, MLX in 31 ms (its erfinv), and
# the draw is most of a build.
RECIPE = {
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
SHARD_BYTES = 5 * 10**9  # shards of about this size, as Hugging Face and mlx-lm split checkpoints
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")
VOCAB = 8192  # the bundled tokenizer's


@dataclass(frozen=True)
class Shape:
    """A real model's configuration: `config` is its Hugging Face config.json (the keys mlx-lm reads), with
    the bundled tokenizer's vocabulary; `experts` quantizes its experts otherwise than `RECIPE` does."""

    source: str  # the Hugging Face repository the values are from
    config: dict
    experts: dict | None = None
    notes: str = ""


# Values from each repository's config.json as published (cross-checked against parameter counts quoted
# by other projects: Qwen3-Next 79,674,391,296; gpt-oss-20b's expert tensors [32, 2880, 5760]); token ids
# are the bundled tokenizer's (bos = eos = 0), not the real ones, which lie outside its vocabulary.
_TOKENS = {"vocab_size": VOCAB, "bos_token_id": 0, "eos_token_id": 0}
SHAPES = {
    "qwen3-30b-a3b": Shape(
        "Qwen/Qwen3-30B-A3B",
        {
            "model_type": "qwen3_moe",
            "hidden_size": 2048,
            "intermediate_size": 6144,
            "moe_intermediate_size": 768,
            "num_hidden_layers": 48,
            "num_experts": 128,
            "num_experts_per_tok": 8,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "num_attention_heads": 32,
            "num_key_value_heads": 4,
            "head_dim": 128,
            "attention_bias": False,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 40960,
            "tie_word_embeddings": False,
            **_TOKENS,
        },
    ),
    "qwen3-next-80b-a3b": Shape(
        "Qwen/Qwen3-Next-80B-A3B-Instruct",
        {
            "model_type": "qwen3_next",
            "hidden_size": 2048,
            "intermediate_size": 5120,
            "moe_intermediate_size": 512,
            "shared_expert_intermediate_size": 512,
            "num_hidden_layers": 48,
            "num_experts": 512,
            "num_experts_per_tok": 10,
            "decoder_sparse_step": 1,
            "mlp_only_layers": [],
            "norm_topk_prob": True,
            "full_attention_interval": 4,  # every 4th layer full attention, the others gated delta net
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "head_dim": 256,
            "partial_rotary_factor": 0.25,
            "linear_num_key_heads": 16,
            "linear_num_value_heads": 32,
            "linear_key_head_dim": 128,
            "linear_value_head_dim": 128,
            "linear_conv_kernel_dim": 4,
            "attention_bias": False,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000000.0,
            "max_position_embeddings": 262144,
            "tie_word_embeddings": False,
            **_TOKENS,
        },
        notes="48 layers are about 44 GB at 4 bits: pass fewer layers for a small disk",
    ),
    "mixtral-8x7b": Shape(
        "mistralai/Mixtral-8x7B-v0.1",
        {
            "model_type": "mixtral",
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 32768,
            "tie_word_embeddings": False,
            **_TOKENS,
        },
    ),
    "deepseek-v2-lite": Shape(
        "deepseek-ai/DeepSeek-V2-Lite",
        {
            "model_type": "deepseek_v2",
            "hidden_size": 2048,
            "intermediate_size": 10944,  # the first, dense layer
            "moe_intermediate_size": 1408,
            "num_hidden_layers": 27,
            "first_k_dense_replace": 1,
            "moe_layer_freq": 1,
            "n_routed_experts": 64,
            "n_shared_experts": 2,
            "num_experts_per_tok": 6,
            "topk_method": "greedy",
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.0,
            "scoring_func": "softmax",
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "kv_lora_rank": 512,  # multi-head latent attention
            "q_lora_rank": None,
            "qk_nope_head_dim": 128,
            "qk_rope_head_dim": 64,
            "v_head_dim": 128,
            "attention_bias": False,
            "rms_norm_eps": 1e-6,
            "rope_theta": 10000,
            "rope_scaling": {
                "type": "yarn",
                "factor": 40,
                "original_max_position_embeddings": 4096,
                "beta_fast": 32,
                "beta_slow": 1,
                "mscale": 0.707,
                "mscale_all_dim": 0.707,
            },
            "max_position_embeddings": 163840,
            "tie_word_embeddings": False,
            **_TOKENS,
        },
    ),
    "gpt-oss-20b": Shape(
        "openai/gpt-oss-20b",
        {
            "model_type": "gpt_oss",
            "hidden_size": 2880,
            "intermediate_size": 2880,
            "num_hidden_layers": 24,
            "num_local_experts": 32,
            "num_experts_per_tok": 4,
            "num_attention_heads": 64,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "attention_bias": True,
            "sliding_window": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 12,
            "swiglu_limit": 7.0,
            "rms_norm_eps": 1e-5,
            "rope_theta": 150000,
            "rope_scaling": {
                "rope_type": "yarn",
                "factor": 32.0,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "original_max_position_embeddings": 4096,
                "truncate": False,
            },
            "max_position_embeddings": 131072,
            "tie_word_embeddings": False,
            **_TOKENS,
        },
        experts=MXFP4,
        notes="experts in MXFP4 as shipped (mlx-lm's mode 'mxfp4', group 32, 4 bits)",
    ),
}
PADDED = "bundled-real-widths"  # the bundled model padded to real widths (`pad_bundled`), not drawn
PADDED_HIDDEN, PADDED_EXPERT_WIDTH = 2048, 768  # Qwen3-30B-A3B's
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


@dataclass
class Tensor:
    """One tensor of a checkpoint being written: its safetensors entry, and the number of equal parts
    along its first axis it is produced in (its experts, for stacked expert weights)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype: "U32", "U8", "BF16"
    pieces: int = 1
    file: str = ""
    offset: int = 0  # of its data in `file`, from the start of the file
    nbytes: int = field(init=False)

    def __post_init__(self):
        self.nbytes = math.prod(self.shape) * {"U32": 4, "U8": 1, "BF16": 2}[self.dtype]


def _safetensors_dtype(array: mx.array) -> str:
    return {mx.uint32: "U32", mx.uint8: "U8"}.get(array.dtype, "BF16")  # every float is stored bfloat16


class _Recipe:
    """A named shape as mlx-lm would hold it converted: the model's tensors, which are quantized how, and
    how each is drawn. The model is built lazily: no weight is drawn or allocated until `pieces`."""

    def __init__(self, name: str, layers: int | None):
        self.name, self.shape = name, _shape(name)
        config = shape_config(name, layers)
        model_class, args_class = _get_classes(config)
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
        self.tensors = [
            Tensor(n, tuple(v.shape), _safetensors_dtype(v), self._pieces(n, v))
            for n, v in tree_flatten(model.parameters())
        ]

    def _pieces(self, name: str, value: mx.array) -> int:
        module = name.rsplit(".", 1)[0]
        stacked = self.floats.get(f"{module}.weight", value).ndim == 3 and module not in self.norms
        return value.shape[0] if stacked and module in self.quantized else 1

    def _draw(self, name: str, shape: tuple[int, ...], expert: int | None) -> np.ndarray:
        module = name.rsplit(".", 1)[0]
        if module in self.norms:
            return np.full(shape, RECIPE["norm_weight"] if name.endswith(".weight") else 0.0, np.float32)
        if len(shape) == 1:
            return np.zeros(shape, np.float32)
        std = RECIPE["router_std"] if module.rsplit(".", 1)[-1] in ROUTER_NAMES else RECIPE["std"]
        stream = [RECIPE["seed"], zlib.crc32(name.encode()), 0 if expert is None else expert + 1]
        return np.random.default_rng(stream).standard_normal(shape, dtype=np.float32) * np.float32(std)

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
            return {name: _raw(weight)}
        group_size, bits, mode = self.quantized[module]
        if mode == "mxfp4":
            parts = mxfp4_quantize(weight.astype(mx.float32))
        else:
            parts = mx.quantize(weight, group_size=group_size, bits=bits, mode=mode)
        return {
            f"{module}.{k}": _raw(v) for k, v in zip(("weight", "scales", "biases"), parts) if v is not None
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
    code = sum(
        ((magnitude > edge) if tie == "down" else (magnitude >= edge)).astype(mx.uint32)
        for edge, tie in _E2M1_MIDPOINTS
    )
    code = code | ((groups.view(mx.uint32) >> 31) << 3)  # the sign bit
    packed = mx.sum(code.reshape(-1, 8) << (mx.arange(8, dtype=mx.uint32) * 4), axis=-1)
    scales = (exponent + 127).astype(mx.uint8)
    return packed.reshape(*w.shape[:-1], -1), scales.reshape(*w.shape[:-1], -1)


def _raw(array: mx.array) -> np.ndarray:
    """The bytes of `array` as safetensors stores them (bfloat16 as its 16-bit pattern)."""
    return np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)


def _lay_out(tensors: list[Tensor], shard_bytes: int) -> dict[str, bytes]:
    """Place `tensors`, in order, into shards of about `shard_bytes` (a tensor is never split): sets each
    one's file and offset; returns each file's header (its length prefix included)."""
    groups, size = [[]], 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    headers = {}
    for i, group in enumerate(groups):
        file = (
            "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        )
        entries, at = {"__metadata__": {"format": "mlx"}}, 0
        for t in group:
            entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
            t.file, t.offset, at = file, at, at + t.nbytes
        blob = json.dumps(entries).encode()
        blob += b" " * (-len(blob) % 8)
        headers[file] = struct.pack("<Q", len(blob)) + blob
        for t in group:
            t.offset += len(headers[file])
    return headers


def _write(dest: Path, tensors: list[Tensor], headers: dict[str, bytes], produced, label: str):
    """Write the shards: `produced` yields (piece or None, {tensor name: array}) in any order; each array
    goes where its tensor (its piece of it) lies. Files are written beside their final names, then renamed."""
    by_name = {t.name: t for t in tensors}
    total = sum(len(h) for h in headers.values()) + sum(t.nbytes for t in tensors)
    fds = {}
    try:
        for file, header in headers.items():
            fds[file] = os.open(dest / f"{file}.part", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.pwrite(fds[file], header, 0)
        with byte_progress(label, total) as bar:
            bar.update(sum(len(h) for h in headers.values()))
            for piece, arrays in produced:
                for name, array in arrays.items():
                    t = by_name[name]
                    offset = t.offset + (0 if piece is None else piece * t.nbytes // t.pieces)
                    assert array.nbytes == (t.nbytes if piece is None else t.nbytes // t.pieces), name
                    os.pwrite(fds[t.file], np.ascontiguousarray(array).data, offset)
                    bar.update(array.nbytes)
    finally:
        for fd in fds.values():
            os.close(fd)
    for file in headers:
        os.replace(dest / f"{file}.part", dest / file)
    weight_map = {t.name: t.file for t in sorted(tensors, key=lambda t: t.name)}
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _clear(dest: Path):
    """Remove a previous checkpoint's files from `dest` (its shards may be named differently)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").unlink(missing_ok=True)  # first: a half-cleared folder is never taken as done
    for path in dest.glob("model*.safetensors*"):
        path.unlink()


def _done(dest: Path, record: dict, headers: dict[str, bytes], data_bytes: int) -> bool:
    """Whether `dest` holds a complete checkpoint written for `record` with these files."""
    config = dest / "config.json"
    if not config.is_file() or json.loads(config.read_text()).get("od_moe_real_shape") != record:
        return False
    sizes = [(dest / f).stat().st_size if (dest / f).is_file() else -1 for f in headers]
    return sum(sizes) == sum(len(h) for h in headers.values()) + data_bytes and min(sizes) >= 0


def _finish(dest: Path, config: dict, record: dict, source: Path = DEFAULT_MODEL):
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, dest / name)
    config = {**config, "od_moe_real_shape": record}
    (dest / "config.json").write_text(json.dumps(config, indent=1))  # last: it marks the folder complete


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
    headers = _lay_out(recipe.tensors, shard_bytes)
    record = {
        "shape": name,
        "source": recipe.shape.source,
        "layers": recipe.config["num_hidden_layers"],
        "recipe": RECIPE,
        "files": sorted(headers),
    }
    data_bytes = sum(t.nbytes for t in recipe.tensors)
    if _done(dest, record, headers, data_bytes):
        return dest
    _clear(dest)

    def produced():
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

    _write(dest, recipe.tensors, headers, produced(), f"building {name}")
    _finish(dest, recipe.config, record)
    return dest


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
        return _Padding(DEFAULT_MODEL).tensors
    return _Recipe(name, layers).tensors


class _Padding:
    """The bundled model carried to real widths (`pad_bundled`): per tensor, its new shape and values.

    Quantized weights are padded by whole groups of zeros (packed 0, scale 0, bias 0 dequantize to exactly
    0): zero input columns where they read the hidden state, zero output rows where they write it, so the
    extra hidden channels stay 0 through every layer. Expert gate/up rows are repeated (as `widen.py`
    does) and the matching down-projection columns are zero groups. Attention keeps its heads (4 x 48):
    only its projections' hidden side grows. Norms over the hidden state see the extra zeros, which divide
    their RMS by sqrt(new/old); their weights are multiplied by sqrt(old/new) to undo it, and the config's
    eps by old/new (so it weighs as much against the mean square; the attention's per-head norms, the only
    others, see q and k far larger than either eps).

    Exact only where sqrt(old/new) is a power of two: the rescaled norm weights are rounded to bfloat16.
    Measured on the bench's 3 prompts in float32 (28 positions, 8 layers): at hidden 2048 the logits move
    by up to 0.34 (the largest is 18.2), 2 of 224 (position, layer) top-8 sets differ, and 16 greedy
    tokens per prompt stay the same; at hidden 3072 (factor 1/4) the logits agree to 1e-5 and every
    top-8 set is the same.
    """

    def __init__(self, source: Path, hidden: int = PADDED_HIDDEN, width: int = PADDED_EXPERT_WIDTH):
        self.source = Path(source)
        self.config = json.loads((self.source / "config.json").read_text())
        self.old = (self.config["hidden_size"], self.config["moe_intermediate_size"])
        self.new = (hidden, width)
        if hidden % 64 or width % self.old[1] or hidden < self.old[0]:
            raise UserError(
                f"pad to a hidden size that is a multiple of 64 (>= {self.old[0]}) and an "
                f"expert width that is a multiple of {self.old[1]}"
            )
        self.arrays = {}
        for file in sorted(self.source.glob("model*.safetensors")):
            self.arrays.update(mx.load(str(file)))
        experts = self.config["num_experts"]
        self.tensors = [
            Tensor(
                n,
                self._shape(n, tuple(a.shape)),
                _safetensors_dtype(a),
                experts if ".switch_mlp." in n else 1,
            )
            for n, a in sorted(self.arrays.items())
        ]

    def _plan(self, name: str):
        """(input side (old, new) or None, output rows (old, new, repeat) or None) of a bundled tensor."""
        (h, w), (h2, w2) = self.old, self.new
        if ".switch_mlp.down_proj." in name:
            return (w, w2), (h, h2, False)
        if ".switch_mlp." in name:
            return (h, h2), (w, w2, True)
        if ".o_proj." in name:
            return None, (h, h2, False)
        if any(s in name for s in ("embed_tokens.", "_proj.", "mlp.gate.")):
            return (h, h2), None
        return None, None

    def _is_hidden_norm(self, name: str) -> bool:
        return name.endswith("layernorm.weight") or name == "model.norm.weight"

    def _shape(self, name: str, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self._is_hidden_norm(name):
            return (self.new[0],)
        cols, rows = self._plan(name)
        shape = list(shape)
        if cols:
            shape[-1] = shape[-1] * cols[1] // cols[0]
        if rows:
            shape[-2] = shape[-2] * rows[1] // rows[0]
        return tuple(shape)

    def padded(self, name: str) -> np.ndarray:
        """The tensor `name` as written, raw (bfloat16 as its 16-bit pattern)."""
        array = self.arrays[name]
        if self._is_hidden_norm(name):
            scaled = array.astype(mx.float32) * math.sqrt(self.old[0] / self.new[0])
            return _raw(mx.concatenate([scaled, mx.zeros(self.new[0] - self.old[0])]).astype(array.dtype))
        raw, (cols, rows) = _raw(array), self._plan(name)
        shape = self._shape(name, raw.shape)
        if cols:
            raw = _zero_pad(raw, -1, shape[-1])
        if rows and rows[2]:
            reps = [1] * raw.ndim
            reps[-2] = shape[-2] // raw.shape[-2]
            raw = np.tile(raw, reps)
        elif rows:
            raw = _zero_pad(raw, -2, shape[-2])
        return raw


def _zero_pad(array: np.ndarray, axis: int, size: int) -> np.ndarray:
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, size - array.shape[axis])
    return np.pad(array, widths)


def pad_bundled(
    dest, source=DEFAULT_MODEL, hidden: int = PADDED_HIDDEN, width: int = PADDED_EXPERT_WIDTH
) -> Path:
    """Write the bundled model (or the Qwen3-MoE checkpoint at `source`) carried to hidden 2048 and experts
    768 wide (or `hidden`, `width`) into `dest`, computing what it computes and routing as it routes up to
    the rounding of its rescaled norm weights (`_Padding`: exact at hidden 3072); return `dest`. A complete
    copy already there is kept."""
    dest, source = Path(dest), Path(source)
    padding = _Padding(source, hidden, width)
    digest = zlib.crc32(b"".join(f.read_bytes() for f in sorted(source.glob("model*.safetensors"))))
    record = {
        "shape": PADDED,
        "version": 2,  # 2: eps scaled with the hidden size
        "source": f"{digest:08x}",
        "hidden": padding.new[0],
        "expert_width": padding.new[1],
    }
    headers = _lay_out(padding.tensors, SHARD_BYTES)
    data_bytes = sum(t.nbytes for t in padding.tensors)
    if _done(dest, record, headers, data_bytes):
        return dest
    _clear(dest)
    produced = ((None, {t.name: padding.padded(t.name)}) for t in padding.tensors)
    _write(dest, padding.tensors, headers, produced, f"padding to hidden {padding.new[0]}")
    (old, _), (new, width) = padding.old, padding.new
    config = {**padding.config, "hidden_size": new, "moe_intermediate_size": width}
    config["rms_norm_eps"] = padding.config["rms_norm_eps"] * old / new
    _finish(dest, config, record, source)
    return dest
