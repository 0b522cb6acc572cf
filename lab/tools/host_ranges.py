"""Lab (issue #56): where a decoded token's host time goes inside MLX's CUDA backend, by MLX's own NVTX
range names, stock mlx-lm against two-tier rows, in one process, with no Nsight tool on the machine.

MLX marks each primitive's encoding (`CustomKernel::eval_gpu`, `Compiled::eval_gpu`, ...), each graph's
commit (`CommandEncoder::commit`), its evaluations (`gpu::eval`) and its waits for the device
(`cu::AtomicEvent::wait`, `gpu::synchronize`) with NVTX ranges. `nvtx_sum.c`, loaded by NVTX as its
injection library, sums each range's inclusive host time by name; this opens a window over `TOKENS`
decoded tokens per mode (after a warm-up) and prints, per name, calls and microseconds a token, beside
the token's wall time.

    gcc -O2 -shared -fPIC -o /tmp/libnvtx_sum.so lab/tools/nvtx_sum.c -lpthread
    NVTX_INJECTION64_PATH=/tmp/libnvtx_sum.so python3 lab/tools/host_ranges.py MODEL MODE[,MODE...] [TOKENS]

MODE as in `kernel_time.py` (`stock`, `lru:F`, `tt:F`, ...). Ranges nest (`gpu::eval` holds the
primitives' ranges and the commits), so the rows do not add up to the wall. CUDA only; not a test.
"""

import ctypes
import os
import sys
import tempfile
import time
from pathlib import Path

from kernel_time import generator  # beside this script, on the path a script runs with: the same modes

from od_moe.bench.foundation import PROMPTS


def window(library, generate, tokens: int) -> tuple[float, dict]:
    """Host ms a decoded token and {range: (calls, ns)} over `tokens` decoded tokens of `generate`."""
    out = Path(tempfile.mkstemp(suffix=".tsv")[1])
    times = []
    for _ in generate(PROMPTS[1], tokens + 1):
        times.append(time.perf_counter())
        if len(times) == 1:  # from the first token's response on: decoded tokens only
            library.nvtx_sum_reset()
    library.nvtx_sum_dump(str(out).encode())
    ranges = {}
    for line in out.read_text().splitlines():
        calls, ns, name = line.split("\t", 2)
        ranges[name] = (int(calls), int(ns))
    out.unlink()
    return (times[-1] - times[0]) / (len(times) - 1) * 1e3, ranges


def main():
    path, modes = sys.argv[1], sys.argv[2].split(",")
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 16
    injected = os.environ.get("NVTX_INJECTION64_PATH")
    if not injected:
        raise SystemExit("set NVTX_INJECTION64_PATH to the built nvtx_sum library (see the docstring)")
    library = ctypes.CDLL(injected)
    found = {}
    for mode in modes:
        generate = generator(mode, path)
        list(generate(PROMPTS[0], 24))  # compiles, admission
        found[mode] = window(library, generate, tokens)
        wall, ranges = found[mode]
        print(f"\n{mode}: {wall:.3f} ms a decoded token (wall); us a token, calls a token, us a call:")
        for name, (calls, ns) in sorted(ranges.items(), key=lambda kv: -kv[1][1])[:24]:
            each = ns / max(1, calls) / 1e3
            print(f"  {ns / tokens / 1e3:9.1f}  {calls / tokens:7.1f}  {each:8.2f}  {name}")
    if "stock" in found and len(found) > 1:
        base = found["stock"][1]
        for mode, (wall, ranges) in found.items():
            if mode == "stock":
                continue
            print(f"\n{mode} against stock: {wall - found['stock'][0]:+.3f} ms a token (wall); us a token:")
            names = set(base) | set(ranges)
            diff = {n: (ranges.get(n, (0, 0))[1] - base.get(n, (0, 0))[1]) / tokens / 1e3 for n in names}
            for name, us in sorted(diff.items(), key=lambda kv: -abs(kv[1]))[:16]:
                print(f"  {us:+9.1f}  {name}")


if __name__ == "__main__":
    main()
