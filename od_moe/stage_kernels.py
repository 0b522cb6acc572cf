"""The CUDA kernels of a staged decode pass (`staging.py`, `staged_forecast.py`), each doing in one launch
what took a chain of MLX operations: a layer's lanes (each lane's row found, copied to the device, its hit
and the pass's counts) and a forecast's copy (the next layer's best-scored experts chosen and copied).

On CUDA the host pays for every MLX operation of a pass when MLX encodes it (about 7 us each on an H100
host: stock mlx-lm's `async_eval` took 2.2 ms a token for about 300 operations, docs/two-tier-h100.md), and a
decode token there is bound by the host. A staged pass did its lookups, comparisons and counts as a dozen
small operations a layer; here they are one kernel, whose blocks each copy one (lane, array) row and whose
first block writes the counts. The bytes copied are the same rows `staging.copy_rows` copies, so the
layer's products and tokens are unchanged. CUDA only: elsewhere the same work is MLX operations
(`staging.py`, `staged_forecast.py`).
Not here: what the rows are used for, or which pass takes which path (`two_tier.py`).
"""

import mlx.core as mx

from . import slot_fill

THREADS = 256

_LANES = """
    using U = {unit};
    uint32_t row = blockIdx.y;
    uint32_t e = (uint32_t)indices[row];
    int found = -1;  // the lane's expert's row in the forecast's copy
    {find}
    if (blockIdx.x == 0 && blockIdx.z == 0 && threadIdx.x == 0) {{
        hit[row] = {hit};
        if (row == 0) {{
            int held = 0;
            for (uint32_t i = 0; i < {k}; ++i) {{
                uint32_t f = (uint32_t)indices[i];
                bool h = false;
                {held}
                held += h ? 1 : 0;
            }}
            counts[0] = {k};
            counts[1] = held;
            counts[2] = 1;
            counts[3] = {k} - held;
            counts[4] = {P};
        }}
    }}
    size_t step = (size_t)gridDim.x * blockDim.x;
    size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    switch (blockIdx.z) {{
{cases}
    }}
"""
_FIND = "for (int j = 0; j < {P}; ++j) if ((uint32_t)ids[j] == e) found = j;"
_IN_IDS = "for (int j = 0; j < {P}; ++j) h = h || ((uint32_t)ids[j] == f);"
_LANE_CASE = """        case {i}: {{
            const U* a = found >= 0 ? reinterpret_cast<const U*>(b{i}) + (size_t)found * {units}
                                    : reinterpret_cast<const U*>(a{i}) + (size_t)table[e] * {units};
            U* o = reinterpret_cast<U*>(o{i}) + (size_t)row * {units};
            for (size_t u = first; u < {units}; u += step) o[u] = a[u];
            break;
        }}"""
_ONE_CASE = """        case {i}: {{
            const U* a = reinterpret_cast<const U*>(a{i}) + from * {units};
            U* o = reinterpret_cast<U*>(o{i}) + (size_t)row * {units};
            for (size_t u = first; u < {units}; u += step) o[u] = a[u];
            break;
        }}"""

_FORECAST = """
    using U = {unit};
    __shared__ int chosen;
    uint32_t row = blockIdx.y;  // this block copies the row-th best-scored expert
    if (threadIdx.x == 0) chosen = -1;
    __syncthreads();
    for (uint32_t e = threadIdx.x; e < {E}; e += blockDim.x) {{
        float s = scores[e];
        uint32_t rank = 0;
        for (uint32_t f = 0; f < {E}; ++f) {{
            float t = scores[f];
            rank += (t > s || (t == s && f < e)) ? 1 : 0;
        }}
        if (rank == row) chosen = (int)e;
    }}
    __syncthreads();
    int e = chosen < 0 ? (int)row : chosen;  // a score that is no number ranks nowhere
    if (blockIdx.x == 0 && blockIdx.z == 0 && threadIdx.x == 0) ids[row] = e;
    size_t from = (size_t)table[e];
    size_t step = (size_t)gridDim.x * blockDim.x;
    size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    switch (blockIdx.z) {{
{cases}
    }}
"""
_kernels: dict[tuple, object] = {}


def lanes(indices: mx.array, table: mx.array, arrays: list, blocks: int, ids=None, prior=None) -> tuple:
    """A staged pass's lanes of one position in one kernel: (lane i's expert copied into row i of a copy of
    each of `arrays`, from the forecast's copy `prior` where `ids` (its experts) hold it, else from the row
    `table` gives it; which lanes were hits (in `prior`, or without one in a device row); the pass's counts
    (5,) int32 as `staging.staged_switch` gives them)."""
    k, E = indices.size, table.shape[0]
    P = 0 if ids is None else ids.size
    unit, units = slot_fill.row_units(arrays)
    key = ("lanes", unit, units, k, E, P)
    if key not in _kernels:
        case = _LANE_CASE if P else _ONE_CASE.replace("from *", "(size_t)table[e] *")
        cases = "\n".join(case.format(i=i, units=n) for i, n in enumerate(units))
        if P:
            find, hit, held = _FIND.format(P=P), "found >= 0", _IN_IDS.format(P=P)
        else:
            find, hit, held = "", f"table[e] >= {E}", f"h = table[f] >= {E};"
        source = _LANES.format(unit=unit, find=find, hit=hit, held=held, k=k, P=P, cases=cases)
        names = [*(f"a{i}" for i in range(len(units))), *(f"b{i}" for i in range(len(units)) if P)]
        _kernels[key] = mx.fast.cuda_kernel(
            name=f"od_moe_lanes_{len(_kernels)}",
            input_names=["indices", "table", *(["ids"] if P else []), *names],
            output_names=[*(f"o{i}" for i in range(len(units))), "hit", "counts"],
            source=source,
        )
    threads = min(max(units), THREADS * blocks)
    out = _kernels[key](
        inputs=[indices.reshape(-1), table, *([ids] if P else []), *arrays, *(prior or ())],
        grid=(threads, k, len(arrays)),
        threadgroup=(min(THREADS, threads), 1, 1),
        output_shapes=[*((k, *a.shape[1:]) for a in arrays), (k,), (5,)],
        output_dtypes=[*(a.dtype for a in arrays), mx.bool_, mx.int32],
    )
    *copies, hit, counts = out
    return copies, hit.reshape(indices.shape), counts


def forecast_copy(scores: mx.array, table: mx.array, arrays: list, P: int, blocks: int) -> tuple:
    """The `P` best-scored experts of `scores` (E,) float32 (ties: the lower id first), chosen and copied
    from the rows `table` gives them in one kernel: (their ids (P,) int32, a copy of each of `arrays`)."""
    E = table.shape[0]
    unit, units = slot_fill.row_units(arrays)
    key = ("forecast", unit, units, E)
    if key not in _kernels:
        cases = "\n".join(_ONE_CASE.format(i=i, units=n) for i, n in enumerate(units))
        _kernels[key] = mx.fast.cuda_kernel(
            name=f"od_moe_forecast_{len(_kernels)}",
            input_names=["scores", "table", *(f"a{i}" for i in range(len(units)))],
            output_names=["ids", *(f"o{i}" for i in range(len(units)))],
            source=_FORECAST.format(unit=unit, E=E, cases=cases),
        )
    threads = max(min(max(units), THREADS * blocks), min(E, THREADS))  # a block ranks every expert
    ids, *copies = _kernels[key](
        inputs=[scores.reshape(-1), table, *arrays],
        grid=(threads, P, len(arrays)),
        threadgroup=(min(THREADS, threads), 1, 1),
        output_shapes=[(P,), *((P, *a.shape[1:]) for a in arrays)],
        output_dtypes=[mx.int32, *(a.dtype for a in arrays)],
    )
    return ids, copies
