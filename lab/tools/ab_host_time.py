"""A change to what a compiled pass traces, timed before and after in one process: stock mlx-lm, the row as
the code is ("after") and the row with its products' batch indices made by MLX ("before": 29d6869 undone,
that engine's switches copied without `switch_on(rows_given=True)`'s projections), each prompt run by all
three in turn.
Processes differ in stock's own speed (docs/GPU.md, "Real shapes' tokens"), so a change is best judged
against its baseline in the same one. Per decoded token as `lab/tools/host_time.py` splits it (wall,
`forward`, `async_eval`, rest), medians over rounds of the bench's prompts.

    python3 lab/tools/ab_host_time.py MODEL ROW [TOKENS] [ROUNDS]

ROW: `lru:F` or `tt:F` as in `host_time.py`. Not a test or a bench: a lab measurement, run on a GPU.
"""

import contextlib
import statistics
import sys

import host_time
import mlx_lm

import od_moe
from od_moe.bench.foundation import PROMPTS
from od_moe.bench.two_tier_grid import WARM_PROMPT
from od_moe.model_surgery import switch_over as switch


@contextlib.contextmanager
def indices(constant: bool):
    """Engines loaded meanwhile trace their products' batch indices as constants (the code as it is) or
    take them from MLX (before 29d6869): their switches are copied with or without the projections that
    give them. Open around an engine's load."""
    given = dict(switch._ROWS_GIVEN)
    if not constant:
        switch._ROWS_GIVEN.clear()
    try:
        yield
    finally:
        switch._ROWS_GIVEN.update(given)


def engine_for(path: str, spec: str, tokens: int, constant: bool):
    """A warmed engine for `spec`, its passes traced with (or without) constant batch indices."""
    kind, fraction = spec.split(":")
    with indices(constant):
        engine = od_moe.load(path, capacity=float(fraction), two_tier={"lru": "lru", "tt": True}[kind])
    engine.forward = host_time._TimedModel(engine.forward)
    for _ in range(2):  # every pass traced, kernels compiled, admission settled
        list(engine.stream_generate(WARM_PROMPT, max_tokens=tokens))
    return engine


def main():
    path, spec = sys.argv[1], sys.argv[2]
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 48
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    sys.modules["mlx_lm.generate"].mx = host_time._TimedMx()
    stock, tokenizer = mlx_lm.load(path)
    stock = host_time._TimedModel(stock)
    engines = {side: engine_for(path, spec, tokens, side == "after") for side in ("after", "before")}
    runs = {"stock": [], "after": [], "before": []}
    same = 0
    for _ in range(rounds):
        for prompt in PROMPTS:
            reference = []
            for response in mlx_lm.stream_generate(stock, tokenizer, prompt, max_tokens=tokens):
                reference.append(response.token)
            runs["stock"].append(
                host_time.per_token(mlx_lm.stream_generate(stock, tokenizer, prompt, max_tokens=tokens))
            )
            for side, engine in engines.items():
                made = []
                with indices(side == "after"):
                    stream = host_time.collected(engine.stream_generate(prompt, max_tokens=tokens), made)
                    runs[side].append(host_time.per_token(stream))
                same += made == reference
    print(
        f"{spec}, {tokens} tokens, {rounds} rounds; tokens equal stock's: {same}/{2 * rounds * len(PROMPTS)}"
    )
    print("run | wall ms/token | forward | async_eval | rest | x stock | wall - stock's, ms")
    stock_wall = statistics.median(r[0] for r in runs["stock"])
    for run, values in runs.items():
        wall, forward, encode = (statistics.median(r[i] for r in values) for i in range(3))
        print(
            f"{run} | {wall:.3f} | {forward:.3f} | {encode:.3f} | {wall - forward - encode:.3f} | "
            f"{stock_wall / wall:.3f} | {wall - stock_wall:+.3f}"
        )


if __name__ == "__main__":
    main()
