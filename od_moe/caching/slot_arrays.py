"""The stacked slot arrays of one MoE layer, and writing expert bytes into their rows.

The `(C, ...)` arrays live inside the layer's own mlx-lm switch projections (`gate_proj.weight` and
friends), replacing the `(E, ...)` originals, so mlx-lm's `SwitchGLU` computes on them unchanged once expert
ids are remapped to slots. Bytes read from disk go into a slot's rows straight from host memory where the
backend allows (numpy views of host memory on the CPU and Metal, the CUDA runtime's copies:
`backend.row_writer`), else with MLX writes that the layer's computation evaluates. A layer whose routed
experts do not fit computes once on the slots and a scratch stack (`with_scratch`). Not here: which expert
sits in which slot, or eviction (`caching/layer_cache.py`); reading the bytes (`storage/store.py`).
"""

from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..memory import backend, cuda
from ..storage.layout import BlockLayout, ExpertPart, flat_rows

# safetensors dtypes whose bytes are already the in-memory representation of an MLX dtype
SAME_BYTES = {
    "F64": mx.float64,
    "F32": mx.float32,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "U16": mx.uint16,
    "I16": mx.int16,
    "U8": mx.uint8,
    "I8": mx.int8,
    "U64": mx.uint64,
    "I64": mx.int64,
    "BOOL": mx.bool_,
}


def host_bits(raw: np.ndarray, disk_dtype: str, target: mx.Dtype):
    """`raw` converted to `target`'s in-memory bytes with numpy, where that is exact; else None."""
    if SAME_BYTES.get(disk_dtype) == target:
        return raw
    if target == mx.float32 and disk_dtype == "BF16":
        return raw.astype(np.uint32) << 16  # bfloat16 is the high half of a float32
    if target == mx.float32 and disk_dtype == "F16":
        return raw.astype(np.float32)
    return None


class SlotArrays:
    """The slots' arrays of one MoE layer, by part, inside its switch projections."""

    def __init__(self, layer: int, projections: Mapping[str, nn.Module], layout: BlockLayout, capacity: int):
        self.layer, self.layout, self.projections = layer, layout, projections
        self.targets = {}  # (proj, part) -> the in-memory dtype the model computes with
        for part in layout.parts:
            module = projections[part.proj]
            original = module[part.name]
            if tuple(original.shape[1:]) != tuple(part.shape):
                raise ValueError(
                    f"{layout.module_path}.{part.proj}.{part.name}: model expects {original.shape[1:]}, "
                    f"file has {part.shape}"
                )
            self.targets[(part.proj, part.name)] = original.dtype
            module[part.name] = mx.zeros((capacity, *part.shape), dtype=original.dtype)
        mx.eval([projections[p.proj][p.name] for p in layout.parts])
        self.host_writes = True  # False once the backend or a dtype rules out writes from host bytes
        # (proj, part) -> (stacked array, what writes its rows from host bytes)
        self._writers: dict[tuple[str, str], tuple[mx.array, np.ndarray | cuda.RowWriter | None]] = {}

    def use_host_writes(self, on: bool):
        """Write installs from host bytes where the backend allows (on), or always with MLX writes."""
        self.host_writes = on

    @property
    def slot_nbytes(self) -> int:
        """Bytes one slot holds in memory (all parts, in their in-memory dtypes)."""
        return sum(int(np.prod(p.shape)) * self.targets[(p.proj, p.name)].size for p in self.layout.parts)

    def write(self, slots: np.ndarray, raw, arrays=None, synchronize: bool = True):
        """Put experts' bytes (`raw`: per part, row i for `slots[i]`) into the slots: from host memory where
        the backend allows, else with MLX writes (`arrays`: the reader's flat MLX arrays of the rows, where
        it made them). `synchronize=False`: nothing computing reads these slots, so host writes need not
        wait for the device. The staging buffers may be reused as soon as this returns."""
        if not (self.host_writes and self._write_host(slots, raw, synchronize)):
            self.host_writes = False
            self._write_mlx(slots, raw, arrays)

    def _row_writer(self, part: ExpertPart) -> np.ndarray | cuda.RowWriter | None:
        """What writes a part's stacked array from host bytes (`backend.row_writer`), kept while that array
        stays the module's."""
        array = self.projections[part.proj][part.name]
        kept = self._writers.get((part.proj, part.name))
        if kept is None or kept[0] is not array:
            kept = self._writers[(part.proj, part.name)] = (array, backend.row_writer(array))
        return kept[1]

    def _write_host(self, slots: np.ndarray, raw, synchronize: bool = True) -> bool:
        """Copy expert bytes into the slots' memory with no MLX operation (numpy views of host memory, or
        the CUDA runtime's copies); False where that is impossible, or failed (nothing half-written stays:
        the caller writes every slot again through MLX)."""
        writes = []
        for part in self.layout.parts:
            key = (part.proj, part.name)
            writer = self._row_writer(part)
            rows = [host_bits(raw[key][j], part.dtype, self.targets[key]) for j in range(len(slots))]
            if writer is None or any(r is None for r in rows):
                return False
            writes.append((writer, [np.ascontiguousarray(r).view(writer.dtype) for r in rows]))
        if synchronize:
            mx.synchronize()  # nothing still computing may read the rows about to change
        try:
            for writer, rows in writes:
                for slot, row in zip(slots.tolist(), rows):
                    writer[slot] = row
        except cuda.CopyError:  # copies went off since (a failed install): nothing of this one was queued
            return False
        first = self.layout.parts[0]
        return backend.rows_written(
            (self.projections[first.proj][first.name], int(slots[0]), writes[0][1][0])
        )

    def _write_mlx(self, slots: np.ndarray, raw, arrays=None):
        """Put expert bytes into the slots with MLX operations (backends without host-visible memory): one
        (experts, bytes) array for the whole install (stacked from the reader's flat arrays where it made
        them all, else one host-to-device copy of the rows), then per part a view of its columns written
        with one slice update (one expert) or one scatter. No host sync: the computation that reads the
        slots evaluates them. The array holds its own copy of the bytes, so staging may be reused at
        once."""
        n = len(slots)
        if arrays is not None and all(a is not None for a in arrays):
            flat = arrays[0][None] if n == 1 else mx.stack(arrays)
        else:
            # not advised for the device (`backend.stage_for_device`): MLX recycles its buffer
            flat = mx.array(flat_rows(self.layout, raw, n))
        index = int(slots[0]) if n == 1 else mx.array(slots.astype(np.int32))
        for (proj, name), rows in self._part_rows(flat, n).items():
            stacked = self.projections[proj][name]
            stacked[index] = rows[0] if n == 1 else rows  # in place: the module holds this same array

    def _part_rows(self, flat: mx.array, n: int) -> dict[tuple[str, str], mx.array]:
        """Per part, the rows of `n` experts' flat bytes (`flat_rows` order) as arrays shaped and typed as
        the slots are (lazy views and casts of `flat`)."""
        out, offset = {}, 0
        for part in self.layout.parts:
            key = (part.proj, part.name)
            rows = flat[:, offset : offset + part.nbytes].view(SAME_BYTES[part.dtype]).reshape(n, *part.shape)
            out[key] = rows if rows.dtype == self.targets[key] else rows.astype(self.targets[key])
            offset += part.nbytes
        return out

    def scratch_rows(self, raw, count: int) -> dict[tuple[str, str], mx.array]:
        """Per part, `count` experts' bytes as read (by part) as rows shaped and typed as the slots' (the
        bytes are copied: the read's buffers may be reused at once)."""
        return self._part_rows(mx.array(flat_rows(self.layout, raw, count)), count)

    def with_scratch(self, chunks: list[dict]) -> dict[tuple[str, str], mx.array]:
        """Per part, the slots followed by the `scratch_rows` of `chunks`: the stacks a layer computes on
        once when its routed experts do not all fit in the slots (row C + j is the j-th scratch expert).
        Lazy; the slots themselves stay as they are."""
        return {
            (p, n): mx.concatenate([self.projections[p][n], *(c[(p, n)] for c in chunks)])
            for p, n in chunks[0]
        }

    def stacked(self) -> dict[str, mx.array]:
        """The stacked slot arrays by `proj.part` name (for snapshots)."""
        return {f"{p.proj}.{p.name}": self.projections[p.proj][p.name] for p in self.layout.parts}

    def replace(self, arrays: dict[str, mx.array]):
        """Use `arrays` (by `proj.part` name, shaped and typed as `stacked()`) as the stacked arrays."""
        for name, array in arrays.items():
            proj, part = name.split(".", 1)
            current = self.projections[proj][part]
            if array is None or array.shape != current.shape or array.dtype != current.dtype:
                raise ValueError(
                    f"layer {self.layer} {name}: the cache holds {current.shape} {current.dtype}, not {array}"
                )
            self.projections[proj][part] = array
        if arrays:
            mx.eval(list(self.stacked().values()))
