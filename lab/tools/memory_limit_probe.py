"""Two-tier decode tok/s with MLX's memory limit below the bytes of the mapped expert stacks: what a model
whose experts outgrow the GPU's memory meets (`backend._hold_in_host`; `docs/GPU.md`, "MLX's memory limit").

    python3 lab/tools/memory_limit_probe.py MODEL [--widen 128] [--limit-gb 0.5] [--set after]

MLX counts the mapped stacks (managed memory kept in host RAM) as active memory; past its memory limit
(0.95 of the GPU's memory on CUDA) it waits for the GPU after every operation. `--set before` (default)
sets the limit before loading, as a small GPU would have it: od-moe raises it by the mapped bytes (older
trees do not). `--set after` sets it after loading, under od-moe's raise: the slow case itself. Each line
is JSON: the limit, MLX's active memory and tok/s of 3 prompts x 48 greedy tokens, twice.
"""

import argparse
import json
import time

import mlx.core as mx


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("--widen", type=int, default=128)
    parser.add_argument("--limit-gb", type=float, default=0.5)
    parser.add_argument("--set", choices=["before", "after"], default="before")
    parser.add_argument("--workdir", default="/tmp/odb")
    args = parser.parse_args()
    if args.set == "before":
        mx.set_memory_limit(int(args.limit_gb * 1e9))
    import od_moe
    from od_moe.bench.widen import widen_model

    path = (
        widen_model(args.model, f"{args.workdir}/widened-x{args.widen}", args.widen)
        if args.widen
        else args.model
    )
    engine = od_moe.load(str(path), capacity=0.25, two_tier=True)
    if args.set == "after":
        mx.set_memory_limit(int(args.limit_gb * 1e9))

    def tok_s():
        n, started = 0, time.perf_counter()
        for prompt in ("def fibonacci(n):", "class Stack:", "import os\n"):
            n += len(list(engine.stream_generate(prompt, max_tokens=48)))
        return round(n / (time.perf_counter() - started), 1)

    tok_s()  # warm up
    figures = {"limit_gb": mx.get_memory_limit() / 1e9, "active_gb": mx.get_active_memory() / 1e9}
    print(json.dumps(dict(figures, set=args.set, tok_s=[tok_s(), tok_s()])), flush=True)


if __name__ == "__main__":
    main()
