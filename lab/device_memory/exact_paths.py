"""Lab: which path of od-moe departs from stock mlx-lm on one checkpoint (not product code).

Greedy tokens of stock mlx-lm (twice: is stock itself repeatable?) and of od-moe on the per-layer path,
two tiers with admitted slots and two tiers with device-kept rows, at 25% and 100%, for a short prompt
and a 300-token one; for each run whether it equals stock and where it first departs.

  python3 lab/device_memory/exact_paths.py MODEL [TOKENS]
"""

import sys


def main():
    from mlx_lm import load, stream_generate

    import od_moe

    model, tokens = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 16
    m, tok = load(model)
    text = "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n"
    prompts = ["def fib(n):", "Once upon a time", tok.decode((tok.encode(text) * 40)[:300])]

    def run(gen):
        return [[r.token for r in gen(p)] for p in prompts]

    stock = run(lambda p, m=m: stream_generate(m, tok, p, max_tokens=tokens))
    again = run(lambda p, m=m: stream_generate(m, tok, p, max_tokens=tokens))
    print("stock twice equal:", [a == b for a, b in zip(stock, again)], flush=True)
    del m
    for two_tier, capacity in [(False, 0.25), (True, 1.0), (True, 0.25), ("lru", 0.25), ("lru", 0.5)]:
        engine = od_moe.load(model, capacity=capacity, two_tier=two_tier)
        got = run(lambda p, engine=engine: engine.stream_generate(p, max_tokens=tokens))
        first = [next((i for i, (a, b) in enumerate(zip(g, s)) if a != b), None) for g, s in zip(got, stock)]
        print(
            f"two_tier={two_tier} capacity={capacity}: equal {[g == s for g, s in zip(got, stock)]}, "
            f"first departure {first}",
            flush=True,
        )
        del engine


if __name__ == "__main__":
    main()
