"""The request a server runs before it says it is ready: what a first request would compile (MLX's kernels,
the compiled passes of one position) compiles here instead.

On CUDA a first request paid for compiling every kernel it ran (docs/GPU.md, "Time to first token"); a
short prompt and a few greedy tokens take those compiles before the port answers. Its figures are not
kept: the engine's statistics start from nothing after it. The worker never sees it, so its counters and
prompt cache are untouched.
`warmed_loader` is what `serve` loads with: on the generation thread, the engine and then its warm-up.
The warm-up takes the path requests will: with a draft model it drafts; where requests decode together
(`--max-batch` over 1) it runs mlx-lm's `BatchGenerator` as the server's batch does, once with one
sequence and once with `max_batch` (a pass of a batch size not seen yet compiles); otherwise one sequence
as a request alone runs.
Not here: `serve`.
"""

import time

from ..generation.batch_generate import batch_generate
from .batching import prefill_batch_size

PROMPT = "def add(a, b):\n    return"
TOKENS = 4


def warm_up(engine, draft=None, num_draft_tokens: int | None = None, max_batch: int = 1) -> float:
    """Generate `TOKENS` greedy tokens of `PROMPT` on `engine` as the server's requests will run (drafted
    by `draft` where the server has one; in batches of 1 and `max_batch` where it batches), then forget
    them; the seconds it took."""
    start = time.perf_counter()
    if draft is None and max_batch > 1:
        for size in sorted({1, max_batch}):
            batch_generate(
                engine,
                [PROMPT] * size,
                TOKENS,
                completion_batch_size=max_batch,
                prefill_batch_size=prefill_batch_size(max_batch),
            )
    else:
        drafting = {} if draft is None else dict(draft_model=draft, num_draft_tokens=num_draft_tokens)
        for _ in engine.stream_generate(PROMPT, max_tokens=TOKENS, **drafting):
            pass
    engine.reset_stats()
    return time.perf_counter() - start


def warmed_loader(model, max_batch: int, load_options: dict, warmed: list, drafting=None):
    """What loads the engine on the generation thread: `od_moe.load` (a KV cache kept for each of
    `max_batch` sequences), the server's draft if it has one (`drafting`, a `drafting.ServerDraft`), then
    `warm_up` with it where the engine is not split over ranks (the other ranks would have to follow
    it), its seconds appended to `warmed`."""

    def loader():
        from .. import load

        engine = load(model, sequences=max_batch, **load_options)
        draft, tokens = None, None
        if drafting is not None:
            drafting.load(engine)  # the worker's own call then finds it loaded
            draft, tokens = drafting.draft, drafting.num_draft_tokens
        if engine.stage is None:
            warmed.append(warm_up(engine, draft, tokens, max_batch))
        return engine

    return loader
