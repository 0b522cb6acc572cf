"""A decoded token's device time by kernel on CUDA, from NVIDIA Nsight Compute: stock mlx-lm against two-tier
rows of a model (the widened x128 copy by default), to tell a row bound by its device work from one bound by
its host.

    python3 lab/tools/kernel_time.py wall [WORKDIR|MODEL] [MODE,MODE...]
    ncu --profile-from-start off --clock-control none --cache-control none \
        --metrics gpu__time_duration.sum --csv --graph-profiling node \
        python3 lab/tools/kernel_time.py run MODE [WORKDIR|MODEL] > MODE.csv
    python3 lab/tools/kernel_time.py sum MODE.csv TOKENS

A MODEL is a folder with a config.json (a real shape, `od_moe/bench/real_shapes.py`); a WORKDIR is where
the widened copy is made (/tmp/odb by default). TOKENS (environment, default 8): decoded tokens profiled.

`wall`: ms a decoded token of stock and of every mode in one process (mlx-lm's loop, the bench's 3 prompts x
48 tokens, median of 3 rounds), and whether the texts equal stock's. `run`: one mode's decoding, the profiler
on for `TOKENS` decoded tokens after a warm-up (Nsight Compute times each kernel of MLX's CUDA graphs apart:
durations, not the gaps between them). `sum`: the kernels a token, their busy ms a token, and the largest by
name, with a call's median and p10-p90 (the kept rows' calls that copy apart from those that do not). MODE:
`stock`; `mapped` (two-tier, no experts in slots: every decode pass copies its lanes from host memory,
`two_tier/staged_passes.py`); `device` (the same engine with its stacks moved to device memory: the same
operations with no bytes on the bus); `lru:F` and `tt:F` (device-kept rows and counted slots at a fraction F
of experts on the device, as `benchmarks/two_tier.py` names its rows).

With `--graph-profiling graph` instead, Nsight Compute times each of MLX's CUDA graphs as one workload, so
`sum`'s "kernels a token" counts the graphs MLX ended a token (`needs_commit` in
`mlx/backend/cuda/device.cpp`: past 100 operations, or past 1,000 MB of inputs on an H100).

Not a test or a bench row: a measurement for docs/GPU.md ("The 0% row's floor"). CUDA only.
"""

import collections
import csv
import ctypes
import os
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx_lm

import od_moe
from od_moe.bench.foundation import PROMPTS
from od_moe.bench.widen import widen_model
from od_moe.memory import backend

TOKENS = int(os.environ.get("TOKENS", 8))
MODES = ("stock", "mapped", "device")
COPYING_US = 30  # a kept rows' call longer than this copied (one 2.65 MB expert: about 50 us)


def generator(mode: str, path: str):
    """`generate(prompt, tokens)` yielding mlx-lm responses, for `mode`."""
    if mode == "stock":
        model, tokenizer = mlx_lm.load(path)
        if backend.compute_dtype() is not None:  # the cast od-moe makes (float32 on the CPU)
            model.set_dtype(backend.compute_dtype())
        return lambda prompt, n: mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=n)
    if ":" in mode:  # lru:F or tt:F
        kind, fraction = mode.split(":")
        engine = od_moe.load(path, capacity=float(fraction), two_tier="lru" if kind == "lru" else True)
        return lambda prompt, n: engine.stream_generate(prompt, max_tokens=n)
    engine = od_moe.load(path, capacity=0.0, two_tier=True)
    if mode == "device":
        stacks_to_device(engine)
    return lambda prompt, n: engine.stream_generate(prompt, max_tokens=n)


def stacks_to_device(engine):
    """Every expert stack of a two-tier `engine` preferred on the device and moved there: the same
    operations, no bytes on the bus."""
    for stack in engine.runtime.stacks:
        for array in stack.values():
            backend.map_for_device(array, array.nbytes)


def decode(generate, tokens: int = 48) -> tuple[list[str], float]:
    """Texts of the bench's prompts (one warm-up first) and ms a decoded token, median of 3 rounds."""
    list(generate(PROMPTS[0], tokens))
    texts, runs = [], []
    for _ in range(3):
        for prompt in PROMPTS:
            times, text = [], ""
            for response in generate(prompt, tokens):
                times.append(time.perf_counter())
                text += response.text
            texts.append(text)
            runs.append((times[-1] - times[0]) / (len(times) - 1) * 1e3)
    return texts, statistics.median(runs)


def wall(path: str, modes=MODES):
    texts = {}
    for mode in modes:
        texts[mode], ms = decode(generator(mode, path))
        same = texts[mode] == texts["stock"]
        print(f"{mode}: {ms:.3f} ms a decoded token; texts equal stock's: {same}")


def run(mode: str, path: str):
    found = (line.split()[-1] for line in open("/proc/self/maps") if "libcudart.so" in line)
    cudart = ctypes.CDLL(next(found, "libcudart.so.13"))
    generate = generator(mode, path)
    list(generate(PROMPTS[0], 24))
    for i, _ in enumerate(generate(PROMPTS[1], TOKENS + 2)):
        if i in (1, TOKENS + 1):  # from the first decoded token's response to the last's
            mx.synchronize()
            (cudart.cudaProfilerStart if i == 1 else cudart.cudaProfilerStop)()


def summary(csv_path: str, tokens: int, shown: int = 14):
    rows = list(csv.reader(line for line in open(csv_path) if line.startswith('"')))
    head, rows = rows[0], rows[1:]
    name, value, unit = (head.index(k) for k in ("Kernel Name", "Metric Value", "Metric Unit"))
    us = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
    busy, calls, each = collections.Counter(), collections.Counter(), collections.defaultdict(list)
    for row in rows:
        kernel = row[name].split("(")[0].split("<")[0]
        took = float(row[value].replace(",", "")) * us[row[unit]]
        busy[kernel] += took
        calls[kernel] += 1
        each[kernel].append(took)
    print(
        f"{csv_path}: {len(rows) / tokens:.0f} kernels a token, {sum(busy.values()) / tokens / 1e3:.3f} ms"
        " busy a token"
    )
    for kernel, total in busy.most_common(shown):
        q = statistics.quantiles(each[kernel], n=10) if len(each[kernel]) > 1 else each[kernel] * 9
        spread = f"median {statistics.median(each[kernel]):.1f}, p10-p90 {q[0]:.1f}-{q[-1]:.1f} us"
        print(f"  {total / tokens:8.1f} us a token  {calls[kernel] / tokens:5.1f} calls  {spread}  {kernel}")
    kept = [k for k in busy if "od_moe_lookahead" in k or "od_moe_fused" in k]
    for kernel in kept:  # the kept rows' calls, copying or not
        for label, part in (
            ("no copy", [t for t in each[kernel] if t <= COPYING_US]),
            ("copying", [t for t in each[kernel] if t > COPYING_US]),
        ):
            if part:
                print(
                    f"  {label}: {len(part) / tokens:.1f} calls a token,"
                    f" median {statistics.median(part):.1f} us, {sum(part) / tokens:.1f} us a token  {kernel}"
                )


def main():
    command, *rest = sys.argv[1:]
    if command == "sum":  # the tokens the run profiled: its TOKENS
        return summary(rest[0], int(rest[1]))
    mode, rest = (rest[0], rest[1:]) if command == "run" else (None, rest)
    where = Path(rest[0] if rest else "/tmp/odb")
    if (where / "config.json").exists():
        path = str(where)
    else:
        path = str(widen_model(od_moe.DEFAULT_MODEL, where / "widened-x128", 128))
    if command == "wall":
        wall(path, tuple(rest[1].split(",")) if len(rest) > 1 else MODES)
    else:
        run(mode, path)


if __name__ == "__main__":
    main()
