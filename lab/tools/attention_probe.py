"""Prefill milliseconds of stock mlx-lm, each (batch, length) shape the first time and once warm, under this
process's attention setting: what `backend.attention_choice` rests on (`docs/GPU.md`, "Time to first token").

    MLX_CUDA_USE_CUDNN_SDPA=1 python3 lab/tools/attention_probe.py MODEL
    MLX_CUDA_USE_CUDNN_SDPA=0 python3 lab/tools/attention_probe.py MODEL

MLX reads the variable at its first attention on the GPU, so each setting needs a process of its own; run
them alternating. The first process on a machine also compiles MLX's kernels (tens of seconds). One JSON
line: per shape, the first prefill and the median of 5 more (random token ids, a fresh KV cache each).
"""

import json
import os
import random
import statistics
import sys
import time

import mlx.core as mx
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

SHAPES = [(1, 9), (2, 9), (5, 9), (8, 13), (1, 128), (1, 512), (1, 2048), (8, 256)]


def main():
    model, _ = load(sys.argv[1])
    if mx.default_device() == mx.cpu:  # bfloat16 is slow on the CPU backend (od-moe casts there too)
        model.set_dtype(mx.float32)
    rng = random.Random(0)

    def prefill_ms(batch, length):
        cache = make_prompt_cache(model)
        x = mx.array([[rng.randrange(1, 1000) for _ in range(length)] for _ in range(batch)])
        mx.eval(x)
        started = time.perf_counter()
        mx.eval(model(x, cache=cache))
        return (time.perf_counter() - started) * 1e3

    prefill_ms(1, 8)
    report = {"MLX_CUDA_USE_CUDNN_SDPA": os.environ.get("MLX_CUDA_USE_CUDNN_SDPA")}
    for batch, length in SHAPES:
        first = prefill_ms(batch, length)
        warm = statistics.median(prefill_ms(batch, length) for _ in range(5))
        report[f"{batch}x{length}"] = {"first_ms": round(first, 1), "warm_ms": round(warm, 2)}
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
