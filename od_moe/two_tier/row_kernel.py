"""The CUDA source of the rows the device keeps (`kept_rows.py`): one call decides which candidate experts
go into which of a layer's rows (least recently used, or by decayed counts), writes the layer's expert->row
tables, each candidate lane's row and hit, and copies the chosen experts host row -> device row, one
(expert, array) per block row of the grid. Every thread repeats the decision in registers; block 0 writes
the tables. `kept_rows.plan` is the same decision in numpy, which the CPU tests run.
Not here: calling it (`kept_rows.KeptRows`), the rows' bookkeeping.
"""

SOURCE = """
    using U = {unit};
    int want[P];  // the candidates in order, -1 where repeated or already in a slot
    if (SCORES) {{  // the top P of E scores (ties: the lower id)
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
            want[q] = best;
        }}
    }} else {{  // P expert ids
        for (int q = 0; q < P; ++q) {{
            int e = (int)static_cast<float>(cand[q]);
            for (int r = 0; r < q; ++r) e = (want[r] == e) ? -1 : e;
            want[q] = e;
        }}
    }}
    for (int q = 0; q < P; ++q) {{
        int e = want[q];
        want[q] = (e >= 0 && e < E && base[e] < (uint32_t)E) ? e : -1;
    }}
    int now[S];
    int new_age[S];
    bool free_row[S];
    for (int s = 0; s < S; ++s) {{
        now[s] = held[s];
        bool keep = false;
        for (int q = 0; q < P; ++q) keep = keep || (want[q] >= 0 && want[q] == held[s]);
        free_row[s] = !keep && COPY;
        new_age[s] = keep ? 0 : (DEMAND ? min(age[s] + 1, {empty}) : age[s]);
    }}
    auto scored = [&](int e) -> float {{  // decayed routing counts after this pass (COUNTS only)
        if (!COUNTS) return score[e];
        bool routed = false;
        for (int q = 0; q < P; ++q) routed = routed || want[q] == e;
        return __fadd_rn(__fmul_rn(score[e], decay[0]), routed ? 1.0f : 0.0f);
    }};
    int into = -1;  // the row this block's expert is copied to
    int copies = 0;
    for (int q = 0; q < P; ++q) {{
        if (want[q] < 0) continue;
        bool there = false;
        for (int s = 0; s < S; ++s) there = there || (!free_row[s] && now[s] == want[q]);
        if (there) continue;
        int v = -1;  // empty rows first; then the least recently used, or the lowest count (ties: lower row)
        for (int s = 0; s < S; ++s) {{
            if (!free_row[s]) continue;
            if (!COUNTS && (v < 0 || age[s] > age[v])) v = s;
            if (COUNTS && (v < 0 || (now[v] >= 0 && (now[s] < 0 || scored(now[s]) < scored(now[v]))))) v = s;
        }}
        if (v < 0) break;
        if (COUNTS && now[v] >= 0 && !(scored(want[q]) > scored(now[v]))) continue;  // read in place
        free_row[v] = false;
        now[v] = want[q];
        new_age[v] = 0;
        copies += 1;
        if (q == (int)blockIdx.y) into = v;
    }}
    auto placed = [&](int e, const int* in) -> uint32_t {{  // e's row: a slot, else a device row `in` holds
        uint32_t row = base[e];
        for (int s = 0; s < S; ++s) row = (in[s] == e && row < (uint32_t)E) ? E + C + s : row;
        return row;
    }};
    if (blockIdx.x == 0 && blockIdx.y == 0 && blockIdx.z == 0) {{
        for (int i = threadIdx.x; i < E; i += blockDim.x) {{
            rows[i] = placed(i, now);
            found[i] = placed(i, held);
            score_out[i] = scored(i);
        }}
        if (threadIdx.x == 0) {{
            for (int s = 0; s < S; ++s) {{
                held_out[s] = now[s];
                age_out[s] = new_age[s];
            }}
            copied[0] = copies;
        }}
        for (int q = threadIdx.x; q < P && DEMAND; q += blockDim.x) {{  // each candidate lane's row, hit
            int e = (int)static_cast<float>(cand[q]);
            bool known = e >= 0 && e < E;
            lane_rows[q] = known ? placed(e, now) : (uint32_t)E;
            lane_hit[q] = known && placed(e, held) >= (uint32_t)E;
        }}
    }}
    if (into < 0) return;
    size_t from_row = (size_t)want[blockIdx.y];
    size_t to_row = (size_t)(E + C + into);
    size_t step = (size_t)gridDim.x * blockDim.x;
    size_t first = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    switch (blockIdx.z) {{
{cases}
    }}
"""

CASE = """        case {i}: {{
            U* rows_{i} = const_cast<U*>(reinterpret_cast<const U*>(a{i}));
            for (size_t u = first; u < {units}; u += step)
                rows_{i}[to_row * {units} + u] = rows_{i}[from_row * {units} + u];
            break;
        }}"""


def source(unit: str, units: list[int], empty: int) -> str:
    """The kernel's body for stacks whose rows are `units[i]` elements of type `unit` (array i)."""
    cases = "\n".join(CASE.format(i=i, units=n) for i, n in enumerate(units))
    return SOURCE.format(unit=unit, cases=cases, empty=empty)
