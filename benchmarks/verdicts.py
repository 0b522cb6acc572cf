"""The governor's verdict per prompt against what the tokens cost: the predictor policy and on-demand
loading (`none`) alternating round by round in one process, each prompt a fresh engine (as `od-moe bench`
runs them), governor timed checks on as in normal use.

Prints per round and prompt: both policies' decode tok/s, and the predictor's verdict:
its mode at the end, and the gain check's estimate (ms per token saved by useful prefetches, its cost on
the generation thread, the measuring tokens' time; the useful prefetches per token and the price of one
saved read in ms, install included). A verdict of "on" is right where the predictor's
tokens are faster than none's; an estimate saving more than none's whole token is an overestimate.
Exact tokens are checked between the two.

    python benchmarks/verdicts.py [--widen 128 --workdir /tmp/odb] [--cold] [--capacity 0.25]
        [--rounds 2] [--tokens 16]
"""

import argparse

from od_moe.bench.foundation import PROMPTS
from od_moe.bench.prefetch import run_policy
from od_moe.bench.widen import add_copy_options, model_for
from od_moe.engine import DEFAULT_MODEL
from od_moe.report import table


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_copy_options(parser)
    parser.add_argument("--capacity", type=float, default=0.25, help="fraction of experts resident")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    path = model_for(args, DEFAULT_MODEL)
    rows = []
    for n in range(args.rounds):
        runs = {
            policy: run_policy(path, PROMPTS, args.tokens, policy, capacity=args.capacity, cold=args.cold)
            for policy in ("none", "predictor")
        }
        if runs["none"]["tokens"] != runs["predictor"]["tokens"]:
            raise SystemExit(f"round {n}: the predictor's tokens differ from none's")
        for i, stats in enumerate(runs["predictor"]["stats"]):
            gain = stats["prefetch"]["gain"] or {}
            rows.append(
                [
                    n,
                    i,
                    runs["none"]["prompt_tok_s"][i],
                    runs["predictor"]["prompt_tok_s"][i],
                    stats["prefetch"]["mode"],
                    gain.get("hidden_ms", float("nan")),
                    gain.get("cost_ms", float("nan")),
                    gain.get("token_ms", float("nan")),
                    gain.get("useful", float("nan")),
                    gain.get("read_price_ms", float("nan")),
                ]
            )
    model = f"widened x{args.widen}" if args.widen else "embedded model"
    title = (
        f"{model}, {args.capacity:.1%} resident, {'cold' if args.cold else 'warm'} reads, {len(PROMPTS)} "
        f"prompts x {args.tokens} tokens: decode tok/s and the predictor's gain check (ms per token)"
    )
    columns = [
        "round",
        "prompt",
        "none tok/s",
        "predictor tok/s",
        "mode",
        "saved",
        "cost",
        "measuring token",
        "useful",
        "price",
    ]
    print(table(columns, rows, title=title))


if __name__ == "__main__":
    main()
