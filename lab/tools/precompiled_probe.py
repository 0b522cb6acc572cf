"""Lab (issue #56, item 2): what a process pays to compile the kept rows' kernel, against loading PTX that
an earlier process compiled, on a device (not product code).

MLX looks for a custom kernel in its PTX cache but never writes one there (docs/GPU.md, "Time to first
token"), so each process compiles od-moe's kernels with NVRTC. `mx.fast.precompiled_cuda_kernel` takes PTX
instead. This times, for one demand call of the kept rows' kernel (128 experts, 32 rows, 8 candidates):

    python3 lab/tools/precompiled_probe.py compile   # the call through mx.fast.cuda_kernel, first and second;
                                                     # NVRTC here; the precompiled call, first and second;
                                                     # PTX kept in /tmp/od-moe-probe.ptx
    python3 lab/tools/precompiled_probe.py load      # a new process: the precompiled call from that PTX

and checks that both calls give the same outputs. NVRTC is the library MLX loaded (found in this process's
maps after its first compile); the architecture is `nvidia-smi`'s compute capability.
"""

import ctypes
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
from nvrtc_check import PRELUDE, check

from od_moe.two_tier import kept_rows
from od_moe.two_tier.kernels import kept_rows_source, row_units
from od_moe.two_tier.settings import KeptRowsSettings

PTX = Path("/tmp/od-moe-probe.ptx")
E, S, COUNT = 128, 32, 8
SIZES = [786432, 49152, 49152]  # one projection's weight, scales and biases rows at Qwen3-30B-A3B's shape


def setup():
    rng = np.random.default_rng(0)
    stack = {
        ("p", f"a{i}"): mx.array(rng.integers(0, 255, (E + S, n), dtype=np.uint8))
        for i, n in enumerate(SIZES)
    }
    # decide only, copy nothing: every call sees the same state
    rows = kept_rows.KeptRows([stack], E, [0], S, KeptRowsSettings(predicted=COUNT, copy=False))
    cand = mx.array(np.arange(COUNT, dtype=np.uint32) * 3)
    base = mx.arange(E, dtype=mx.uint32)
    inputs = [*stack.values(), cand, base, rows.held[0], rows.age[0], rows.score[0], rows._decay_input]
    inputs.append(rows.counts.of(0))
    mx.eval(inputs)
    return rows, cand, base, inputs


def source(rows) -> str:
    settings = rows.launch_settings(0, COUNT, False)
    units = row_units(rows.stacks[0].values())
    arrays = [f"const unsigned char* a{i}" for i in range(len(units[1]))]
    params = arrays + [
        "const uint32_t* cand", "const uint32_t* base", "const int32_t* held", "const int32_t* age",
        "const float* score", "const float* decay", "const int32_t* counted", "uint32_t* rows",
        "uint32_t* found", "int32_t* held_out", "int32_t* age_out", "int32_t* counted_out",
        "float* score_out", "uint32_t* lane_rows", "bool* lane_hit",
    ]  # fmt: skip
    constants = "".join(f"  constexpr int {k} = {v};\n" for k, v in settings["template"])
    body = kept_rows_source(*units, kept_rows.AGE_EMPTY)
    signature = f'extern "C" __global__ void od_moe_probe({", ".join(params)})'
    return f"{PRELUDE}\n{signature} {{\n{constants}{body}\n}}\n"


def nvrtc_compile(src: str) -> bytes:
    path = next(line.split()[-1] for line in open("/proc/self/maps") if "libnvrtc.so" in line)
    nvrtc = ctypes.CDLL(path)
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    cap = subprocess.run(
        ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True
    )
    arch = cap.stdout.decode().split()[0].replace(".", "")
    program = ctypes.c_void_p()
    check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(program), src.encode(), b"k.cu", 0, None, None))
    options = [f"--gpu-architecture=compute_{arch}".encode(), b"--std=c++17"]
    status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    if status:
        size = ctypes.c_size_t()
        nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        nvrtc.nvrtcGetProgramLog(program, log)
        raise RuntimeError(log.value.decode())
    size = ctypes.c_size_t()
    check(nvrtc, nvrtc.nvrtcGetPTXSize(program, ctypes.byref(size)))
    ptx = ctypes.create_string_buffer(size.value)
    check(nvrtc, nvrtc.nvrtcGetPTX(program, ptx))
    return ptx.raw


def precompiled(rows, inputs, ptx: bytes):
    settings = rows.launch_settings(0, COUNT, False)
    return mx.fast.precompiled_cuda_kernel(
        name="od_moe_probe",
        compiled_source=ptx,
        inputs=inputs,
        output_shapes=settings["output_shapes"],
        output_dtypes=settings["output_dtypes"],
        scalars=[],
        grid=settings["grid"],
        threadgroup=settings["threadgroup"],
    )


def timed(label: str, call):
    mx.synchronize()
    t0 = time.perf_counter()
    out = call()
    mx.eval(out)
    print(f"{label}: {(time.perf_counter() - t0) * 1e3:.1f} ms")
    return out


def main():
    rows, cand, base, inputs = setup()
    if sys.argv[1] == "load":
        timed("precompiled, first call in a new process", lambda: precompiled(rows, inputs, PTX.read_bytes()))
        timed("precompiled, second call", lambda: precompiled(rows, inputs, PTX.read_bytes()))
        return
    first = timed("mx.fast.cuda_kernel, first call (NVRTC)", lambda: rows._launch(0, cand, base, False))
    timed("mx.fast.cuda_kernel, second call", lambda: rows._launch(0, cand, base, False))
    t0 = time.perf_counter()
    ptx = nvrtc_compile(source(rows))
    print(f"NVRTC to PTX here: {(time.perf_counter() - t0) * 1e3:.1f} ms, {len(ptx)} bytes")
    PTX.write_bytes(ptx)
    out = timed("precompiled, first call", lambda: precompiled(rows, inputs, ptx))
    timed("precompiled, second call", lambda: precompiled(rows, inputs, ptx))
    same = all(np.array_equal(np.array(a), np.array(b)) for a, b in zip(first, out))
    print(f"same outputs: {same}")


if __name__ == "__main__":
    main()
