"""Where a decoded token's time goes on the host: stock mlx-lm against two-tier rows, in one process.

Per decoded token (the first excluded), medians over 3 rounds of the bench's 3 prompts, each prompt run by
stock and then by the row:
- `forward`: the model call that builds the pass's graph (for od-moe, its layers' own work: tables, row
  kernels, counts);
- `async_eval`: mlx-lm's `mx.async_eval` of the token (MLX's encoding and launch, and waits for the device:
  MLX's evaluation waits whenever more than 10 of its tasks are in flight, `MAX_ACTIVE_TASKS` in
  `mlx/transforms.cpp`);
- `rest`: the remainder, waiting for the device (`y.item()`).
`rest` growing says the device is the bound; `rest` near zero does not say the host is, since a device-bound
token may wait inside `async_eval` instead (the widened copy's 0% row did). To tell them apart, time the
device's kernels (`lab/tools/kernel_time.py`) against the wall.

    python3 lab/tools/host_time.py MODEL ROWS [TOKENS]

ROWS: comma-separated `lru:F` (device-kept rows, `two_tier="lru"`) or `tt:F` (counted slots,
`two_tier=True`), F the fraction of experts in slots. For a profile of the same decoding by function:
`python3 -m cProfile -s tottime` around `Engine.stream_generate` (docs/GPU.md, "Where a decoded token's time
goes").
"""

import gc
import statistics
import sys
import time

import mlx.core as mx
import mlx_lm

import od_moe
from od_moe.bench.foundation import PROMPTS
from od_moe.bench.two_tier_grid import WARM_PROMPT

ROUNDS = 3
spent = {"forward": 0.0, "async_eval": 0.0}


def _timed(part: str, call, *args, **kwargs):
    """`call(*args, **kwargs)`, its seconds added to `spent[part]`."""
    t0 = time.perf_counter()
    try:
        return call(*args, **kwargs)
    finally:
        spent[part] += time.perf_counter() - t0


class _TimedMx:
    """mlx.core as mlx-lm's generation loop sees it, its `async_eval` timed."""

    def __getattr__(self, name):
        return getattr(mx, name)

    def async_eval(self, *args, **kwargs):
        return _timed("async_eval", mx.async_eval, *args, **kwargs)


class _TimedModel:
    """A model (or od-moe's forward) whose calls are timed; every other attribute is the model's."""

    def __init__(self, model):
        object.__setattr__(self, "model", model)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, *args, **kwargs):
        return _timed("forward", self.model, *args, **kwargs)


def collected(responses, tokens: list):
    """`responses`, each one's token appended to `tokens` as it passes (tokens checked while timed)."""
    for response in responses:
        tokens.append(response.token)
        yield response


def per_token(responses) -> tuple[float, float, float]:
    """ms per decoded token (after the first): wall, forward, async_eval."""
    times = []
    for _ in responses:
        times.append(time.perf_counter())
        if len(times) == 1:  # the prompt's pass is not a decoded token's
            spent["forward"] = spent["async_eval"] = 0.0
    n = max(1, len(times) - 1)
    return (times[-1] - times[0]) / n * 1e3, spent["forward"] / n * 1e3, spent["async_eval"] / n * 1e3


def main():
    path, rows = sys.argv[1], sys.argv[2].split(",")
    tokens = int(sys.argv[3]) if len(sys.argv) > 3 else 48
    sys.modules["mlx_lm.generate"].mx = _TimedMx()  # the generation loop's own module
    stock, tokenizer = mlx_lm.load(path)
    stock = _TimedModel(stock)
    print("row | run | wall ms/token | forward | async_eval | rest | x stock")
    for spec in rows:
        kind, fraction = spec.split(":")
        engine = od_moe.load(path, capacity=float(fraction), two_tier={"lru": "lru", "tt": True}[kind])
        engine.forward = _TimedModel(engine.forward)
        for _ in range(2):  # kernels compiled, admission settled
            list(engine.stream_generate(WARM_PROMPT, max_tokens=tokens))
        runs = {"stock": [], "row": []}
        for _ in range(ROUNDS):
            for prompt in PROMPTS:
                runs["stock"].append(
                    per_token(mlx_lm.stream_generate(stock, tokenizer, prompt, max_tokens=tokens))
                )
                runs["row"].append(per_token(engine.stream_generate(prompt, max_tokens=tokens)))
        medians = {k: [statistics.median(r[i] for r in v) for i in range(3)] for k, v in runs.items()}
        for run, (wall, forward, encode) in medians.items():
            ratio = medians["stock"][0] / medians["row"][0]
            rest = wall - forward - encode
            print(f"{spec} | {run} | {wall:.3f} | {forward:.3f} | {encode:.3f} | {rest:.3f} | {ratio:.3f}")
        hit = engine.stats()["total"]["decode"]["hit_rate"]
        print(f"{spec}: {engine.mode.path}, decode hit rate {hit:.3f}")
        del engine
        gc.collect()
        mx.clear_cache()


if __name__ == "__main__":
    main()
