"""What does od-moe cost when every expert is resident? Stock mlx-lm against od-moe at 100% capacity on the
embedded model (or `--model`), in one process, alternating rounds (machines are noisy: the ratio is the
figure). Greedy tokens must agree.

    python benchmarks/resident.py [--model PATH] [--dtype auto|model] [--rounds 4] [--tokens 64]
"""

import argparse
import statistics

from mlx_lm import load as mlx_lm_load

import od_moe
from od_moe.accounting.report import table
from od_moe.bench.foundation import PROMPTS, stock_decode
from od_moe.memory import backend


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default=str(od_moe.DEFAULT_MODEL), help="an MLX model folder (default: embedded)"
    )
    parser.add_argument(
        "--dtype", default="auto", help="auto (float32 on the CPU) or model (the checkpoint's)"
    )
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    stock, tokenizer = mlx_lm_load(args.model)
    dtype = backend.compute_dtype(args.dtype)
    if dtype is not None:
        stock.set_dtype(dtype)
    engine = od_moe.load(args.model, capacity=1.0, dtype=args.dtype)
    for model in (stock, engine.model):  # warm-up: kernels, caches
        stock_decode(model, tokenizer, PROMPTS[0], 8)
    rows = []
    for n in range(args.rounds):  # alternate prompt by prompt: drifts of the machine hit both alike
        pairs = [
            (
                stock_decode(stock, tokenizer, p, args.tokens),
                stock_decode(engine.model, tokenizer, p, args.tokens),
            )
            for p in PROMPTS
        ]
        a, b = (sum(pair[i][0] for pair in pairs) / len(pairs) for i in (0, 1))
        rows.append([n + 1, a, b, b / a, all(x[1] == y[1] for x, y in pairs)])
    ratios = [r[3] for r in rows]
    mean = [sum(r[i] for r in rows) / len(rows) for i in (1, 2)]
    rows.append(["mean", mean[0], mean[1], mean[1] / mean[0], all(r[4] for r in rows)])
    rows.append(["median ratio", None, None, statistics.median(ratios), None])
    title = f"{args.model}, dtype {args.dtype}, {len(PROMPTS)} prompts x {args.tokens} tokens: decode tok/s"
    print(table(["round", "stock mlx-lm", "od-moe 100%", "ratio", "same tokens"], rows, title=title))


if __name__ == "__main__":
    main()
