"""The bundled trained model carried to a real model's widths: `od-moe bench --shape bundled-real-widths`.

Hidden 192 becomes Qwen3-30B-A3B's 2048 and experts 64 wide become 768 wide, with zeros, so the copy
computes what the bundled model computes and routes as it routes (up to one rounding, `Padding`) while
its kernels see real widths: on CUDA a hidden size that is no multiple of 128 sends the down projection
to a slow kernel (DESIGN.md, "On a GPU"). Only Qwen3-MoE checkpoints in MLX layout, affine-quantized
(the bundled one), are supported.
`pad_predictor` carries the bundled shadow network along, so that the predictor's rows run on the copy.
Not here: checkpoints drawn from a recipe (`real_shapes.py`), wider experts at the bundled hidden size
(`widen.py`).
"""

import json
import math
import zlib
from dataclasses import replace
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..errors import UserError
from ..predictor.model import ShadowPredictor
from ..storage.model_files import DEFAULT_MODEL
from .shards import Tensor, raw, safetensors_dtype, write_checkpoint

PADDED = "bundled-real-widths"
HIDDEN, EXPERT_WIDTH = 2048, 768  # Qwen3-30B-A3B's


class Padding:
    """The bundled model carried to other widths: per tensor, its new shape and values.

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

    def __init__(self, source: Path, hidden: int = HIDDEN, width: int = EXPERT_WIDTH):
        self.source = Path(source)
        self.config = json.loads((self.source / "config.json").read_text())
        self.old = (self.config["hidden_size"], self.config["moe_intermediate_size"])
        self.new = (hidden, width)
        if hidden % 64 or width % self.old[1] or hidden < self.old[0]:
            raise UserError(
                f"pad to a hidden size that is a multiple of 64 (>= {self.old[0]}) and an expert width that "
                f"is a multiple of {self.old[1]}"
            )
        self.arrays: dict[str, mx.array] = {}
        for file in sorted(self.source.glob("model*.safetensors")):
            # a .safetensors file without return_metadata loads as a dict; mx.load's type covers every format
            self.arrays.update(cast(dict[str, mx.array], mx.load(str(file))))
        experts = self.config["num_experts"]
        self.tensors = [
            Tensor(n, self._shape(n, a.shape), safetensors_dtype(a), experts if ".switch_mlp." in n else 1)
            for n, a in sorted(self.arrays.items())
        ]

    def _plan(self, name: str):
        """(input side (old, new) or None, output rows (old, new, repeated) or None) of a tensor."""
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

    def _shape(self, name: str, shape) -> tuple[int, ...]:
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
            return raw(mx.concatenate([scaled, mx.zeros(self.new[0] - self.old[0])]).astype(array.dtype))
        values, (cols, rows) = raw(array), self._plan(name)
        shape = self._shape(name, values.shape)
        if cols:
            values = _zero_pad(values, -1, shape[-1])
        if rows and rows[2]:
            values = np.tile(values, [1] * (values.ndim - 2) + [shape[-2] // values.shape[-2], 1])
        elif rows:
            values = _zero_pad(values, -2, shape[-2])
        return values


def _zero_pad(array: np.ndarray, axis: int, size: int) -> np.ndarray:
    widths = [(0, 0)] * array.ndim
    widths[axis] = (0, size - array.shape[axis])
    return np.pad(array, widths)


def pad_bundled(dest, source=DEFAULT_MODEL, hidden: int = HIDDEN, width: int = EXPERT_WIDTH) -> Path:
    """Write the bundled model (or the Qwen3-MoE checkpoint at `source`) carried to hidden 2048 and experts
    768 wide (or `hidden`, `width`) into `dest`, computing what it computes and routing as it routes up to
    the rounding of its rescaled norm weights (`Padding`: exact at hidden 3072); return `dest`. A complete
    copy already there is kept."""
    source = Path(source)
    padding = Padding(source, hidden, width)
    digest = zlib.crc32(b"".join(f.read_bytes() for f in sorted(source.glob("model*.safetensors"))))
    (old, _), (new, width) = padding.old, padding.new
    record = {"shape": PADDED, "version": 2, "source": f"{digest:08x}", "hidden": new, "expert_width": width}
    config = {**padding.config, "hidden_size": new, "moe_intermediate_size": width}
    config["rms_norm_eps"] = padding.config["rms_norm_eps"] * old / new
    produce = lambda: ((None, {t.name: padding.padded(t.name)}) for t in padding.tensors)
    return write_checkpoint(
        dest, padding.tensors, produce, config, record, f"padding to hidden {new}", source=source
    )


def pad_predictor(predictor: ShadowPredictor, hidden: int = HIDDEN) -> ShadowPredictor:
    """`predictor` (the bundled model's shadow network) for its copy at hidden size `hidden` (`pad_bundled`):
    zero weights on the extra hidden channels, which stay 0 in the copy, so that on the copy's hidden states
    it gives what it gives on the bundled model's (its inputs, the hidden state and router logits, are the
    same up to the copy's rounding). Its identity stays the bundled model's: `retarget` it."""
    c = predictor.config
    if hidden < c.hidden_size:
        raise UserError(f"pad the predictor to a hidden size of at least {c.hidden_size}, got {hidden}")
    padded = ShadowPredictor(replace(c, hidden_size=hidden))
    weights = dict(tree_flatten(predictor.parameters()))
    extra = hidden - c.hidden_size
    for name, value in list(weights.items()):
        if name.startswith("trunks.") and name.endswith(".weight"):  # (rank, hidden + experts)
            zeros = mx.zeros((value.shape[0], extra), value.dtype)
            weights[name] = mx.concatenate([value[:, : c.hidden_size], zeros, value[:, c.hidden_size :]], 1)
        elif name == "next_use.proj":  # (layers, hidden, experts)
            weights[name] = mx.concatenate([value, mx.zeros((value.shape[0], extra, value.shape[2]))], 1)
    padded.update(tree_unflatten(list(weights.items())))
    mx.eval(padded.parameters())
    return padded
