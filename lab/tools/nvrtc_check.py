"""Compile od-moe's CUDA kernel sources with NVRTC on a machine with no GPU: the device-kept rows' kernel
(`two_tier/kernels.kept_rows_source`) wrapped as MLX's `mx.fast.cuda_kernel` wraps it (its inputs and outputs
as pointers, its template arguments as constants), for each mode the runtime launches. A source that fails
here would fail at its first call on the device, where a machine's minutes are counted.

    pip download --no-deps nvidia-cuda-nvrtc-cu12 -d /tmp/nvw && unzip -o /tmp/nvw/*.whl -d /tmp/nvw/x
    NVRTC=/tmp/nvw/x/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 python3 lab/tools/nvrtc_check.py

Not a test (CI has no NVRTC) and not a check of what the kernel computes: `lab/tools/kept_rows_check.py`
compares that with `kept_rows.plan` on a device, and the suite on the CPU through g++
(`tests/cuda_emulation.py`).
"""

import ctypes
import itertools
import os

from od_moe.two_tier.kept_rows import AGE_EMPTY
from od_moe.two_tier.kernels import kept_rows_parameters, kept_rows_source

PRELUDE = """
typedef unsigned int uint32_t;
typedef int int32_t;
typedef unsigned short uint16_t;
typedef unsigned char uint8_t;
typedef unsigned long long size_t_;
#define INFINITY __int_as_float(0x7f800000)
"""


def wrapped(units: list[int], template: dict) -> str:
    tables = bool(template["TABLES"])
    params = [f"const uint4* a{i}" for i in range(len(units))] + kept_rows_parameters(tables)
    constants = "".join(f"  constexpr int {k} = {v};\n" for k, v in template.items())
    body = kept_rows_source("uint4", units, AGE_EMPTY, tables)
    return f"{PRELUDE}\n__global__ void kept_rows({', '.join(params)}) {{\n{constants}{body}\n}}\n"


def compile_source(nvrtc, source: str) -> str:
    program = ctypes.c_void_p()
    check(nvrtc, nvrtc.nvrtcCreateProgram(ctypes.byref(program), source.encode(), b"k.cu", 0, None, None))
    options = [b"--gpu-architecture=compute_90", b"--std=c++17"]
    status = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(program, log)
    return "" if status == 0 else log.value.decode()


def check(nvrtc, status: int):
    if status:
        raise RuntimeError(nvrtc.nvrtcGetErrorString(status))


def main():
    nvrtc = ctypes.CDLL(os.environ.get("NVRTC", "libnvrtc.so.12"))
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p
    units = [49152, 3072, 3072]
    failed = 0
    for scores, counts, copy, tables, (E, S, P) in itertools.product(
        (0, 1), (0, 1), (0, 1), (0, 1), [(128, 32, 8), (512, 128, 64), (64, 300, 8)]
    ):
        N = P if scores or tables else P - 3  # a fused pass's call may be given fewer than P candidates
        template = dict(E=E, C=0, S=S, P=P, N=N, SCORES=scores, DEMAND=1 - scores, COPY=copy, COUNTS=counts)
        template["TABLES"] = tables
        log = compile_source(nvrtc, wrapped(units, template))
        failed += bool(log)
        print(template, "ok" if not log else f"FAILED\n{log}")
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
