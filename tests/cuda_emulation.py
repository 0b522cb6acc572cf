"""The two-tier path's CUDA kernels (`two_tier/kernels.py`) run on the CPU, for the tests: their sources
compiled as C++ with g++, CUDA's few names emulated.

The copy kernels (slot fills, `copy_rows`, `staged_lanes`), whose threads share nothing: `cuda_kernel`
stands in for `mx.fast.cuda_kernel`, so the code that launches them runs as on a device, each kernel declared
as MLX's CUDA backend declares it and its grid run one thread at a time, on the inputs' own bytes.

The device-kept rows' kernel (`kernels.kept_rows_source`), whose threads synchronise: each block's threads
are real threads (one per thread of the block), `__shared__` memory a static they share, `__syncthreads` a
barrier, `__syncthreads_or` a barrier and a flag, `atomicAdd` and `atomicMin` atomics; blocks run one after
another over the grid MLX would launch (threads, candidates, arrays). `EmulatedRows` is a `KeptRows` that
decides in it, as on a device, its stacks' bytes in numpy copies (`memory`). `differences` holds a
`KeptRows` deciding elsewhere (here, or on a device: `lab/tools/kept_rows_check.py`) to `kept_rows.plan`.

What it shows: the kernels' decisions, early exits, synchronisation (a block whose threads leave at
different barriers hangs here as on a GPU), copies, and the grids their launches ask for. What it does not:
NVRTC's compile (`lab/tools/nvrtc_check.py`), CUDA's memory model, what threads running at once would race
on, timing (`lab/tools/kept_rows_check.py`, on a device).
"""

import ctypes
import subprocess
import tempfile
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from od_moe.two_tier import kept_rows
from od_moe.two_tier.kernels import (
    FUSED_OUTPUTS,
    KEPT_ROWS_INPUTS,
    KEPT_ROWS_OUTPUTS,
    kept_rows_parameters,
    kept_rows_source,
    row_units,
)
from od_moe.two_tier.settings import KeptRowsSettings

# CUDA's names a kernel's body uses, for one compiled as C++; `PRELUDE` adds its threads' synchronisation
_NAMES = r"""
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <algorithm>
using std::min;
using std::size_t;
struct uint3 { unsigned x, y, z; };
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
struct __half { uint16_t x; };
struct __nv_bfloat16 { uint16_t x; };
thread_local uint3 threadIdx, blockIdx;
static uint3 blockDim, gridDim;
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fmul_rn(float a, float b) { return a * b; }
#define __shared__ static
"""

PRELUDE = (
    _NAMES
    + r"""
#include <atomic>
#include <barrier>
#include <thread>
#include <vector>
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
"""
)


def _signature(tables: bool) -> tuple[str, str]:
    """The kernel's parameters after the stack's arrays, as MLX would declare them, and their names."""
    outputs = KEPT_ROWS_OUTPUTS if tables else FUSED_OUTPUTS
    return ", ".join(kept_rows_parameters(tables, cand="CAND")), ", ".join((*KEPT_ROWS_INPUTS, *outputs))


def source(unit: str, units: list[int], template: dict, cand: str) -> str:
    """C++ for the kernel with `template`'s constants, its candidates of C type `cand`, and `launch`, which
    runs its grid (blocks of the grid's x, candidates, arrays; `tx` threads a block)."""
    arrays = ", ".join(f"const uint8_t* a{i}" for i in range(len(units)))
    names = ", ".join(f"a{i}" for i in range(len(units)))
    constants = "".join(f"    constexpr int {k} = {v};\n" for k, v in template.items())
    tables = bool(template["TABLES"])
    params, args = _signature(tables)
    return f"""{PRELUDE}
typedef {cand} CAND;
static void kernel({arrays}, {params}) {{
{constants}{kept_rows_source(unit, units, kept_rows.AGE_EMPTY, tables)}
}}
extern "C" void launch({arrays}, {params}, unsigned gx, unsigned gy, unsigned gz, unsigned tx) {{
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
                        kernel({names}, {args});
                        bar.arrive_and_wait();
                    }}
        }});
    for (auto& t : threads) t.join();
}}
"""


_built: dict = {}
_folder = tempfile.TemporaryDirectory(prefix="od-moe-kernel-")


def compiled(text: str):
    """C++ `text` compiled with g++ (once a process) and loaded."""
    if text not in _built:
        name = Path(_folder.name) / f"k{len(_built)}"
        command = ["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w"]
        cpp, so = name.with_suffix(".cpp"), name.with_suffix(".so")
        cpp.write_text(text)
        subprocess.run([*command, str(cpp), "-o", str(so)], check=True)
        _built[text] = ctypes.CDLL(str(so))
    return _built[text]


def built(unit: str, units: list[int], template: dict, cand: str):
    """The kept rows' kernel for these settings, compiled and loaded."""
    return compiled(source(unit, units, template, cand))


# the C type MLX's CUDA backend declares each dtype as (`dtype_to_cuda_type`)
_C_TYPES = {
    mx.bool_: "bool",
    mx.uint8: "uint8_t",
    mx.uint16: "uint16_t",
    mx.uint32: "uint32_t",
    mx.uint64: "uint64_t",
    mx.int8: "int8_t",
    mx.int16: "int16_t",
    mx.int32: "int32_t",
    mx.int64: "int64_t",
    mx.float16: "__half",
    mx.bfloat16: "__nv_bfloat16",
    mx.float32: "float",
}
SENTINEL = 0xA5  # every byte of an output the kernel leaves unwritten (MLX does not clear its outputs)


def _address(array: mx.array) -> tuple[int, memoryview | None]:
    """The address of `array`'s bytes, which the kernel reads and may write, as on a device (and the view
    that keeps them)."""
    if array.size == 0:
        return 0, None
    view = memoryview(array)
    return ctypes.addressof(ctypes.c_char.from_buffer(view)), view


class EmulatedKernel:
    """What `mx.fast.cuda_kernel` returns, for a kernel with no synchronisation between its threads: called
    as MLX calls it, it declares the kernel as MLX's CUDA backend does (inputs `const T*`, outputs `T*`,
    the template's values `constexpr`), compiles it for the CPU and runs its grid, every thread of every
    block one after another. It reads and writes the inputs' own bytes, as a kernel does on a device; its
    outputs start as `SENTINEL` bytes."""

    def __init__(self, name, input_names, output_names, source, header="", **_):
        for n in input_names:
            if any(f"{n}_{what}" in source for what in ("shape", "strides", "ndim")):
                raise NotImplementedError(f"{name}: the emulation passes no {n}_shape, _strides or _ndim")
        if "__syncthreads" in source:
            raise NotImplementedError(f"{name}: its threads synchronise; the emulation runs them in turn")
        self.name, self.header, self.source = name, header, source
        self.input_names, self.output_names = list(input_names), list(output_names)

    def _text(self, inputs, output_dtypes, template) -> str:
        params = [f"const {_C_TYPES[a.dtype]}* {n}" for n, a in zip(self.input_names, inputs)]
        params += [f"{_C_TYPES[t]}* {n}" for n, t in zip(self.output_names, output_dtypes)]
        constants = ""
        for n, v in template or []:
            if isinstance(v, mx.Dtype):
                constants += f"    using {n} = {_C_TYPES[v]};\n"
            else:
                constants += f"    constexpr {'bool' if isinstance(v, bool) else 'int'} {n} = {int(v)};\n"
        casts = ", ".join(f"({p.rsplit(' ', 1)[0]})p[{i}]" for i, p in enumerate(params))
        return f"""{_NAMES}{self.header}
static void kernel({", ".join(params)}) {{
{constants}{self.source}
}}
extern "C" void launch(void** p, const unsigned* d) {{  // d: the grid's blocks, then a block's threads
    gridDim = uint3{{d[0], d[1], d[2]}};
    blockDim = uint3{{d[3], d[4], d[5]}};
    for (unsigned z = 0; z < gridDim.z; ++z)
        for (unsigned y = 0; y < gridDim.y; ++y)
            for (unsigned x = 0; x < gridDim.x; ++x)
                for (unsigned k = 0; k < blockDim.z; ++k)
                    for (unsigned j = 0; j < blockDim.y; ++j)
                        for (unsigned i = 0; i < blockDim.x; ++i) {{
                            blockIdx = uint3{{x, y, z}};
                            threadIdx = uint3{{i, j, k}};
                            kernel({casts});
                        }}
}}
"""

    def __call__(self, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, **options):
        """The kernel run on `inputs`: its outputs, as MLX's call gives them."""
        mx.eval(inputs)
        inputs = [a if a.size == 0 or memoryview(a).c_contiguous else mx.contiguous(a) for a in inputs]
        init = options.get("init_value")
        outputs = [
            mx.array(np.full(int(np.prod(shape)) * t.size, SENTINEL, np.uint8))
            if init is None
            else mx.array(np.full(shape, init, np.float32)).astype(t)
            for shape, t in zip(output_shapes, output_dtypes)
        ]
        mx.eval(inputs, outputs)
        held = [_address(a) for a in (*inputs, *outputs)]
        pointers = (ctypes.c_void_p * len(held))(*(address for address, _ in held))
        blocks = [(g + t - 1) // t for g, t in zip(grid, threadgroup)]
        lib = compiled(self._text(inputs, output_dtypes, template))
        lib.launch(pointers, (ctypes.c_uint * 6)(*blocks, *threadgroup))
        del held
        return [a.view(t).reshape(shape) for a, shape, t in zip(outputs, output_shapes, output_dtypes)]


def cuda_kernel(name, input_names, output_names, source, header="", **options) -> EmulatedKernel:
    """`mx.fast.cuda_kernel` for the CPU (`EmulatedKernel`): monkeypatched in, the two-tier code launches
    its kernels here."""
    return EmulatedKernel(name, input_names, output_names, source, header, **options)


class EmulatedRows(kept_rows.KeptRows):
    """`KeptRows` as on a device, its kernel emulated: the stacks' bytes live in numpy copies (`memory`)."""

    def __init__(self, stacks, num_experts, slots, rows, settings):
        super().__init__(stacks, num_experts, slots, rows, replace(settings, by_kernel=True))
        self.memory = [[np.array(a) for a in stack.values()] for stack in stacks]

    def _launch(self, layer, cand, base, ahead):
        count = self.predicted if ahead else cand.size
        return self._kernel_call(layer, count, ahead)(None, cand, base, *self._rows_state(layer))

    def _kernel_call(self, layer, count, ahead, tables=True, lanes=None):
        """The kernel's call as `KeptRows` makes it, run here at once: inputs (arrays, cand, base, the rows'
        state), the arrays ignored (the kernel copies within `memory`)."""
        settings = self.launch_settings(layer, count, ahead, tables, lanes)
        unit, units = row_units(self.stacks[layer].values())
        k = len(units)

        def call(*inputs):
            cand_np = np.ascontiguousarray(np.array(inputs[-7]))
            ctype = {np.dtype(np.uint32): "uint32_t", np.dtype(np.float32): "float"}[cand_np.dtype]
            lib = built(unit, list(units), dict(settings["template"]), ctype)
            base, *state = (np.array(a) for a in inputs[-6:])
            given = [cand_np, base.astype(np.uint32), *state]
            dtypes = {mx.uint32: np.uint32, mx.int32: np.int32, mx.float32: np.float32, mx.bool_: np.bool_}
            shapes, types = settings["output_shapes"], settings["output_dtypes"]
            outputs = [np.zeros(shape, dtypes[t]) for shape, t in zip(shapes, types)]
            arrays = self.memory[layer][:k]
            pointers = [a.ctypes.data_as(ctypes.c_void_p) for a in (*arrays, *given, *outputs)]
            (threads, gy, gz), (tx, _, _) = settings["grid"], settings["threadgroup"]
            lib.launch(*pointers, *(ctypes.c_uint(g) for g in ((threads + tx - 1) // tx, gy, gz, tx)))
            return [mx.array(a) for a in outputs]

        return call


def stacks(E: int, rows: int, sizes: list[int], seed: int) -> list[dict]:
    """One layer's stack: random bytes, rows of `sizes` bytes per array, E experts and `rows` more."""
    rng = np.random.default_rng(seed)
    return [
        {
            ("p", f"a{i}"): mx.array(rng.integers(0, 255, (E + rows, n), dtype=np.uint8))
            for i, n in enumerate(sizes)
        }
    ]


def _state(rows) -> tuple:
    if rows.on_device:
        return tuple(np.array(a[0]) for a in (rows.held, rows.age, rows.score))
    return rows._held_host[0], rows._age_host[0], rows._score_host[0]


def _bytes(rows) -> list[np.ndarray]:
    """Layer 0's stack arrays as `rows` holds them: the emulation's copies, else the arrays themselves."""
    if isinstance(rows, EmulatedRows):
        return rows.memory[0]
    return [np.array(a) for a in rows.stacks[0].values()]


def differences(
    steps: int, E: int, C: int, S: int, P: int, sizes: list[int], seed: int, decay, deciding=None
) -> list[str]:
    """Two `KeptRows` over copies of the same random stacks given the same `steps` calls (demand calls of
    1-64 routed lanes with repeats, padding and experts in slots, half of them as a fused pass makes them:
    lanes' rows, no tables; one in five a prediction, top-P of scores),
    one deciding in the kernel (`deciding`: `EmulatedRows` by default; `KeptRows` on a device runs the CUDA
    kernel), one in `kept_rows.plan`: what differed after each call (tables, each lane's row and hit, the rows
    held, their ages and scores, copies, hit lanes), and at the end in the stacks' bytes."""
    rng = np.random.default_rng(seed)
    settings = KeptRowsSettings(predicted=P, decay=decay)
    device = (deciding or EmulatedRows)(stacks(E, C + S, sizes, seed), E, [C], S, settings)
    host = kept_rows.KeptRows(stacks(E, C + S, sizes, seed), E, [C], S, replace(settings, by_kernel=False))
    base = np.arange(E)
    base[rng.choice(E, C, replace=False)] = E + np.arange(C)  # C experts in slots
    base_mx = mx.array(base.astype(np.uint32))
    popular = rng.permutation(E)[: max(8, E // 3)]  # routing leans on a few experts: rows hit and evicted
    found = []
    for step in range(steps):
        ahead = rng.random() < 0.2
        if ahead:
            cand = mx.array(rng.standard_normal(E).astype(np.float32))
        else:
            n = int(rng.choice([1, 2, 8, 8, 8, 16, 40, 64]))
            ids = np.where(rng.random(n) < 0.8, rng.choice(popular, n), rng.integers(0, E, n))
            cand = kept_rows.padded(mx.array(ids.astype(np.uint32)), E)
        fused = not ahead and rng.random() < 0.5  # as a decode pass calls it (`fused_lanes`): no tables
        if fused:
            lanes = device.fused_lanes(0, base_mx)
            _, read, outputs = lanes.read(mx.array(ids.astype(np.uint32)), *lanes.inputs)
            device.keep(0, outputs["rows"])
            lanes = host._call(0, cand, base_mx, ahead)[2][:n]
            bad = [] if np.array_equal(np.array(read), np.array(lanes)) else ["lane_rows"]
        else:
            outs = [rows._call(0, cand, base_mx, ahead) for rows in (device, host)]
            names = ("found", "rows", "lane_rows", "lane_hit")[: 2 if ahead else 4]
            bad = [k for k, a, b in zip(names, *outs) if not np.array_equal(np.array(a), np.array(b))]
        bad += [
            k
            for k, a, b in zip(("held", "age", "score"), _state(device), _state(host))
            if not np.array_equal(a, b)
        ]
        counts, host_counts = device.read(), host.read()
        bad += [
            k for k, a, b in zip(("copies", "hit lanes"), counts, host_counts) if not np.array_equal(a, b)
        ]
        kind = "ahead" if ahead else "fused" if fused else "demand"
        found += [f"step {step} ({kind}): {k}" for k in bad]
    for i, (mine, theirs) in enumerate(zip(_bytes(device), _bytes(host))):
        if not np.array_equal(mine, theirs):
            found.append(f"array {i}'s bytes")
    return found
