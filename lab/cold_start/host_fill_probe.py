"""Lab (issue #56): what it costs to fill host-resident MLX arrays (managed memory on CUDA) with expert
bytes, per way of doing it, in GB/s over GB total (not product code). Each way runs on fresh arrays of
CHUNK bytes; the source is a file in the page cache, as a checkpoint is on a warm start.
`runs/host-fill-probe-h200.txt` came before rows cleared MLX's cache: there, rows after the first
`del kept` reused touched buffers.

  python3 lab/cold_start/host_fill_probe.py [GB] [THREADS]
"""

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from od_moe.memory import backend

GB = float(sys.argv[1]) if len(sys.argv) > 1 else 4.0
THREADS = int(sys.argv[2]) if len(sys.argv) > 2 else 4
CHUNK = 256 * 2**20
N = int(GB * 2**30 // CHUNK)
PATH = "/tmp/host_fill_probe.bin"

if not os.path.exists(PATH) or os.path.getsize(PATH) != CHUNK * N:
    with open(PATH, "wb") as f:
        block = np.random.default_rng(0).integers(0, 2**32, CHUNK // 4, dtype=np.uint32).tobytes()
        for _ in range(N):
            f.write(block)
fd = os.open(PATH, os.O_RDONLY)
for i in range(N):  # into the page cache
    os.pread(fd, CHUNK, i * CHUNK)


def zeros():
    a = mx.zeros((CHUNK // 4,), dtype=mx.uint32, stream=mx.cpu)
    mx.eval(a)
    return a, np.array(a, copy=False)


def timed(name, make):
    mx.clear_cache()  # each row on fresh memory, not on buffers an earlier row left in MLX's cache
    kept = []
    start = time.perf_counter()
    for i in range(N):
        kept.append(make(i))
    mx.synchronize()
    seconds = time.perf_counter() - start
    print(f"{name:<42} {seconds:7.2f} s  {N * CHUNK / seconds / 1e9:6.2f} GB/s", flush=True)
    return kept


staging = np.empty(CHUNK // 4, dtype=np.uint32)


def pread_into(view, i, parts=1):
    step = CHUNK // parts
    raw = view.view(np.uint8)
    for p in range(parts):
        os.preadv(fd, [memoryview(raw[p * step : (p + 1) * step])], i * CHUNK + p * step)


pool = ThreadPoolExecutor(THREADS)


def threaded_pread(view, i):
    raw = view.view(np.uint8)
    step = CHUNK // THREADS
    list(
        pool.map(
            lambda p: os.preadv(fd, [memoryview(raw[p * step : (p + 1) * step])], i * CHUNK + p * step),
            range(THREADS),
        )
    )


streams = [mx.new_stream(mx.cpu) for _ in range(THREADS)]


def zeros_on_streams(i):
    if i % THREADS:
        return None
    arrays = [mx.zeros((CHUNK // 4,), dtype=mx.uint32, stream=s) for s in streams]
    mx.eval(arrays)
    return arrays


print(f"{N} chunks of {CHUNK >> 20} MB, {mx.default_device()}")
timed("numpy empty + pread (malloc'd host memory)", lambda i: pread_into(np.empty(CHUNK // 4, np.uint32), i))
kept = timed("mx.zeros on the CPU stream, evaluated", lambda i: zeros())
timed("  then pread into it (touched)", lambda i: pread_into(kept[i][1], i))
timed("  then memcpy from staging into it", lambda i: np.copyto(kept[i][1], staging))
del kept
timed("mx.zeros, then pread into it", lambda i: pread_into(zeros()[1], i))
timed("mx.zeros, then pread from 4 parts", lambda i: pread_into(zeros()[1], i, 4))
timed(f"mx.zeros, then pread in {THREADS} threads", lambda i: threaded_pread(zeros()[1], i))
timed(
    f"numpy empty + pread in {THREADS} threads", lambda i: threaded_pread(np.empty(CHUNK // 4, np.uint32), i)
)
timed(f"mx.zeros on {THREADS} CPU streams at once", zeros_on_streams)
timed(
    "pread to staging, then mx.array(staging)", lambda i: (pread_into(staging, i), mx.eval(mx.array(staging)))
)
kept = timed(
    "mx.zeros, pread, map_for_device (tail 1/4)",
    lambda i: (lambda a: (pread_into(a[1], i), backend.map_for_device(a[0], CHUNK // 4), a)[-1])(zeros()),
)
a = kept[0][0]
start = time.perf_counter()
total = mx.sum(mx.stack([k[0][::1024].astype(mx.float32).sum() for k in kept]))
mx.eval(total)
print(f"{'first GPU read of every 1024th word':<42} {time.perf_counter() - start:7.2f} s", flush=True)
start = time.perf_counter()
total = mx.sum(mx.stack([k[0][::1024].astype(mx.float32).sum() for k in kept]))
mx.eval(total)
print(f"{'second GPU read of the same':<42} {time.perf_counter() - start:7.2f} s", flush=True)
