"""Fully resident overhead: stock mlx-lm against od-moe at 100% capacity on the embedded model, in one
process, alternating rounds (machines are noisy: the ratio is the figure). Greedy tokens must agree.

    python benchmarks/resident.py [--dtype auto|model] [--rounds 4] [--tokens 64]
"""

import argparse

from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate

import od_moe
from od_moe import backend
from od_moe.bench.foundation import PROMPTS
from od_moe.report import table


def _round(model, tokenizer, max_tokens):
    """Mean decode tok/s over the prompts, and the tokens."""
    runs = [list(stream_generate(model, tokenizer, p, max_tokens=max_tokens)) for p in PROMPTS]
    return sum(r[-1].generation_tps for r in runs) / len(runs), [[x.token for x in r] for r in runs]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--dtype", default="auto", help="auto (float32 on the CPU) or model (the checkpoint's)"
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    stock, tokenizer = mlx_lm_load(str(od_moe.DEFAULT_MODEL))
    dtype = backend.compute_dtype(args.dtype)
    if dtype is not None:
        stock.set_dtype(dtype)
    engine = od_moe.load(capacity=1.0, dtype=args.dtype)
    for model in (stock, engine.model):  # warm-up: kernels, caches
        _round(model, tokenizer, 8)
    rows = []
    for n in range(args.rounds):
        (a, ta), (b, tb) = _round(stock, tokenizer, args.tokens), _round(engine.model, tokenizer, args.tokens)
        rows.append([n + 1, a, b, b / a, ta == tb])
    mean = [sum(r[i] for r in rows) / len(rows) for i in (1, 2)]
    rows.append(["all", mean[0], mean[1], mean[1] / mean[0], all(r[4] for r in rows)])
    title = f"dtype {args.dtype}, {len(PROMPTS)} prompts x {args.tokens} greedy tokens, decode tok/s"
    print(table(["round", "stock mlx-lm", "od-moe 100%", "ratio", "same tokens"], rows, title=title))


if __name__ == "__main__":
    main()
