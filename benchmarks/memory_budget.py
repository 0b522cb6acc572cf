"""Does a `--memory-budget` hold? Peak MLX memory against the budget on the bundled model: one row per
budget and prefetch policy.

Each row runs in a fresh process: the engine is loaded with the budget that buys a capacity
(`capacity.budget_for`, as `od-moe inspect` reports it), the peak is reset, and greedy completions of
the test prompts and of one long prompt run (prompt and completion within the `RESERVED_CONTEXT` tokens
the budget holds KV cache for). Peak is `mx.get_peak_memory()` over generation and over loading.

    python benchmarks/memory_budget.py [--tokens 64] [--json]
"""

import argparse
import json
import subprocess
import sys

FRACTIONS = (0.125, 0.25, 0.5, 1.0)
POLICIES = ("none", "next-gate", "predictor")
PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
    "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(9)),  # ~170 tokens
]


def row(fraction: float, policy: str, tokens: int) -> dict:
    """One measurement, in this process."""
    import od_moe
    from od_moe.memory import backend
    from od_moe.memory.capacity import budget_for, working_nbytes

    probe = od_moe.load(capacity=1)
    layers, experts = len(probe.caches), probe.num_experts
    slots = max(1, round(fraction * experts))
    working = working_nbytes(probe.model, layers, experts, kv_per_token=probe.kv_nbytes_per_token)
    budget = budget_for(slots, layers, probe.caches[0].slot_nbytes, probe.non_expert_nbytes, working)
    del probe
    predictor = od_moe.DEFAULT_PREDICTOR if policy == "predictor" else None
    engine = od_moe.load(memory_budget=budget, prefetch=policy, predictor=predictor)
    longest = max(len(engine.tokenizer.encode(p)) for p in PROMPTS) + tokens
    backend.reset_peak_memory()
    for prompt in PROMPTS:
        engine.generate(prompt, max_tokens=tokens)
    return {
        "budget": budget,
        "capacity": engine.capacity,
        "policy": policy,
        "load_peak": engine.load_peak_bytes,
        "peak": backend.peak_memory_bytes(),
        "context": longest,
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=64, help="greedy tokens per prompt")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--row", nargs=2, help=argparse.SUPPRESS)  # fraction policy: one row, in a child
    args = parser.parse_args()
    if args.row:
        print(json.dumps(row(float(args.row[0]), args.row[1], args.tokens)))
        return
    rows = []
    for fraction in FRACTIONS:
        for policy in POLICIES:
            out = subprocess.run(
                [sys.executable, __file__, "--row", str(fraction), policy, "--tokens", str(args.tokens)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    if args.json:
        print(json.dumps(rows, indent=1))
        return
    mb = 10**6
    longest = rows[0]["context"]
    print(f"Bundled model, {len(PROMPTS)} prompts x {args.tokens} greedy tokens (longest context {longest})")
    print("| budget MB  | capacity | prefetch  | peak MB  | peak/budget | load peak/budget |")
    print("|------------|----------|-----------|----------|-------------|------------------|")
    for r in rows:
        print(
            f"| {r['budget'] / mb:10.2f} | {r['capacity']:8d} | {r['policy']:9} | {r['peak'] / mb:8.2f} "
            f"| {r['peak'] / r['budget']:11.3f} | {r['load_peak'] / r['budget']:16.3f} |"
        )


if __name__ == "__main__":
    main()
