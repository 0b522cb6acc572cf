"""The request a server runs before it says it is ready: what a first request would compile (MLX's kernels,
the compiled passes of one position) compiles here instead.

On CUDA a first request paid for compiling every kernel it ran (docs/GPU.md, "Time to first token"); a
short prompt and a few greedy tokens take those compiles before the port answers. Its figures are not
kept: the engine's statistics start from nothing after it. The worker never sees it, so its counters and
prompt cache are untouched.
`warmed_loader` is what `serve` loads with: on the generation thread, the engine and then its warm-up.
Not here: `serve`.
"""

import time

PROMPT = "def add(a, b):\n    return"
TOKENS = 4


def warm_up(engine) -> float:
    """Generate `TOKENS` greedy tokens of `PROMPT` on `engine`, then forget them; the seconds it took."""
    start = time.perf_counter()
    for _ in engine.stream_generate(PROMPT, max_tokens=TOKENS):
        pass
    engine.reset_stats()
    return time.perf_counter() - start


def warmed_loader(model, max_batch: int, load_options: dict, warmed: list):
    """What loads the engine on the generation thread: `od_moe.load` (a KV cache kept for each of
    `max_batch` sequences), then `warm_up` where the engine is not split over ranks (the other ranks
    would have to follow it), its seconds appended to `warmed`."""

    def loader():
        from .. import load

        engine = load(model, sequences=max_batch, **load_options)
        if engine.stage is None:
            warmed.append(warm_up(engine))
        return engine

    return loader
