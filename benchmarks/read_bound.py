"""The read-bound score floor: the predictor policy with it (the default) against the same policy without
it and against on-demand loading (`none`), in one process, the three alternating round by round (each
round: every prompt, a fresh engine each, as `od-moe bench` runs them), governor timed checks on as in
normal use. Where the generation thread waits for reads most of a token's time, the governor reads only
predictions scored `read_bound_score` or more; this measures what that does to bytes, hit rate and speed.

Prints per capacity: decode tok/s of each variant and their ratios, experts read per decoded token
(demand and prefetch) against Belady's MIN for the same routing, the decode hit rate, and the share of
prompts that ended read-bound. Exact tokens are checked across the three.

    python benchmarks/read_bound.py [--widen 128 --workdir /tmp/odb] [--cold] [--capacities 0.25,0.5]
        [--rounds 2] [--tokens 16]
"""

import argparse
from dataclasses import replace

from od_moe.bench.foundation import PROMPTS
from od_moe.bench.prefetch import run_policy, stats_total
from od_moe.bench.widen import add_copy_options, model_for
from od_moe.engine import DEFAULT_MODEL
from od_moe.governor import PrefetchSettings
from od_moe.report import table

VARIANTS = {
    "none": ("none", None),
    "floor off": ("predictor", replace(PrefetchSettings(), read_bound_score=0.0)),
    "floor on": ("predictor", PrefetchSettings()),
}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_copy_options(parser)
    parser.add_argument("--capacities", default="0.25,0.5", help="fractions of experts resident")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=16)
    args = parser.parse_args()
    path = model_for(args, DEFAULT_MODEL)
    rows = []
    for capacity in (float(c) for c in args.capacities.split(",")):
        results = {name: [] for name in VARIANTS}
        for _ in range(args.rounds):
            for name, (policy, settings) in VARIANTS.items():
                results[name].append(
                    run_policy(
                        path,
                        PROMPTS,
                        args.tokens,
                        policy,
                        capacity=capacity,
                        cold=args.cold,
                        settings=settings,
                    )
                )
        if len({str(runs[0]["tokens"]) for runs in results.values()}) != 1:
            raise SystemExit(f"tokens differ between the variants at {capacity:.1%}")
        speed = {name: sum(r["tok_s"] for r in runs) / len(runs) for name, runs in results.items()}
        for name, runs in results.items():
            stats = [s for r in runs for s in r["stats"]]
            read = stats_total(stats, "io", "decode", "bytes_read") / runs[0]["expert_bytes"]
            minimum = sum(r["min_reads"] for r in runs)
            rows.append(
                [
                    f"{capacity:.1%}",
                    name,
                    speed[name],
                    speed[name] / speed["none"],
                    speed[name] / speed["floor off"],
                    read / stats_total(stats, "positions", "decode"),
                    read / minimum if minimum else float("nan"),
                    stats_total(stats, "total", "decode", "hits")
                    / stats_total(stats, "total", "decode", "lookups"),
                    stats_total(stats, "prefetch", "read_bound") / len(stats),
                ]
            )
    model = f"widened x{args.widen}" if args.widen else "embedded model"
    title = (
        f"{model}, {'cold' if args.cold else 'warm'} reads, {len(PROMPTS)} prompts x {args.tokens} tokens x "
        f"{args.rounds} rounds: decode"
    )
    columns = ["capacity", "variant", "tok/s", "x none", "x floor off", "experts/tok", "x MIN", "hit"]
    print(table(columns + ["ended read-bound"], rows, title=title))


if __name__ == "__main__":
    main()
