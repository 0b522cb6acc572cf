"""The CUDA kernels of staged passes (`staged_passes.py`): rows of the stacks copied to the device by 16-byte
loads (`copy_rows`), and a decode pass's lanes in one launch (`staged_lanes`: each lane's row found, its
expert copied, which lanes were hits and the pass's counts) where MLX operations took several.

MLX's host pays for every operation of a pass when it encodes it, and where the device finishes first that is
the token's time: even stock mlx-lm's decoded token takes longer in wall time than its kernels do
(docs/GPU.md, "The 0% row's floor"). A staged pass of one position
looked up each lane's row in the table, copied the rows, and counted its hits in several operations besides
the copy; here the copy kernel does it all: its blocks each copy one (lane, array) row, and its first block
writes the lane's hit and, for the first lane, the pass's counts. The bytes copied are the rows `copy_rows`
copies, so the layer's products and tokens are unchanged. CUDA only: elsewhere the same work is MLX operations
(`staged_passes.py`).
Not here: what the copies are used for, or which pass is staged (`two_tier.py`).
"""

import mlx.core as mx

from . import slot_fill

THREADS = 256

_ROWS = """
    using U = {unit};
    uint32_t row = blockIdx.y;
    if (row >= (uint32_t)count[0]) return;  // rows no expert needs are never read
    size_t from = (size_t)sources[row];
    size_t step = (size_t)gridDim.x * blockDim.x;
    size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    switch (blockIdx.z) {{
{cases}
    }}
"""
_LANES = """
    using U = {unit};
    uint32_t row = blockIdx.y;
    uint32_t e = (uint32_t)indices[row];
    size_t from = (size_t)table[e];
    if (blockIdx.x == 0 && blockIdx.z == 0 && threadIdx.x == 0) {{
        hit[row] = from >= {E};
        if (row == 0) {{
            int held = 0;
            for (uint32_t i = 0; i < {k}; ++i) held += table[(uint32_t)indices[i]] >= {E} ? 1 : 0;
            counts[0] = {k};
            counts[1] = held;
            counts[2] = 1;
            counts[3] = {k} - held;
        }}
    }}
    size_t step = (size_t)gridDim.x * blockDim.x;
    size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    switch (blockIdx.z) {{
{cases}
    }}
"""
_CASE = """        case {i}: {{
            const U* a = reinterpret_cast<const U*>(a{i}) + from * {units};
            U* o = reinterpret_cast<U*>(o{i}) + (size_t)row * {units};
            for (size_t u = first; u < {units}; u += step) o[u] = a[u];
            break;
        }}"""
_kernels: dict[tuple, object] = {}


def staged_lanes(indices: mx.array, table: mx.array, arrays: list, blocks: int) -> tuple:
    """A staged pass of one position in one kernel: (lane i's expert, from the row `table` gives it, copied
    into row i of a copy of each of `arrays`; which lanes' experts were in device rows, the ids' shape;
    the pass's counts (4,) int32 as `staged_passes.staged_switch` gives them). `blocks`: thread blocks per
    (lane, array)."""
    k, E = indices.size, table.shape[0]
    unit, units = slot_fill.row_units(arrays)
    key = ("lanes", unit, units, k, E)
    if key not in _kernels:
        cases = "\n".join(_CASE.format(i=i, units=n) for i, n in enumerate(units))
        _kernels[key] = mx.fast.cuda_kernel(
            name=f"od_moe_lanes_{len(_kernels)}",
            input_names=["indices", "table", *(f"a{i}" for i in range(len(units)))],
            output_names=[*(f"o{i}" for i in range(len(units))), "hit", "counts"],
            source=_LANES.format(unit=unit, E=E, k=k, cases=cases),
        )
    threads = min(max(units), THREADS * blocks)
    *copies, hit, counts = _kernels[key](
        inputs=[indices.reshape(-1), table, *arrays],
        grid=(threads, k, len(arrays)),
        threadgroup=(min(THREADS, threads), 1, 1),
        output_shapes=[*((k, *a.shape[1:]) for a in arrays), (k,), (4,)],
        output_dtypes=[*(a.dtype for a in arrays), mx.bool_, mx.int32],
    )
    return copies, hit.reshape(indices.shape), counts


def copy_rows(arrays: list, sources: mx.array, count: mx.array, rows: int, blocks: int) -> list:
    """`mx.take(array, sources, axis=0)` of every array of `arrays` as one CUDA kernel that loads 16 bytes
    a thread and leaves rows from `count` on unwritten (no lane reads them). `blocks`: thread blocks per
    (row, array)."""
    unit, units = slot_fill.row_units(arrays)
    key = ("rows", unit, units)
    if key not in _kernels:
        cases = "\n".join(_CASE.format(i=i, units=n) for i, n in enumerate(units))
        _kernels[key] = mx.fast.cuda_kernel(
            name=f"od_moe_stage_{len(_kernels)}",
            input_names=[*(f"a{i}" for i in range(len(units))), "sources", "count"],
            output_names=[f"o{i}" for i in range(len(units))],
            source=_ROWS.format(unit=unit, cases=cases),
        )
    threads = min(max(units), THREADS * blocks)
    out = _kernels[key](
        inputs=[*arrays, sources, count.astype(mx.int32).reshape(1)],
        grid=(threads, rows, len(arrays)),
        threadgroup=(min(THREADS, threads), 1, 1),
        output_shapes=[(rows, *a.shape[1:]) for a in arrays],
        output_dtypes=[a.dtype for a in arrays],
    )
    return list(out)
