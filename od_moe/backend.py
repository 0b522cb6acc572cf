"""Backend-specific choices, kept in one place: compute dtype and memory queries.

MLX runs on Metal (macOS), CUDA and the CPU. They differ in what is fast and what they can report:
- On the CPU backend `GatherMM` (unquantized experts) supports float32 only, and float32 scales make the
  quantized kernels several times faster than bfloat16, so floating weights are cast to float32 there.
  On GPUs the checkpoint's dtype is kept.
- Metal reports a recommended working-set size; on Linux the OS reports available memory.
Nothing else in od-moe asks which backend it is on.
"""

import os
import sys
from typing import Optional

import mlx.core as mx


def is_cpu_backend() -> bool:
    """True when MLX computes on the CPU (no Metal, no CUDA)."""
    return mx.default_device().type == mx.cpu


def compute_dtype(requested: str = "auto") -> Optional[mx.Dtype]:
    """The floating dtype weights are cast to, or None to keep the checkpoint's.

    requested: "auto" (float32 on the CPU backend, the checkpoint's dtype elsewhere), "model" (never
    cast), or a dtype name such as "float32", "float16", "bfloat16".
    """
    if requested == "model":
        return None
    if requested == "auto":
        return mx.float32 if is_cpu_backend() else None
    try:
        dtype = getattr(mx, requested)
    except AttributeError:
        dtype = None
    if not isinstance(dtype, mx.Dtype) or not mx.issubdtype(dtype, mx.floating):
        from .errors import UserError

        raise UserError(f"unknown dtype {requested!r}: use auto, model, float32, float16 or bfloat16")
    return dtype


def cast_floating(array: mx.array, dtype: Optional[mx.Dtype]) -> mx.array:
    """Cast a floating array to `dtype` (None: unchanged); integer (packed) arrays are left alone."""
    if dtype is None or not mx.issubdtype(array.dtype, mx.floating) or array.dtype == dtype:
        return array
    return array.astype(dtype)


def available_memory_bytes() -> int:
    """Memory od-moe may plan to use: Metal's recommended working set on macOS, else what the OS says
    is available (Linux MemAvailable), else physical memory."""
    if sys.platform == "darwin" and mx.metal.is_available():
        return int(mx.device_info()["max_recommended_working_set_size"])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def peak_memory_bytes() -> int:
    """Peak memory held by MLX arrays since the last reset (all backends track this)."""
    return int(mx.get_peak_memory())


def reset_peak_memory() -> None:
    mx.reset_peak_memory()


def active_memory_bytes() -> int:
    return int(mx.get_active_memory())
