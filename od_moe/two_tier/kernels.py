"""Every CUDA kernel source of the two-tier path, and the staged passes' launches.

Each runs through `mx.fast.cuda_kernel` on MLX's stream, compiled on first use, and only where MLX runs on
CUDA; elsewhere the same work is MLX operations or numpy, which the CPU tests run. Three kinds:
- slot fills (`slot_fill_source`, launched by `slot_fill.KernelFills`): experts copied from their host rows
  into slot rows of the same stack, between passes;
- device-kept rows (`kept_rows_source`, launched by `kept_rows.KeptRows`): one call decides which candidate
  experts go into which of a layer's rows (least recently used, or by decayed counts), writes the layer's
  expert->row tables (`TABLES`: not for a fused decode pass, which reads only its lanes' rows), each
  candidate lane's row and hit, its running count of copies and hit lanes, and copies the chosen experts
  host row -> device row, one (expert, array) per block row of the grid. A block whose candidate is no
  miss leaves at once; the others make the decision in shared memory; block 0 writes the outputs.
  `kept_rows.plan` is the same decision in numpy, which the tests hold this source to, compiled for the
  CPU (`tests/cuda_emulation.py`);
- staged passes (`staged_passes.py`): rows of the stacks copied to the device by 16-byte loads
  (`copy_rows`), and a decode pass's lanes in one launch (`staged_lanes`: each lane's row found, its expert
  copied, which lanes were hits and the pass's counts) where MLX operations took several.

MLX's host pays for every operation of a pass when it encodes it, and where the device finishes first that is
the token's time: even stock mlx-lm's decoded token takes longer in wall time than its kernels do
(docs/GPU.md, "The 0% row's floor"). A staged pass of one position looked up each lane's row in the table,
copied the rows, and counted its hits in several operations besides the copy; here the copy kernel does it
all: its blocks each copy one (lane, array) row, and its first block writes the lane's hit and, for the first
lane, the pass's counts. The bytes copied are the rows `copy_rows` copies, so the layer's products and tokens
are unchanged. Not here: when each kernel runs and what its copies are for (`two_tier_runtime.py`,
`slot_fill.py`, `kept_rows.py`, `staged_passes.py`).
"""

from collections.abc import Sequence
from typing import Protocol, cast

import mlx.core as mx

THREADS = 256  # per block, in every kernel here


class Kernel(Protocol):
    """What `mx.fast.cuda_kernel` makes (MLX types it as an object): called with its inputs and launch, it
    gives its outputs."""

    def __call__(
        self, *, inputs: list, output_shapes: list, output_dtypes: list, **launch
    ) -> list[mx.array]: ...


def cuda_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str) -> Kernel:
    """`mx.fast.cuda_kernel` (looked up at each call: the tests stand in for it), typed as a `Kernel`."""
    return cast(
        Kernel,
        mx.fast.cuda_kernel(name=name, input_names=input_names, output_names=output_names, source=source),
    )


_ROW_UNIT_TYPES = {16: "uint4", 8: "uint2", 4: "uint32_t", 2: "uint16_t", 1: "uint8_t"}


def row_units(arrays) -> tuple[str, tuple[int, ...]]:
    """For one kernel copying rows of every array in `arrays` (staged passes, device-kept rows): the
    widest load (a C type) that divides each array's row, and each row's length in such loads."""
    sizes = [a.nbytes // a.shape[0] for a in arrays]
    unit = next(u for u in _ROW_UNIT_TYPES if all(size % u == 0 for size in sizes))
    return _ROW_UNIT_TYPES[unit], tuple(size // unit for size in sizes)


# slot fills (`slot_fill.py`): `moves` holds (host row, slot row) pairs, one per block row of the grid;
# `done` is written once a block has copied, for what reads the slots to depend on
_SLOT_FILL = """
    using U = {unit};
    const U* rows = reinterpret_cast<const U*>(stack);
    U* slots = const_cast<U*>(rows);  // the slot rows of the same stack: MLX holds it as an input
    size_t from = (size_t)moves[2 * blockIdx.y] * UNITS;
    size_t to = (size_t)moves[2 * blockIdx.y + 1] * UNITS;
    size_t step = (size_t)gridDim.x * blockDim.x;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < UNITS; i += step) {{
        slots[to + i] = rows[from + i];
    }}
    if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0) {{
        done[0] = 1;
    }}
"""
_SLOT_FILL_UNITS = {16: "uint4", 4: "uint32_t", 1: "uint8_t"}


def slot_fill_unit(row_bytes: int) -> int:
    """The widest load (bytes) a slot fill copies a row of `row_bytes` with."""
    return next(u for u in _SLOT_FILL_UNITS if row_bytes % u == 0)


def slot_fill_source(unit: int) -> str:
    """The slot fill's body for rows copied `unit` bytes at a time (`slot_fill_unit`)."""
    return _SLOT_FILL.format(unit=_SLOT_FILL_UNITS[unit])


# device-kept rows (`kept_rows.py`). Of a demand call's blocks (16 per candidate and array at top-8), only
# those of a candidate not held can copy: the rest leave after one look at the rows. Most calls copy nothing,
# and with every block deciding such a call cost nearly what one that copies did (docs/GPU.md, "Real shapes'
# tokens"). A block that stays makes the decision once, in shared memory, its threads splitting the candidates
# and rows between them: every thread repeating it alone made a call cost tens of microseconds before a byte
# moved. Least recently used needs no loop over candidates: the k-th candidate not held takes the free row
# ranked k-th by age (oldest first, ties: the lower row). Ranking by decayed counts (COUNTS) or top-P scores
# (SCORES), where each choice changes the next, stays serial, in thread 0.
# Block 0 decides on the call's path: the layer's products wait for it even when nothing is copied. So its
# global reads come first, all at once; no thread loops over the S rows where a pass over the rows can
# record what each candidate needs (its row, in `held_at`); rows are ranked only when a miss has a free row
# to take; and a fused pass's lane rows come from `held_at` and `into_of`, not from scanning the rows again.
# A demand call is given N candidates and compiled for P (N rounded up, `kept_rows.padded_size`): the ones
# past N are no expert (E), so a pass hands its routed ids over as they are, with no padding made for them.
_KEPT_ROWS = """
    using U = {unit};
    __shared__ int ids[P];  // the candidates' ids (DEMAND), else the top P of the scores
    __shared__ int first_of[P];  // the first candidate with the same id
    __shared__ uint32_t own_row[P];  // each candidate's row in the table given (base): a slot, else its own
    __shared__ int want[P];  // the candidates in order, -1 where repeated, unknown or in a slot
    __shared__ int held_at[P];  // the lowest row holding each wanted candidate before the call (S: none)
    __shared__ bool miss[P];  // wanted and not held
    __shared__ int missing_k[P];  // each miss's place among the misses
    __shared__ int into_of[P];  // the row each candidate is copied to, else -1
    __shared__ int now[S];
    __shared__ int was[S];  // the rows' experts before the call
    __shared__ int was_age[S];  // the rows' ages before the call, read S times a row when ranked
    __shared__ int new_age[S];
    __shared__ bool free_row[S];
    __shared__ int row_by_age[S];  // the free rows a miss takes, oldest first
    __shared__ int now_row[TABLES ? E : 1];  // block 0, TABLES: each expert's device row after the call
    __shared__ int held_row[TABLES ? E : 1];  // and before it (S: none)
    __shared__ int copies;
    __shared__ int lane_hits, misses, free_rows;
    const int tid = threadIdx.x, nt = blockDim.x;
    const bool first_block = blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0;
    if (!SCORES && !first_block) {{  // a block copies only its candidate, and only if it is a miss
        int q = blockIdx.y;
        int e = q < N ? (int)static_cast<float>(cand[q]) : E;
        bool other = !COPY || e < 0 || e >= E || base[e] >= (uint32_t)E;  // none, unknown or in a slot
        for (int r = tid; r < q && !other; r += nt) other = (int)static_cast<float>(cand[r]) == e;
        for (int s = tid; s < S && !other; s += nt) other = held[s] == e;
        if (__syncthreads_or(other)) return;  // the whole block: no copy (block 0 writes the outputs)
    }}
    // every global read the decision needs is made here at once (a thread a candidate or a row), and the
    // rest works in shared memory
    int counted_before[2] = {{0, 0}};
    if (tid == 0) {{
        lane_hits = 0;
        misses = 0;
        free_rows = 0;
        if (first_block) {{
            counted_before[0] = counted[0];
            counted_before[1] = counted[1];
        }}
    }}
    for (int j = tid; j < P + S; j += nt) {{
        if (j < P) {{
            int e = SCORES ? -1 : j < N ? (int)static_cast<float>(cand[j]) : E;
            ids[j] = e;
            own_row[j] = e >= 0 && e < E ? base[e] : (uint32_t)E;
            held_at[j] = S;
            into_of[j] = -1;
        }} else {{
            was[j - P] = held[j - P];
            was_age[j - P] = age[j - P];
        }}
    }}
    __syncthreads();
    if (SCORES) {{  // the top P of E scores (ties: the lower id)
        if (tid == 0) {{
            float last_v = INFINITY;
            int last_i = -1;
            for (int q = 0; q < P; ++q) {{
                int best = -1;
                float best_v = -INFINITY;
                for (int e = 0; e < E; ++e) {{
                    float v = static_cast<float>(cand[e]);
                    bool below = v < last_v || (v == last_v && e > last_i);
                    if (below && (best < 0 || v > best_v)) {{
                        best = e;
                        best_v = v;
                    }}
                }}
                last_v = best_v;
                last_i = best;
                ids[q] = best;
            }}
        }}
        __syncthreads();
    }}
    for (int q = tid; q < P; q += nt) {{
        int e = ids[q], f = q;
        for (int r = q - 1; r >= 0; --r) f = ids[r] == e ? r : f;
        first_of[q] = f;
        if (SCORES) own_row[q] = e >= 0 && e < E ? base[e] : (uint32_t)E;
        want[q] = (f == q && e >= 0 && e < E && own_row[q] < (uint32_t)E) ? e : -1;
    }}
    __syncthreads();
    for (int s = tid; s < S; s += nt) {{  // which rows hold a wanted expert: kept, the others free
        int held_s = was[s];
        bool keep = false;
        for (int q = 0; q < P; ++q) {{
            if (want[q] < 0 || want[q] != held_s) continue;
            keep = true;
            atomicMin(&held_at[q], s);
        }}
        now[s] = held_s;
        free_row[s] = !keep && COPY;
        new_age[s] = keep ? 0 : (DEMAND ? min(was_age[s] + 1, {empty}) : was_age[s]);
        if (!keep && COPY) atomicAdd(&free_rows, 1);
    }}
    __syncthreads();
    for (int q = tid; q < P; q += nt) {{
        miss[q] = want[q] >= 0 && held_at[q] == S;
        if (miss[q]) atomicAdd(&misses, 1);
    }}
    __syncthreads();
    auto scored = [&](int e) -> float {{  // decayed routing counts after this pass (COUNTS only)
        if (!COUNTS) return score[e];
        bool routed = false;
        for (int q = 0; q < P; ++q) routed = routed || want[q] == e;
        return __fadd_rn(__fmul_rn(score[e], decay[0]), routed ? 1.0f : 0.0f);
    }};
    const int lru_copies = min(free_rows, misses);  // the same in every thread
    if (COUNTS) {{  // each miss takes the lowest-counted free row (empty first) where its count is higher
        if (tid == 0) {{
            copies = 0;
            for (int q = 0; q < P && misses > 0; ++q) {{
                if (!miss[q]) continue;
                int v = -1;
                for (int s = 0; s < S; ++s) {{
                    if (!free_row[s]) continue;
                    if (v < 0 || (now[v] >= 0 && (now[s] < 0 || scored(now[s]) < scored(now[v])))) v = s;
                }}
                if (v < 0) break;
                if (now[v] >= 0 && !(scored(want[q]) > scored(now[v]))) continue;  // read in place
                free_row[v] = false;
                now[v] = want[q];
                new_age[v] = 0;
                into_of[q] = v;
                copies += 1;
            }}
        }}
        __syncthreads();
    }} else if (lru_copies > 0) {{  // most calls miss nothing and skip this
        for (int s = tid; s < S; s += nt) {{  // each free row's place among the free rows, oldest first
            if (!free_row[s]) continue;
            int rank = 0, a = was_age[s];
            for (int r = 0; r < S; ++r)
                rank += free_row[r] && (was_age[r] > a || (was_age[r] == a && r < s)) ? 1 : 0;
            if (rank < lru_copies) row_by_age[rank] = s;
        }}
        for (int q = tid; q < P; q += nt) {{  // each miss: how many come before it
            int k = 0;
            for (int r = 0; r < q; ++r) k += miss[r] ? 1 : 0;
            missing_k[q] = k;
        }}
        __syncthreads();
        for (int q = tid; q < P; q += nt) {{
            int k = missing_k[q];
            if (!miss[q] || k >= lru_copies) continue;
            int v = row_by_age[k];
            into_of[q] = v;
            now[v] = want[q];
            new_age[v] = 0;
        }}
        __syncthreads();
    }}
    if (first_block) {{
        if (tid == 0 && !COUNTS) copies = lru_copies;
        auto placed = [&](int e, const int* row_of) -> uint32_t {{  // e's row: a slot, else a device row
            uint32_t row = base[e];
            return row < (uint32_t)E && row_of[e] < S ? E + C + row_of[e] : row;
        }};
        if (TABLES) {{  // each expert's row, before and after the call
            for (int i = tid; i < E; i += nt) {{
                now_row[i] = S;
                held_row[i] = S;
            }}
            __syncthreads();
            for (int s = tid; s < S; s += nt) {{  // the lower row, were an expert in two
                if (now[s] >= 0 && now[s] < E) atomicMin(&now_row[now[s]], s);
                if (was[s] >= 0 && was[s] < E) atomicMin(&held_row[was[s]], s);
            }}
            __syncthreads();
            for (int i = tid; i < E; i += nt) {{
                rows[i] = placed(i, now_row);
                found[i] = placed(i, held_row);
            }}
        }}
        for (int i = tid; i < E && (TABLES || COUNTS); i += nt) score_out[i] = scored(i);
        for (int s = tid; s < S; s += nt) {{
            held_out[s] = now[s];
            age_out[s] = new_age[s];
        }}
        for (int q = tid; q < P && DEMAND; q += nt) {{  // each candidate lane's row, hit
            int e = ids[q];
            bool known = e >= 0 && e < E;
            uint32_t before = E, after = E;
            if (known && TABLES) {{
                before = placed(e, held_row);
                after = placed(e, now_row);
            }} else if (known) {{  // from its first candidate's: a kept row stays, a miss may be copied
                int f = first_of[q];
                uint32_t own = own_row[q];
                before = own < (uint32_t)E && held_at[f] < S ? E + C + held_at[f] : own;
                after = before >= (uint32_t)E || into_of[f] < 0 ? before : E + C + into_of[f];
            }}
            bool hit = known && before >= (uint32_t)E;
            lane_rows[q] = after;
            if (TABLES) lane_hit[q] = hit;
            if (hit) atomicAdd(&lane_hits, 1);
        }}
        __syncthreads();
        if (tid == 0) {{  // the layer's copies and hit lanes so far
            counted_out[0] = counted_before[0] + copies;
            counted_out[1] = counted_before[1] + lane_hits;
        }}
    }}
    int into = into_of[blockIdx.y];
    if (into < 0) return;
    size_t from_row = (size_t)want[blockIdx.y];
    size_t to_row = (size_t)(E + C + into);
    size_t step = (size_t)gridDim.x * blockDim.x;
    size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    switch (blockIdx.z) {{
{cases}
    }}
"""

_KEPT_ROWS_CASE = """        case {i}: {{
            U* rows_{i} = const_cast<U*>(reinterpret_cast<const U*>(a{i}));
            for (size_t u = first; u < {units}; u += step)
                rows_{i}[to_row * {units} + u] = rows_{i}[from_row * {units} + u];
            break;
        }}"""


# the kept rows' kernel's inputs after the stack's arrays (a0, a1, ...) and its outputs, in order, with their
# dtypes (a prediction's candidates are scores, float32); a fused pass's kernel (`TABLES` off) has none of the
# tables' outputs (MLX's host pays for each output of every call). `C_TYPES`: the C type MLX declares each
# dtype as (`kept_rows_parameters`).
KEPT_ROWS_INPUTS = dict(
    cand=mx.uint32, base=mx.uint32, held=mx.int32, age=mx.int32, score=mx.float32, decay=mx.float32
)
KEPT_ROWS_INPUTS.update(counted=mx.int32)
KEPT_ROWS_OUTPUTS = dict(rows=mx.uint32, found=mx.uint32, held_out=mx.int32, age_out=mx.int32)
KEPT_ROWS_OUTPUTS.update(counted_out=mx.int32, score_out=mx.float32, lane_rows=mx.uint32, lane_hit=mx.bool_)
FUSED_OUTPUTS = tuple(name for name in KEPT_ROWS_OUTPUTS if name not in ("rows", "found", "lane_hit"))
C_TYPES = {mx.uint32: "uint32_t", mx.int32: "int32_t", mx.float32: "float", mx.bool_: "bool"}


def kept_rows_parameters(tables: bool, cand: str = C_TYPES[mx.uint32]) -> list[str]:
    """The kernel's parameters after the stack's arrays, as MLX declares them, for its twins in the tests and
    the lab that compile the same source; `cand` the candidates' C type."""
    outputs = KEPT_ROWS_OUTPUTS if tables else FUSED_OUTPUTS
    inputs = [f"const {cand if n == 'cand' else C_TYPES[t]}* {n}" for n, t in KEPT_ROWS_INPUTS.items()]
    return inputs + [f"{C_TYPES[KEPT_ROWS_OUTPUTS[n]]}* {n}" for n in outputs]


def kept_rows_source(unit: str, units: Sequence[int], empty: int, tables: bool = True) -> str:
    """The body of the device-kept rows' kernel for stacks whose rows are `units[i]` elements of type `unit`
    (array i), `empty` the age of an empty row; `tables` False: the fused pass's kernel (`FUSED_OUTPUTS`),
    compiled with `TABLES` off."""
    cases = "\n".join(_KEPT_ROWS_CASE.format(i=i, units=n) for i, n in enumerate(units))
    body = _KEPT_ROWS.format(unit=unit, cases=cases, empty=empty)
    if tables:
        return body
    # the names only the tables' branches use, which never run with TABLES off
    return (
        "    uint32_t* rows = nullptr;\n    uint32_t* found = nullptr;\n    bool* lane_hit = nullptr;\n"
        + body
    )


# staged passes (`staged_passes.py`)
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
_kernels: dict[tuple, Kernel] = {}


def staged_lanes(indices: mx.array, table: mx.array, arrays: list, blocks: int) -> tuple:
    """A staged pass of one position in one kernel: (lane i's expert, from the row `table` gives it, copied
    into row i of a copy of each of `arrays`; which lanes' experts were in device rows, the ids' shape;
    the pass's counts (4,) int32 as `staged_passes.staged_switch` gives them). `blocks`: thread blocks per
    (lane, array)."""
    k, E = indices.size, table.shape[0]
    unit, units = row_units(arrays)
    key = ("lanes", unit, units, k, E)
    if key not in _kernels:
        cases = "\n".join(_CASE.format(i=i, units=n) for i, n in enumerate(units))
        _kernels[key] = cuda_kernel(
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
    unit, units = row_units(arrays)
    key = ("rows", unit, units)
    if key not in _kernels:
        cases = "\n".join(_CASE.format(i=i, units=n) for i, n in enumerate(units))
        _kernels[key] = cuda_kernel(
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
