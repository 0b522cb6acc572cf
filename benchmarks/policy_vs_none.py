"""A prefetch policy against on-demand loading (`none`) on the embedded model: a fresh engine per prompt
(as `od-moe bench` runs them), the two alternating prompt by prompt in one process (machines are noisy:
the ratio is the figure), with its governor's timed checks on as in normal use. Prints decode tok/s, the
ratio, and experts read per decoded token.

    python benchmarks/policy_vs_none.py [--policy predictor|next-gate] [--capacities 0.25,0.5]
        [--rounds 2] [--tokens 32]
"""

import argparse

import od_moe
from od_moe.bench.foundation import PROMPTS
from od_moe.report import table


def _run(policy: str, capacity: float, prompt: str, tokens: int) -> tuple[float, int]:
    """Decode tok/s of one greedy generation on a fresh engine, and the experts it read while decoding."""
    predictor = od_moe.DEFAULT_PREDICTOR if policy == "predictor" else None
    engine = od_moe.load(capacity=capacity, prefetch=policy, predictor=predictor)
    try:
        out = list(engine.stream_generate(prompt, max_tokens=tokens))
        return out[-1].generation_tps, engine.stats()["io"]["decode"]["experts_loaded"]
    finally:
        engine.close()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--policy", choices=("predictor", "next-gate"), default="predictor")
    parser.add_argument("--capacities", default="0.25,0.5", help="fractions of experts resident")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    rows = []
    for capacity in (float(c) for c in args.capacities.split(",")):
        tps = {"none": [], args.policy: []}
        reads = dict.fromkeys(tps, 0)
        for _ in range(args.rounds):
            for prompt in PROMPTS:
                for policy in tps:
                    speed, read = _run(policy, capacity, prompt, args.tokens)
                    tps[policy].append(speed)
                    reads[policy] += read
        decoded = args.rounds * len(PROMPTS) * args.tokens
        none, other = (sum(tps[p]) / len(tps[p]) for p in tps)
        rows.append([f"{capacity:.1%}", none, other, other / none] + [reads[p] / decoded for p in tps])
    title = f"embedded model, {len(PROMPTS)} prompts x {args.tokens} tokens x {args.rounds} rounds: decode"
    columns = ["capacity", "tok/s none", f"tok/s {args.policy}", "ratio", "experts/tok none"]
    columns.append(f"experts/tok {args.policy}")
    print(table(columns, rows, title=title))


if __name__ == "__main__":
    main()
