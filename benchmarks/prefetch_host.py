"""Where the generation thread's time goes while prefetch runs: host milliseconds per decoded token in each
step of the per-layer path, with the predictor policy kept on (the governor's timed checks off, reads
asynchronous as in normal use), and how often the next-use head itself runs.

On a fast accelerator the device finishes a small model's layer in a fraction of a millisecond, so this
host work, not the device, sets the speed of a token with prefetch on. Run it on two commits (or before
and after a change) on the same machine; tok/s moves with the machine, host ms per step much less.

    python benchmarks/prefetch_host.py [--capacity 0.25] [--tokens 32] [--rounds 2]
"""

import argparse
import functools
import time
from collections import Counter

from od_moe import policies, runtime
from od_moe.bench.foundation import PROMPTS
from od_moe.bench.prefetch import run_policy, stats_total
from od_moe.engine import DEFAULT_MODEL
from od_moe.governor import PrefetchSettings
from od_moe.predictor import next_use
from od_moe.report import table

STEPS = {
    runtime.OffloadRuntime: ("_evaluate", "_after_routing", "_submit", "_install_ready", "load"),
    policies.PredictorPolicy: ("before_layer", "next_uses"),
    next_use.NextUseHead: ("distances",),
}


def _timed(seconds: Counter, calls: Counter):
    """Wrap every step of `STEPS` so that it adds its wall time and one call to the counters."""
    for owner, names in STEPS.items():
        for name in names:
            step = getattr(owner, name)

            @functools.wraps(step)
            def wrapped(*args, __step=step, __name=name, **kwargs):
                start = time.perf_counter()
                try:
                    return __step(*args, **kwargs)
                finally:
                    seconds[__name] += time.perf_counter() - start
                    calls[__name] += 1

            setattr(owner, name, wrapped)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacity", type=float, default=0.25, help="fraction of experts resident")
    parser.add_argument("--tokens", type=int, default=32, help="new tokens per prompt")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    settings = PrefetchSettings(timed_checks=False)
    seconds, calls = Counter(), Counter()
    _timed(seconds, calls)
    run_policy(
        DEFAULT_MODEL, PROMPTS[:1], 4, "predictor", capacity=args.capacity, settings=settings
    )  # warm-up
    columns = []
    for _ in range(args.rounds):
        seconds.clear(), calls.clear()
        result = run_policy(
            DEFAULT_MODEL, PROMPTS, args.tokens, "predictor", capacity=args.capacity, settings=settings
        )
        decoded = stats_total(result["stats"], "positions", "decode")
        column = {"tok/s": result["tok_s"]}
        column.update(
            {f"{name} ms": seconds[name] * 1e3 / decoded for names in STEPS.values() for name in names}
        )
        column["head runs"] = calls["distances"] / decoded
        column["estimates asked"] = calls["next_uses"] / decoded
        columns.append(column)
    title = (
        f"bundled model, {args.capacity:.0%} resident, predictor policy kept on, {len(PROMPTS)} prompts x "
        f"{args.tokens} tokens: per decoded token (a step's time includes the steps it calls)"
    )
    headers = ["per token"] + [f"round {n + 1}" for n in range(args.rounds)]
    print(table(headers, [[key] + [c[key] for c in columns] for key in columns[0]], title=title))


if __name__ == "__main__":
    main()
