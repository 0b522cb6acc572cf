"""The mapped stack of two-tier mode: every expert of one MoE layer in host memory, as MLX arrays the GPU
reads in place.

`read_stack` reads a layer's experts from the expert store once, with the same reads (and bytes) the
per-layer path makes, converts them to the model's in-memory dtypes as `LayerCache` does (float32 scales on
the CPU backend), adds C rows after the last expert (the layer's device slots: one array, so each lane is
computed once, by one `gather_qmm`, whichever tier holds its expert), writing them into the arrays' own
host memory, and asks the backend to keep its experts in host memory for the device and its slot rows in
device memory (`backend.map_for_device`). On the CPU and Metal that is plain memory and the same code runs.
Not here: the forward math, filling the slots or admission (`runtime.py`).
"""

import mlx.core as mx
import numpy as np

from .. import backend, cuda
from ..layout import BlockLayout, ExpertRows
from ..slot_arrays import SAME_BYTES, host_bits
from ..store import ExpertStore

READ_BATCH_BYTES = 64 * 2**20  # staging for one read round of a layer's experts


def _uint(size: int) -> np.dtype:
    return np.dtype(f"uint{8 * size}")


def _target_bytes(raw: np.ndarray, disk_dtype: str, target: mx.Dtype) -> np.ndarray:
    """`raw` (disk bytes, rows of experts) as `target`'s in-memory bytes, viewed as unsigned integers."""
    bits = host_bits(raw, disk_dtype, target)
    if bits is None:  # a cast numpy cannot make exactly: MLX makes it, on the CPU
        source = mx.array(raw).view(SAME_BYTES[disk_dtype])
        cast = source.astype(target, stream=mx.cpu)
        bits = np.array(cast.view(_mx_uint(target.size)))
    return np.ascontiguousarray(bits).view(_uint(target.size))


def _mx_uint(size: int) -> mx.Dtype:
    return {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}[size]


def read_stack(
    store: ExpertStore,
    layout: BlockLayout,
    targets: dict[tuple[str, str], mx.Dtype],
    slots: int,
    progress=None,
) -> dict[tuple[str, str], mx.array]:
    """Per part (`(proj, name)`), an `(E + slots, ...)` array: every expert of `layout` in `targets`' dtype
    (rows 0..E-1, in host memory mapped for the device), then `slots` rows of zeros (the slots, in device
    memory). The bytes read go straight into the arrays' memory (`_host_stack`); where MLX gives no
    writable view of it, into numpy arrays copied into MLX once, then checked (a RuntimeError where an
    array does not hold the bytes read). `progress.update(bytes)` after each read round."""
    E = layout.num_experts
    rows = {
        (p.proj, p.name): _host_stack(E + slots, p.shape, targets[(p.proj, p.name)].size)
        for p in layout.parts
    }
    batch = max(1, min(E, READ_BATCH_BYTES // max(1, layout.expert_nbytes)))
    staging = ExpertRows(layout, batch)
    for start in range(0, E, batch):
        ids = np.arange(start, min(E, start + batch))
        raw = store.read(layout, ids, staging)
        for p in layout.parts:
            key = (p.proj, p.name)
            rows[key][1][start : start + len(ids)] = _target_bytes(raw[key], p.dtype, targets[key])
        if progress is not None:
            progress.update(len(ids) * layout.expert_nbytes)
    stacks = {}
    for key, (array, written) in rows.items():
        if array is None:
            array = _copied_into_mlx(written, f"{layout.module_path}.{key[0]}.{key[1]}")
        backend.map_for_device(array, array.nbytes // (E + slots) * slots)
        target = targets[key]
        stacks[key] = array if array.dtype == target else array.view(target)
    mx.eval(list(stacks.values()))
    return stacks


def _host_stack(rows: int, shape: tuple, size: int) -> tuple[mx.array | None, np.ndarray]:
    """An evaluated MLX array of zeros (`rows` x `shape` unsigned integers of `size` bytes) made on the CPU
    stream, so in host memory on every backend (managed memory on CUDA), and a writable numpy view of it;
    where MLX gives no such view, (None, a numpy array of zeros). Writing through the view saves the copy
    `mx.array` makes of a numpy array: half of a two-tier load's time on the CPU (docs/GPU.md, "Time to
    first token")."""
    array = mx.zeros((rows, *shape), dtype=_mx_uint(size), stream=mx.cpu)
    view = cuda.writable_view(array)
    return (array, view) if view is not None else (None, np.zeros((rows, *shape), dtype=_uint(size)))


def _copied_into_mlx(rows: np.ndarray, name: str) -> mx.array:
    array = mx.array(rows)
    mx.eval(array)
    seen = cuda.numpy_view(array)
    if seen is None or not np.array_equal(seen, rows):
        raise RuntimeError(f"{name}: the mapped stack differs from the store")
    return array


def release_stack(stack: dict[tuple[str, str], mx.array]):
    """Take back the device advice of a stack `read_stack` made (before letting it go)."""
    for array in stack.values():
        backend.unmap(array)


def follow_moves(stack: dict, addresses: dict, E: int) -> int:
    """After a fill: a stack MLX copied instead of writing it in place lost its device advice (its slots
    would sit wherever the copy put them), and the buffer it left keeps it: move the advice, note the new
    address in `addresses`, and return how many moved (want 0)."""
    moved = 0
    for key, address in stack_addresses(stack).items():
        if address != addresses[key]:
            moved += 1
            backend.unmap_at(addresses[key])  # MLX may hand that buffer to any array
            rows = stack[key]
            backend.map_for_device(rows, rows.nbytes // rows.shape[0] * (rows.shape[0] - E))
            addresses[key] = address
    return moved


def stack_addresses(stack: dict[tuple[str, str], mx.array]) -> dict[tuple[str, str], int]:
    return {key: cuda.address_of(rows) for key, rows in stack.items()}


def release_stacks(stacks: list[dict]):
    """Take back the mapping advice of every stack (the runtime is collected)."""
    for stack in stacks:
        release_stack(stack)
