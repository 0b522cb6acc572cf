"""A widened copy of a trained 4-bit MoE: same function and routing, experts as large as a big model's.

Every expert gets extra hidden units: gate/up rows are repeated, and the matching `down_proj` input
columns are whole quantization groups of zeros (packed 0, scale 0, bias 0 dequantize to exactly 0), so
the extra units add nothing to the output. Expert bytes grow by the widening factor; compute grows with
them. This gives I/O-bound benchmarks with real routing and no download. Only MLX-layout, affine-quantized
SwitchGLU checkpoints are supported (the embedded default is one).
"""

import json
import shutil
import struct
import tempfile
from pathlib import Path

import numpy as np

from ..progress import byte_progress
from ..storage.layout import RAW_NUMPY_DTYPES
from ..storage.store import ExpertStore

DEFAULT_WORKDIR = Path(tempfile.gettempdir()) / "od-moe-bench"  # where the benchmarks keep widened copies
EXPERT_PROJECTIONS = (".switch_mlp.gate_proj.", ".switch_mlp.up_proj.", ".switch_mlp.down_proj.")


def _widened(name: str, array: np.ndarray, factor: int) -> np.ndarray:
    if ".switch_mlp.gate_proj." in name or ".switch_mlp.up_proj." in name:
        return np.tile(array, (1, factor, 1))  # (E, I, in/pack) -> (E, I*f, in/pack): repeated hidden units
    if ".switch_mlp.down_proj." in name:
        zeros = np.zeros((*array.shape[:2], array.shape[2] * (factor - 1)), dtype=array.dtype)
        return np.concatenate([array, zeros], axis=2)  # extra input columns: zero weights, scales, biases
    return array


def widen_model(source, dest, factor: int) -> Path:
    """Write a copy of the model at `source` into `dest` with every expert `factor` times wider."""
    source, dest = Path(source), Path(dest)
    config = json.loads((source / "config.json").read_text())
    quant = config.get("quantization") or {}
    if factor < 1 or quant.get("mode", "affine") != "affine" or "moe_intermediate_size" not in config:
        raise ValueError(
            "widening needs an affine-quantized MLX checkpoint with moe_intermediate_size and a factor >= 1"
        )
    store = ExpertStore(source)
    done = dest / "config.json"
    if done.exists() and json.loads(done.read_text()).get("od_moe_widened") == {
        "source": store.weights_digest,
        "factor": factor,
    }:
        return dest
    dest.mkdir(parents=True, exist_ok=True)
    names = sorted(store.tensors)
    shapes: dict[str, list[int]] = {}
    header: dict[str, dict[str, object]] = {"__metadata__": {"format": "mlx"}}
    offset = 0
    for name in names:
        entry = store.tensors[name]
        shape = list(entry.shape)
        if any(p in name for p in EXPERT_PROJECTIONS):
            if ".down_proj." in name:
                shape[2] *= factor
            else:
                shape[1] *= factor
        nbytes = int(np.prod(shape)) * np.dtype(RAW_NUMPY_DTYPES[entry.dtype]).itemsize
        header[name] = {"dtype": entry.dtype, "shape": shape, "data_offsets": [offset, offset + nbytes]}
        shapes[name], offset = shape, offset + nbytes
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    with (
        open(dest / "model.safetensors", "wb") as out,
        byte_progress(f"widening x{factor}", offset) as bar,
    ):
        out.write(struct.pack("<Q", len(blob)))
        out.write(blob)
        for name in names:
            entry = store.tensors[name]
            raw: np.ndarray = np.fromfile(
                store.files[entry.file],
                dtype=RAW_NUMPY_DTYPES[entry.dtype],
                count=int(np.prod(entry.shape)),
                offset=entry.offset,
            ).reshape(entry.shape)
            array = _widened(name, raw, factor) if any(p in name for p in EXPERT_PROJECTIONS) else raw
            assert list(array.shape) == shapes[name]
            out.write(np.ascontiguousarray(array).tobytes())
            bar.update(array.nbytes)
    store.close()
    (dest / "model.safetensors.index.json").write_text(
        json.dumps(
            {"metadata": {"total_size": offset}, "weight_map": {n: "model.safetensors" for n in names}},
            indent=1,
        )
    )
    for extra in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (source / extra).exists():
            shutil.copy(source / extra, dest / extra)
    config["moe_intermediate_size"] = config["moe_intermediate_size"] * factor
    config["od_moe_widened"] = {"source": store.weights_digest, "factor": factor}
    done.write_text(json.dumps(config, indent=2))
    return dest
