"""The mapped stack of two-tier mode: every expert of one MoE layer in host memory, as MLX arrays the GPU
reads in place.

`read_stacks` reads each layer's experts from the expert store once, with the same reads (and bytes) the
per-layer path makes, converts them to the model's in-memory dtypes as `LayerCache` does (float32 scales on
the CPU backend), adds C rows after the last expert (the layer's device slots: one array, so each lane is
computed once, by one `gather_qmm`, whichever tier holds its expert), writing them into the arrays' own
host memory, and asks the backend to keep its experts in host memory for the device and its slot rows in
device memory (`backend.map_for_device`). On the CPU and Metal that is plain memory and the same code runs.
Not here: the forward math, filling the slots or admission (`two_tier_runtime.py`).
"""

import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from ..caching.slot_arrays import SAME_BYTES, host_bits
from ..memory import backend, cuda
from ..storage.layout import BlockLayout, ExpertRows
from ..storage.store import ExpertStore

READ_BATCH_BYTES = 64 * 2**20  # one read of a layer's experts (its staging, where it has one)
LOAD_THREADS = max(1, min(8, os.cpu_count() or 1))  # reads and CPU streams filling the stacks at once


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


def read_stacks(
    store: ExpertStore,
    layers: Sequence[tuple[BlockLayout, dict[tuple[str, str], mx.Dtype], int, np.ndarray]],
    progress=None,
) -> list[dict[tuple[str, str], mx.array]]:
    """Per (layout, targets, slots, host ids) in `layers`, per part (`(proj, name)`), an `(H + slots, ...)`
    array: the experts `host ids` (H of them: every expert in expert order where the host holds all) in
    `targets`' dtype (rows 0..H-1, in host memory mapped for the device), then `slots` rows of zeros (the
    slots, in device memory). `progress.update(bytes)` as reads finish.

    Every array is made at once, its zeros written by several CPU streams in parallel (`_host_stacks`:
    first-touching managed memory took 12.5 of a 31 s load on CUDA when one stream wrote it, docs/GPU.md,
    "Time to first token"). Where the disk's bytes are the arrays' (no cast, experts not packed) they are
    read straight into the arrays' rows by `LOAD_THREADS` threads; else a layer's experts go through
    staging and a cast on this thread. Where MLX gives no writable view of an array, its layer's bytes go
    into numpy arrays copied into MLX once, then checked (a RuntimeError where an array does not hold the
    bytes read), one layer at a time."""
    host_nbytes = sum(
        len(ids) * math.prod(p.shape) * targets[(p.proj, p.name)].size
        for layout, targets, _, ids in layers
        for p in layout.parts
    )
    # each layer's, once advised: taken back if the load fails
    stacks: list[dict[tuple[str, str], mx.array] | None] = [None] * len(layers)
    try:
        with backend.host_arrays_ahead(host_nbytes):  # map_for_device counts them as each layer is finished
            return _read_stacks(store, layers, progress, stacks)
    except BaseException:  # else MLX's limit stays raised by arrays nobody holds (`backend._hold_in_host`)
        release_stacks([stack for stack in stacks if stack is not None])
        raise


def _read_stacks(
    store: ExpertStore, layers, progress, stacks: list[dict[tuple[str, str], mx.array] | None]
) -> list[dict[tuple[str, str], mx.array]]:
    hosts = _host_stacks(layers)
    with ThreadPoolExecutor(LOAD_THREADS) as pool:
        pending = []
        try:
            for i, ((layout, targets, slots, host_ids), rows) in enumerate(zip(layers, hosts)):
                if _in_place(layout, targets, rows):
                    for into, ids in _batches(layout, host_ids):
                        views = {
                            key: [_bytes_of(r) for r in view[into]]
                            for key, (_, view) in rows.items()
                            if view is not None  # every one (`_in_place`)
                        }
                        pending.append((pool.submit(store.read_parts, layout, ids, views), ids, layout))
                else:
                    _read_staged(store, layout, host_ids, targets, rows, progress)
                    stacks[i] = _finish(layout, len(host_ids), targets, slots, rows)
                    rows.clear()  # its numpy arrays, if any, go now
            for future, ids, layout in pending:
                future.result()
                if progress is not None:
                    progress.update(len(ids) * layout.expert_nbytes)
        except BaseException:
            for future, _, _ in pending:  # a failed read fails the load: the reads not started are dropped
                future.cancel()
            raise
    for i, ((layout, targets, slots, host_ids), rows) in enumerate(zip(layers, hosts)):
        if stacks[i] is None:
            stacks[i] = _finish(layout, len(host_ids), targets, slots, rows)
    finished = [stack for stack in stacks if stack is not None]  # every layer's by now
    mx.eval([list(stack.values()) for stack in finished])
    return finished


def _in_place(layout: BlockLayout, targets: dict, rows: dict) -> bool:
    """Whether the layout's experts can be read straight into its arrays' rows: every array has a view,
    every part's bytes on disk are its target's, and the experts are not packed (a packed row holds every
    part of one expert)."""
    return layout.packed is None and all(
        rows[(p.proj, p.name)][1] is not None and SAME_BYTES.get(p.dtype) == targets[(p.proj, p.name)]
        for p in layout.parts
    )


def _batches(layout: BlockLayout, host_ids: np.ndarray) -> list[tuple[slice, np.ndarray]]:
    """(host rows, the experts `host_ids` they hold) in batches of about `READ_BATCH_BYTES`."""
    H = len(host_ids)
    batch = max(1, min(H, READ_BATCH_BYTES // max(1, layout.expert_nbytes)))
    return [
        (slice(start, min(H, start + batch)), host_ids[start : start + batch]) for start in range(0, H, batch)
    ]


def _bytes_of(row: np.ndarray) -> memoryview:
    return row.reshape(-1).view(np.uint8).data


def _read_staged(
    store: ExpertStore, layout: BlockLayout, host_ids: np.ndarray, targets: dict, rows: dict, progress
):
    """A layer's experts `host_ids` read into staging, then cast (`_target_bytes`) into its arrays' rows
    (into numpy arrays made here where an array has no view)."""
    for key, (array, view) in rows.items():
        if view is None:
            rows[key] = (None, np.zeros(array.shape, dtype=_uint(array.dtype.size)))
    batches = _batches(layout, host_ids)
    staging = ExpertRows(layout, len(batches[0][1]))
    for into, batch in batches:
        raw = store.read(layout, batch, staging)
        for p in layout.parts:
            key = (p.proj, p.name)
            rows[key][1][into] = _target_bytes(raw[key], p.dtype, targets[key])
        if progress is not None:
            progress.update(len(batch) * layout.expert_nbytes)


def _finish(
    layout: BlockLayout, E: int, targets: dict, slots: int, rows: dict
) -> dict[tuple[str, str], mx.array]:
    """A layer's arrays (`E` host rows, then `slots`), filled, as the stack: copied into MLX where they were
    numpy's, advised for the device (`backend.map_for_device`), viewed as their targets' dtypes."""
    arrays = {  # every copy made (and checked) before any is advised: a failed one leaves none advised
        key: _copied_into_mlx(written, f"{layout.module_path}.{key[0]}.{key[1]}") if array is None else array
        for key, (array, written) in rows.items()
    }
    for array in arrays.values():
        backend.map_for_device(array, array.nbytes // (E + slots) * slots)
    return {
        key: array if array.dtype == targets[key] else array.view(targets[key])
        for key, array in arrays.items()
    }


def _host_stacks(layers) -> list[dict[tuple[str, str], tuple[mx.array, np.ndarray | None]]]:
    """Per layer, per part, an evaluated MLX array of zeros (H + slots rows of the part's shape, unsigned
    integers of its target's size) made on a CPU stream, so in host memory on every backend (managed
    memory on CUDA), and a writable numpy view of it where MLX gives one (`_writable`). The arrays are
    spread over `LOAD_THREADS` CPU streams by bytes, each stream its own thread, and evaluated together.
    On CUDA past the host's memory they are made on the device instead (`backend.stack_zeros_on`)."""
    streams = _fill_streams()
    load = [0] * len(streams)
    arrays = []
    for layout, targets, slots, host_ids in layers:
        layer = {}
        for p in layout.parts:
            key, size = (p.proj, p.name), targets[(p.proj, p.name)].size
            i = load.index(min(load))
            stream = backend.stack_zeros_on(len(host_ids) < layout.num_experts, streams[i])
            layer[key] = mx.zeros((len(host_ids) + slots, *p.shape), dtype=_mx_uint(size), stream=stream)
            load[i] += layer[key].nbytes
        arrays.append(layer)
    mx.eval([list(layer.values()) for layer in arrays])
    return [{key: _writable(array) for key, array in layer.items()} for layer in arrays]


_streams: list = []


def _fill_streams() -> list:
    if not _streams:
        _streams.extend(mx.new_stream(mx.cpu) for _ in range(LOAD_THREADS))
    return _streams


def _writable(array: mx.array) -> tuple[mx.array, np.ndarray | None]:
    """`(array, a writable numpy view of it)`, the view None where MLX gives none. Writing through the view
    saves the copy `mx.array` makes of a numpy array: half of a two-tier load's time on the CPU
    (docs/GPU.md, "Time to first token")."""
    return array, cuda.writable_view(array)


def _copied_into_mlx(rows: np.ndarray, name: str) -> mx.array:
    array = mx.array(rows)
    mx.eval(array)
    seen = cuda.numpy_view(array)
    if seen is None or not np.array_equal(seen, rows):
        raise RuntimeError(f"{name}: the mapped stack differs from the store")
    return array


def host_view(array: mx.array) -> np.ndarray:
    """`array`'s memory as numpy (`cuda.numpy_view`), which the host reads and writes through; a
    RuntimeError where MLX gives none (the stacks' arrays and the host rings always have one)."""
    view = cuda.numpy_view(array)
    if view is None:
        raise RuntimeError(f"MLX gives no view of a {array.dtype} array of {array.shape}")
    return view


def release_stack(stack: dict[tuple[str, str], mx.array]):
    """Take back the device advice of a stack `read_stacks` made (before letting it go)."""
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
