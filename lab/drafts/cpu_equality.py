"""Lab: drafted against undrafted greedy decoding on the bundled model, on this CPU (not product code).

For two drafts (the bundled model's first 6 of 8 layers; the bundled model itself), both paths and 12.5, 25,
50 and 100% of experts: tokens equal to stock mlx-lm drafting with the same pair (`mlx_lm.stream_generate(...,
draft_model=, num_draft_tokens=3)`), agreement with undrafted greedy output, acceptance rate, decode experts
moved per generated token undrafted and drafted, and tok/s (noisy: a shared CPU, the draft computed on it
too). One markdown table row a line:

  PYTHONPATH=. python3 lab/drafts/cpu_equality.py
"""

import sys
import time

import mlx_lm
from mlx_lm import stream_generate as stock_stream

import od_moe
from od_moe import backend

sys.path.insert(0, "tests")
from conftest import PROMPTS  # noqa: E402

N, K = 64, 3


def stock(layers=None):
    model, tokenizer = mlx_lm.load(str(od_moe.DEFAULT_MODEL))
    model.set_dtype(backend.compute_dtype())
    if layers:
        model.model.layers = model.model.layers[:layers]
    return model, tokenizer


def tokens(stream) -> list[int]:
    return [r.token for r in stream]


def run(capacity, two_tier, options, want, plain) -> tuple:
    engine = od_moe.load(capacity=capacity, two_tier=two_tier)
    same = agree = generated = 0
    start = time.perf_counter()
    for p in PROMPTS:
        got = tokens(engine.stream_generate(p, max_tokens=N, **options))
        generated += len(got)
        same, agree = same + (got == want[p]), agree + (got == plain[p])
    seconds = time.perf_counter() - start
    stats = engine.stats()
    engine.close()
    return same, agree, stats["experts_per_token"], stats["drafts"]["acceptance_rate"], generated / seconds


def main():
    target, tok = stock()
    plain = {p: tokens(stock_stream(target, tok, p, max_tokens=N)) for p in PROMPTS}
    drafts = {"first 6 of 8 layers": stock(6)[0], "the bundled model": stock()[0]}
    for name, draft in drafts.items():
        options = dict(draft_model=draft, num_draft_tokens=K)
        want = {p: tokens(stock_stream(target, tok, p, max_tokens=N, **options)) for p in PROMPTS}
        for two_tier in (False, True):
            for capacity in (0.125, 0.25, 0.5, 1.0):
                u = run(capacity, two_tier, {}, plain, plain)
                d = run(capacity, two_tier, options, want, plain)
                ratio = f"{d[2] / u[2]:.2f}" if u[2] else "-"
                path = "two-tier" if two_tier else "per-layer"
                print(
                    f"| {name} | {path} | {capacity:.1%} | {d[0]}/3 | {d[1]}/3 | {d[3]:.3f} | {u[2]:.2f} | "
                    f"{d[2]:.2f} | {ratio} | {u[4]:.0f} | {d[4]:.0f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
