"""The device-kept rows' CUDA kernel run on this CPU against its numpy twin: no GPU needed.

    python3 lab/tools/kept_rows_emulate.py [STEPS]

The kernel's source (`two_tier/kernels.kept_rows_source`) is compiled as C++ with g++, CUDA's few names
emulated: each block's threads are real threads (one per thread of the block), `__shared__` memory a
static shared by them, `__syncthreads` a barrier, `__syncthreads_or` a barrier and a flag, `atomicAdd` and
`atomicMin` atomics; blocks run one after another, as the grid MLX launches (threads, candidates, arrays)
would. Then `kept_rows_check.py check`'s comparison on this CPU: two `KeptRows` over copies of the same
random stacks given the same calls (demand calls of 1-64 lanes, predictions, by recency and by decayed
counts), one deciding in the emulated kernel, one in `kept_rows.plan`; after every call the tables, each
lane's row and hit, the rows held, their ages, scores, copies and hit lanes must be equal, and at the end
both stacks must hold the same bytes.

What it shows: the kernel's logic (its decisions, its early exits, its synchronisation: a block whose
threads leave at different barriers hangs here as on a GPU) and its copies. What it does not: NVRTC's
compile (`nvrtc_check.py`), CUDA's memory model, timing. Not a test: CI has no compiler for it guaranteed.
"""

import ctypes
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

from od_moe.two_tier import kept_rows, tally
from od_moe.two_tier.kernels import THREADS, kept_rows_source, row_units

PRELUDE = r"""
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <thread>
#include <vector>
#include <algorithm>
using std::min;
using std::size_t;
struct uint3 { unsigned x, y, z; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
thread_local uint3 threadIdx, blockIdx;
static uint3 blockDim, gridDim;
static std::barrier<>* g_bar;
static std::atomic<int> g_or;
static inline void __syncthreads() { g_bar->arrive_and_wait(); }
static inline int __syncthreads_or(int p) {
    g_bar->arrive_and_wait();
    if (threadIdx.x == 0) g_or = 0;
    g_bar->arrive_and_wait();
    if (p) g_or = 1;
    g_bar->arrive_and_wait();
    int r = g_or;
    g_bar->arrive_and_wait();
    return r;
}
static inline int atomicAdd(int* a, int v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
static inline int atomicMin(int* a, int v) {
    int old = __atomic_load_n(a, __ATOMIC_SEQ_CST);
    while (v < old && !__atomic_compare_exchange_n(a, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
#define __shared__ static
"""

PARAMS = (
    "const CAND* cand, const uint32_t* base, const int32_t* held, const int32_t* age, const float* score, "
    "const float* decay, const int32_t* counted, uint32_t* rows, uint32_t* found, int32_t* held_out, "
    "int32_t* age_out, int32_t* counted_out, float* score_out, uint32_t* lane_rows, bool* lane_hit"
)
ARGS = (
    "cand, base, held, age, score, decay, counted, rows, found, held_out, age_out, counted_out, score_out, "
)
ARGS += "lane_rows, lane_hit"


def source(unit: str, units: list[int], template: dict, cand: str) -> str:
    arrays = ", ".join(f"const uint8_t* a{i}" for i in range(len(units)))
    names = ", ".join(f"a{i}" for i in range(len(units)))
    constants = "".join(f"    constexpr int {k} = {v};\n" for k, v in template.items())
    return f"""{PRELUDE}
typedef {cand} CAND;
static void kernel({arrays}, {PARAMS}) {{
{constants}{kept_rows_source(unit, units, kept_rows.AGE_EMPTY)}
}}
extern "C" void launch({arrays}, {PARAMS}, unsigned gx, unsigned gy, unsigned gz, unsigned tx) {{
    blockDim = uint3{{tx, 1, 1}};
    gridDim = uint3{{gx, gy, gz}};
    std::barrier<> bar(tx);
    g_bar = &bar;
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < tx; ++t)
        threads.emplace_back([&, t] {{
            threadIdx = uint3{{t, 0, 0}};
            for (unsigned z = 0; z < gz; ++z)
                for (unsigned y = 0; y < gy; ++y)
                    for (unsigned x = 0; x < gx; ++x) {{
                        blockIdx = uint3{{x, y, z}};
                        kernel({names}, {ARGS});
                        bar.arrive_and_wait();
                    }}
        }});
    for (auto& t : threads) t.join();
}}
"""


_built: dict = {}


def built(unit: str, units: list[int], template: dict, cand: str):
    key = (unit, tuple(units), tuple(template.items()), cand)
    if key not in _built:
        folder = Path(tempfile.mkdtemp())
        (folder / "k.cpp").write_text(source(unit, units, template, cand))
        command = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w", "k.cpp", "-o", "k.so"]
        subprocess.run(command, cwd=folder, check=True)
        _built[key] = ctypes.CDLL(str(folder / "k.so"))
    return _built[key]


class EmulatedRows(kept_rows.KeptRows):
    """`KeptRows` as on a device, its kernel emulated: the stacks' bytes live in numpy copies (`memory`)."""

    def __init__(self, stacks, *args):
        super().__init__(stacks, *args)
        self.on_device = True
        self.counts = tally.RunningCounts(len(stacks), device=True)
        self.memory = [[np.array(a) for a in stack.values()] for stack in stacks]

    def _launch(self, layer, cand, base, ahead):
        count = self.P if ahead else cand.size
        unit, units = row_units(self.stacks[layer].values())
        blocks = self.blocks if ahead else max(1, self.demand_blocks // count)
        threads = min(max(units), THREADS * blocks)
        tx = min(THREADS, threads)
        template = dict(
            E=self.E,
            C=self.C[layer],
            S=self.S,
            P=count,
            SCORES=int(ahead),
            DEMAND=int(not ahead),
            COPY=int(self.copy),
            COUNTS=int(self.decay is not None and not ahead),
        )
        cand_np = np.ascontiguousarray(np.array(cand))
        ctype = {np.dtype(np.uint32): "uint32_t", np.dtype(np.float32): "float"}[cand_np.dtype]
        lib = built(unit, list(units), template, ctype)
        E, S = self.E, self.S
        inputs = [
            cand_np,
            np.array(base).astype(np.uint32),
            np.array(self.held[layer]).astype(np.int32),
            np.array(self.age[layer]).astype(np.int32),
            np.array(self.score[layer]).astype(np.float32),
            np.array(self._decay_input).astype(np.float32),
            np.array(self.counts.on_device[layer]).astype(np.int32),
        ]
        outputs = [
            np.zeros(E, np.uint32),
            np.zeros(E, np.uint32),
            np.zeros(S, np.int32),
            np.zeros(S, np.int32),
            np.zeros(2, np.int32),
            np.zeros(E, np.float32),
            np.zeros(count, np.uint32),
            np.zeros(count, np.bool_),
        ]
        pointers = [a.ctypes.data_as(ctypes.c_void_p) for a in (*self.memory[layer], *inputs, *outputs)]
        grid = [(threads + tx - 1) // tx, count, len(units)]
        lib.launch(*pointers, *(ctypes.c_uint(g) for g in (*grid, tx)))
        rows, found, held, age, counted, score, lane_rows, lane_hit = (mx.array(a) for a in outputs)
        return [rows, found, held, age, counted, score, lane_rows, lane_hit]


def stacks(E: int, rows: int, sizes: list[int], seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [
        {
            ("p", f"a{i}"): mx.array(rng.integers(0, 255, (E + rows, n), dtype=np.uint8))
            for i, n in enumerate(sizes)
        }
    ]


def state(rows) -> tuple:
    if rows.on_device:
        return tuple(np.array(a[0]) for a in (rows.held, rows.age, rows.score))
    return rows._held_host[0], rows._age_host[0], rows._score_host[0]


def check(steps: int, E: int, C: int, S: int, P: int, sizes: list[int], seed: int) -> int:
    rng = np.random.default_rng(seed)
    failures = 0
    for decay in (None, 0.9):
        device = EmulatedRows(stacks(E, C + S, sizes, seed), E, [C], S, P)
        host = kept_rows.KeptRows(stacks(E, C + S, sizes, seed), E, [C], S, P)
        host.on_device = False
        for rows in (device, host):
            rows.decay = decay
        base = np.arange(E)
        base[rng.choice(E, C, replace=False)] = E + np.arange(C)  # C experts in slots
        base_mx = mx.array(base.astype(np.uint32))
        popular = rng.permutation(E)[: max(8, E // 3)]
        for step in range(steps):
            ahead = rng.random() < 0.2
            if ahead:
                cand = mx.array(rng.standard_normal(E).astype(np.float32))
            else:
                n = int(rng.choice([1, 2, 8, 8, 8, 16, 40, 64]))
                ids = np.where(rng.random(n) < 0.8, rng.choice(popular, n), rng.integers(0, E, n))
                cand = kept_rows.padded(mx.array(ids.astype(np.uint32)), E)
            outs = [rows._call(0, cand, base_mx, ahead) for rows in (device, host)]
            names = ("found", "rows", "lane_rows", "lane_hit")[: 2 if ahead else 4]
            bad = [k for k, a, b in zip(names, *outs) if not np.array_equal(np.array(a), np.array(b))]
            bad += [
                k
                for k, a, b in zip(("held", "age", "score"), state(device), state(host))
                if not np.array_equal(a, b)
            ]
            (copied, hits), (host_copied, host_hits) = device.read(), host.read()
            if not np.array_equal(copied, host_copied):
                bad.append(f"copies {copied[0]} != {host_copied[0]}")
            if not np.array_equal(hits, host_hits):
                bad.append(f"hit lanes {hits[0]} != {host_hits[0]}")
            if bad:
                failures += 1
                print(f"decay {decay} step {step} ({'ahead' if ahead else 'demand'}): differ in {bad}")
        same_bytes = all(
            np.array_equal(mine, np.array(theirs))
            for mine, theirs in zip(device.memory[0], host.stacks[0].values())
        )
        failures += not same_bytes
        print(f"E {E} S {S} decay {decay}: {steps} calls, stacks' bytes equal: {same_bytes}")
    return failures


def main():
    steps = int(sys.argv[1]) if len(sys.argv) > 1 else 200
    failures = 0
    # row bytes 12 and 4: 4-byte loads, 3 threads a block; 1024 and 12: 256 threads a block
    failures += check(steps, 128, 4, 32, 4, [12, 4], 1)
    failures += check(steps, 64, 0, 8, 8, [12, 4], 2)
    failures += check(max(20, steps // 10), 128, 4, 32, 4, [1024, 12], 3)
    print("kernel equals plan" if not failures else f"{failures} calls differ")
    raise SystemExit(1 if failures else 0)


if __name__ == "__main__":
    main()
