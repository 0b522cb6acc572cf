"""How many MLX operations a decoded token's graph holds: stock mlx-lm against od-moe rows, in one process.

The host pays for each operation when MLX encodes it, and on an H100 that shows where the device finishes
first: stock mlx-lm's decoded token takes 2.96-3.83 ms of wall for 2.55 ms of kernels on the widened copy
(`lab/tools/kernel_time.py`; a row whose kernels outlast the wall, like the widened 0% row, is bound by its
device instead: docs/GPU.md, "The 0% row's floor"). The count is deterministic, so it shows what a
change to a pass's operations does to that cost before any GPU run. It counts the graph mlx-lm hands to
`mx.async_eval` for one decoded token (the tenth of the first prompt, by then every compiled step is traced):
primitives not yet evaluated, a multi-output primitive once. On the CPU backend od-moe computes with MLX
operations where CUDA runs its kernels (`od_moe/two_tier/kernels.py`), MLX's fast
kernels (norms, rope) count as the operations they fall back to, and `lru` rows wait for the host inside the
pass (so only the pass's last part is counted): run it on the GPU for the counts the host there pays.

    python3 lab/tools/op_count.py MODEL ROWS [--top N]

ROWS: comma-separated `lru:F` or `tt:F` as in `lab/tools/host_time.py`. Prints, per row, the operations of the
token and the primitives whose count differs most from stock's.
"""

import argparse
import collections
import gc
import os
import re
import sys
import tempfile

import mlx.core as mx
import mlx_lm

import od_moe
from od_moe.bench.foundation import PROMPTS
from od_moe.memory import backend

TOKEN = 10  # the decoded token whose graph is counted
_LABEL = re.compile(r'\[label ="([^"]+)", shape=rectangle\]')


class _Capture:
    """mlx.core as mlx-lm's generation loop sees it: `async_eval`'s arrays at call `TOKEN` counted."""

    def __init__(self):
        self.calls, self.counts = 0, None

    def __getattr__(self, name):
        return getattr(mx, name)

    def async_eval(self, *arrays):
        self.calls += 1
        if self.calls == TOKEN and self.counts is None:
            self.counts = count_operations(arrays)
        return mx.async_eval(*arrays)


def count_operations(arrays) -> collections.Counter:
    """Primitives by name in the graph of `arrays` that are not evaluated yet (`mx.export_to_dot`)."""
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "graph.dot")
        mx.export_to_dot(path, *arrays)
        with open(path) as f:
            return collections.Counter(_LABEL.findall(f.read()))


def counted(generate, *args, **kwargs) -> collections.Counter:
    """The operations of decoded token `TOKEN` of `generate(*args, **kwargs)` (responses, as mlx-lm's
    `stream_generate` gives them)."""
    capture = sys.modules["mlx_lm.generate"].mx = _Capture()
    try:
        for _ in generate(*args, **kwargs):
            pass
    finally:
        sys.modules["mlx_lm.generate"].mx = mx
    if capture.counts is None:
        raise SystemExit(f"the generation made fewer than {TOKEN} evaluations")
    return capture.counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("rows")
    parser.add_argument("--top", type=int, default=8, help="primitives listed per row")
    args = parser.parse_args()
    tokens = TOKEN + 4
    stock, tokenizer = mlx_lm.load(args.model)
    if backend.compute_dtype("auto") is not None:  # the cast od-moe applies (float32 on the CPU)
        stock.set_dtype(backend.compute_dtype("auto"))
    base = counted(mlx_lm.stream_generate, stock, tokenizer, PROMPTS[0], max_tokens=tokens)
    print(f"stock mlx-lm: {sum(base.values())} operations a decoded token ({mx.default_device()})")
    for spec in args.rows.split(","):
        kind, fraction = spec.split(":")
        engine = od_moe.load(args.model, capacity=float(fraction), two_tier={"lru": "lru", "tt": True}[kind])
        list(engine.stream_generate(PROMPTS[1], max_tokens=tokens))  # every step traced
        row = counted(engine.stream_generate, PROMPTS[0], max_tokens=tokens)
        total, extra = sum(row.values()), row.copy()
        extra.subtract(base)
        largest = sorted((kv for kv in extra.items() if kv[1]), key=lambda kv: -abs(kv[1]))[: args.top]
        listed = ", ".join(f"{name} {n:+d}" for name, n in largest)
        print(f"{spec} ({engine.mode.path}): {total} operations, {total - sum(base.values()):+d}: {listed}")
        del engine
        gc.collect()


if __name__ == "__main__":
    main()
