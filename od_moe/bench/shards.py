"""Safetensors checkpoints written piece by piece, in bounded memory: how `real_shapes.py` and
`real_widths.py` write theirs.

The tensors are placed into shards (about `SHARD_BYTES` each, as Hugging Face and mlx-lm split
checkpoints) from their shapes alone, so every header is known before any value; each piece a producer
yields (a whole tensor, or one expert of a stacked weight) is then written at its offset, in any order, and
dropped. Host memory holds the pieces in flight, however large the checkpoint. config.json is written last
with a record of what was built: a later call for the same record finds the folder complete and keeps it.
Not here: what the tensors hold.
"""

import json
import math
import os
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..progress import byte_progress
from ..storage.model_files import DEFAULT_MODEL

SHARD_BYTES = 5 * 10**9
RECORD = "od_moe_real_shape"  # the config.json key holding what a folder was built from
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


@dataclass
class Tensor:
    """One tensor of a checkpoint being written: its safetensors entry, and the number of equal parts
    along its first axis it is produced in (its experts, for a stacked expert weight)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # safetensors dtype: "U32", "U8" or "BF16"
    pieces: int = 1
    nbytes: int = field(init=False)

    def __post_init__(self):
        self.nbytes = math.prod(self.shape) * {"U32": 4, "U8": 1, "BF16": 2}[self.dtype]


def safetensors_dtype(array: mx.array) -> str:
    """How `array` is stored: packed weights and MXFP4 scales as they are, every float as bfloat16."""
    return {mx.uint32: "U32", mx.uint8: "U8"}.get(array.dtype, "BF16")


def raw(array: mx.array) -> np.ndarray:
    """The bytes of `array` as safetensors stores them (bfloat16 as its 16-bit pattern)."""
    return np.array(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)


def write_checkpoint(
    dest: Path,
    tensors: list[Tensor],
    produce,
    config: dict,
    record: dict,
    label: str,
    shard_bytes: int = SHARD_BYTES,
    source: Path = DEFAULT_MODEL,
) -> Path:
    """Write `tensors` into shards in `dest` with their index, `config` (with `record` under `RECORD`)
    and the tokenizer files of `source`; return `dest`. `produce()` yields (piece or None, {tensor name:
    array}) until every tensor is whole. A folder already complete for `record` is kept as it is."""
    dest = Path(dest)
    headers, places = _lay_out(tensors, shard_bytes)
    record = {**record, "files": sorted(headers)}
    expected = sum(len(h) for h in headers.values()) + sum(t.nbytes for t in tensors)
    if _complete(dest, record, expected):
        return dest
    _clear(dest)
    _write(dest, tensors, headers, places, produce(), label)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, dest / name)
    (dest / "config.json").write_text(json.dumps({**config, RECORD: record}, indent=1))  # last: complete
    return dest


def _lay_out(tensors: list[Tensor], shard_bytes: int) -> tuple[dict[str, bytes], dict[str, tuple[str, int]]]:
    """Place `tensors`, in order, into shards of about `shard_bytes` (a tensor is never split): each file's
    header (its length prefix included), and each tensor's file and the offset of its data there (from the
    start of the file), by name."""
    groups: list[list[Tensor]] = [[]]
    size = 0
    for t in tensors:
        if groups[-1] and size + t.nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.nbytes
    headers, places = {}, {}
    for i, group in enumerate(groups):
        file = (
            "model.safetensors" if len(groups) == 1 else f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        )
        entries: dict[str, dict[str, object]] = {"__metadata__": {"format": "mlx"}}
        starts: dict[str, int] = {}
        at = 0
        for t in group:
            entries[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [at, at + t.nbytes]}
            starts[t.name], at = at, at + t.nbytes
        blob = json.dumps(entries).encode()
        blob += b" " * (-len(blob) % 8)
        headers[file] = struct.pack("<Q", len(blob)) + blob
        for t in group:
            places[t.name] = (file, len(headers[file]) + starts[t.name])
    return headers, places


def _write(dest: Path, tensors: list[Tensor], headers: dict[str, bytes], places: dict, produced, label: str):
    """Each produced array where its tensor (its piece of it) lies (`places`: by name, its file and offset);
    files are written beside their final names, then renamed; the index last."""
    by_name = {t.name: t for t in tensors}
    fds = {}
    try:
        for file, header in headers.items():
            fds[file] = os.open(dest / f"{file}.part", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.pwrite(fds[file], header, 0)
        with byte_progress(label, sum(t.nbytes for t in tensors)) as bar:
            for piece, arrays in produced:
                for name, array in arrays.items():
                    t, (file, offset) = by_name[name], places[name]
                    size = t.nbytes if piece is None else t.nbytes // t.pieces
                    assert array.nbytes == size, (name, array.shape, t.shape)
                    os.pwrite(fds[file], np.ascontiguousarray(array).data, offset + (piece or 0) * size)
                    bar.update(size)
    finally:
        for fd in fds.values():
            os.close(fd)
    for file in headers:
        os.replace(dest / f"{file}.part", dest / file)
    weight_map = {t.name: places[t.name][0] for t in sorted(tensors, key=lambda t: t.name)}
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": weight_map}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))


def _clear(dest: Path):
    """Remove a previous checkpoint's files from `dest` (its shards may be named otherwise)."""
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "config.json").unlink(missing_ok=True)  # first: a half-cleared folder is never taken as done
    for path in dest.glob("model*.safetensors*"):
        path.unlink()


def _complete(dest: Path, record: dict, expected_bytes: int) -> bool:
    """Whether `dest` holds a checkpoint written for `record` whose files have their full size."""
    config = dest / "config.json"
    if not config.is_file() or json.loads(config.read_text()).get(RECORD) != record:
        return False
    files = [dest / f for f in record["files"]]
    return all(f.is_file() for f in files) and sum(f.stat().st_size for f in files) == expected_bytes
