"""What an expert's bytes look like in memory: the arrays an expert owns (`ExpertPart`), where a MoE
block's experts are (`BlockLayout`), and the host memory reads land in (`ExpertRows`, one row per expert with
its arrays back to back, which is also what an install copies from and what `od-moe pack` writes).
Not here: finding the bytes in a model's files or reading them (`storage/store.py`).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np

# experts of one MoE layer by id: a list, or the numpy array the caches and policies keep them in
ExpertIds = Sequence[int] | np.ndarray

# safetensors dtype -> numpy dtype holding the raw bytes (bfloat16 is read as uint16 and viewed later)
RAW_NUMPY_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": np.uint16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}


@dataclass
class ExpertPart:
    """One array of every expert of a block (for example `gate_proj.scales`)."""

    proj: str
    name: str
    dtype: str  # safetensors dtype of the bytes on disk
    shape: tuple[int, ...]  # one expert's shape
    files: np.ndarray  # (E,) file index of each expert's slice
    offsets: np.ndarray  # (E,) absolute byte offset of each expert's slice

    @cached_property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * np.dtype(RAW_NUMPY_DTYPES[self.dtype]).itemsize


@dataclass
class BlockLayout:
    """Where one MoE block's experts are: one `ExpertPart` per array an expert owns."""

    module_path: str
    num_experts: int
    parts: list[ExpertPart]
    layout: str  # "mlx" or "hf"
    packed: tuple[int, int] | None = None  # (file index, offset of expert 0's row) in packed experts

    @cached_property
    def shape_key(self) -> tuple:
        """What staging buffers for this layout's experts depend on: equal keys can share buffers."""
        return tuple((p.proj, p.name, p.dtype, tuple(p.shape)) for p in self.parts)

    @cached_property
    def expert_nbytes(self) -> int:
        """Bytes one expert occupies on disk (weights + scales + biases)."""
        return sum(p.nbytes for p in self.parts)


class ExpertBytes(dict[tuple[str, str], np.ndarray]):
    """Experts read: per part (`(proj, name)`), their rows (row i = the i-th expert asked for); `flat`:
    the same bytes as one (experts, expert bytes) uint8 array, each row an expert's parts back to back
    in `layout.parts` order (staging holds them that way)."""

    def __init__(self, parts: dict[tuple[str, str], np.ndarray], flat: np.ndarray):
        super().__init__(parts)
        self.flat = flat

    def rows(self, start: int, stop: int) -> "ExpertBytes":
        return ExpertBytes({k: v[start:stop] for k, v in self.items()}, self.flat[start:stop])


def flat_rows(layout: BlockLayout, raw, count: int) -> np.ndarray:
    """The bytes of `count` experts as one (count, expert bytes) uint8 array, each row its expert's parts
    back to back in `layout.parts` order: what one host-to-device copy carries (`LayerCache.install`).
    Bytes read into staging are already laid out so (`ExpertBytes.flat`, no copy); per-expert rows
    gathered from several reads are copied."""
    made = getattr(raw, "flat", None)
    if made is not None and len(made) >= count:
        return made[:count]
    flat = np.empty((count, layout.expert_nbytes), dtype=np.uint8)
    start = 0
    for part in layout.parts:
        rows = raw[(part.proj, part.name)]
        for j in range(count):
            flat[j, start : start + part.nbytes] = np.asarray(rows[j]).reshape(-1).view(np.uint8)
        start += part.nbytes
    return flat


# Where in a page staging memory starts. Linux's allocators put numpy's large arrays 16 bytes into a page
# and MLX's CPU arrays 24 bytes in; copying between such addresses (the destination a few bytes past the
# source, modulo 4 KiB) ran at a tenth of the speed on a CPU, stores and loads aliasing, which slowed
# every CPU install of a large expert (docs/BENCHMARKS.md, "The cache alone (no prefetch)")
STAGING_PAGE_OFFSET = 2048


def host_rows(count: int, nbytes: int) -> np.ndarray:
    """A (count, nbytes) uint8 array for staging, starting `STAGING_PAGE_OFFSET` bytes into a page."""
    raw = np.empty(count * nbytes + 4096, dtype=np.uint8)
    start = (STAGING_PAGE_OFFSET - raw.ctypes.data) % 4096
    return raw[start : start + count * nbytes].reshape(count, nbytes)


class ExpertRows:
    """Preallocated host memory for a batch of up to `size` experts of one layout: one row per expert,
    its parts back to back (`flat`), and per part a view of its columns (`buffers`), which reads fill.
    A row is what a host-to-device copy of one expert carries, with no gathering of parts."""

    def __init__(self, layout: BlockLayout, size: int, flat: np.ndarray | None = None):
        """`flat`: memory of its own for the rows, (size, expert bytes) uint8 (an MLX array's, read into
        directly: `per_layer/mlx_rows.py`)."""
        self.size = size
        self.flat = host_rows(size, layout.expert_nbytes) if flat is None else flat
        self.buffers: dict[tuple[str, str], np.ndarray] = {}
        self.row_views: dict[tuple[str, str], list[memoryview]] = {}
        start = 0
        for p in layout.parts:
            columns = self.flat[:, start : start + p.nbytes]
            self.buffers[(p.proj, p.name)] = columns.view(RAW_NUMPY_DTYPES[p.dtype]).reshape(size, *p.shape)
            # what a read of one part of the expert in row j fills, made once: per read it cost more
            # than the `preadv` itself (the bundled model's 20 KB experts are 9 reads of 384 B-6 KB)
            self.row_views[(p.proj, p.name)] = [memoryview(row) for row in columns]
            start += p.nbytes
