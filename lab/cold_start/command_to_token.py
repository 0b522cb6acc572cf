"""Lab (issue #56): seconds from a command's start to its first token, stock mlx-lm against od-moe (not
product code). START is the shell's `date +%s.%N` just before the process began, so the interpreter's start
and the imports count. One JSON line: load, first token, both from START.

  python3 lab/cold_start/command_to_token.py stock|od-moe MODEL START [--capacity 25%]
"""

import argparse
import json
import time

PROMPT = "def fibonacci(n):\n"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("side", choices=["stock", "od-moe"])
    parser.add_argument("model")
    parser.add_argument("start", type=float)
    parser.add_argument("--capacity", default="25%")
    args = parser.parse_args()
    if args.side == "stock":
        import mlx.core as mx
        import mlx_lm

        model, tokenizer = mlx_lm.load(args.model)
        mx.eval(model.parameters())
        loaded = time.time() - args.start
        next(mlx_lm.stream_generate(model, tokenizer, PROMPT, max_tokens=1))
    else:
        import od_moe

        engine = od_moe.load(args.model, capacity=args.capacity)
        loaded = time.time() - args.start
        next(engine.stream_generate(PROMPT, max_tokens=1))
    first = time.time() - args.start
    print(json.dumps(dict(side=args.side, capacity=args.capacity, load_s=loaded, first_token_s=first)))


if __name__ == "__main__":
    main()
