"""Lab: drafted decoding against its reference on the bundled model, on this CPU (not product code).

16 prompts (the 6 of `benchmarks/code_edits.py`, then 10 starts of Python code), 64 greedy tokens, k = 3,
for two kinds of draft: the bundled draft model (`od_moe.DEFAULT_DRAFT`; reference: stock mlx-lm's
`stream_generate(..., draft_model=, num_draft_tokens=3)` on the same pair) and prompt lookup
(`od_moe.PromptLookup`; reference: stock mlx-lm's model through the same lookup loop). For both paths and
12.5, 25, 50 and 100% of experts: prompts equal to the reference, prompts equal to undrafted greedy output,
acceptance, and experts read (two tiers: in place plus copied) per generated token undrafted and drafted.
One markdown table row a line:

  PYTHONPATH=.:tests python3 lab/drafts/cpu_equality.py
"""

import sys

import mlx_lm

import od_moe
from od_moe.generation.prompt_lookup import LookupCounts, stream_lookup
from od_moe.memory import backend

sys.path.insert(0, "benchmarks")
from code_edits import prompts as code_edit_prompts  # noqa: E402

N, K = 64, 3
STARTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
    "def read_lines(path):\n",
    "import argparse\n\n\ndef main():\n    parser = argparse.ArgumentParser(",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
    "def is_prime(n):\n    if n < 2:\n",
    "from collections import defaultdict\n\n\ndef group_by(items, key):\n",
    "try:\n    import json\nexcept ImportError:\n",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n",
]
PROMPTS = code_edit_prompts() + STARTS


def stock(path):
    model, tokenizer = mlx_lm.load(str(path))
    if (dtype := backend.compute_dtype()) is not None:
        model.set_dtype(dtype)
    return model, tokenizer


def tokens(stream) -> list[int]:
    return [r.token for r in stream]


def run(capacity, two_tier, options) -> tuple[dict, dict]:
    engine = od_moe.load(capacity=capacity, two_tier=two_tier)
    got = {p: tokens(engine.stream_generate(p, max_tokens=N, **options())) for p in PROMPTS}
    stats = engine.stats()
    engine.close()
    return got, stats


def main():
    target, tok = stock(od_moe.DEFAULT_MODEL)
    draft, _ = stock(od_moe.DEFAULT_DRAFT)
    ids = {p: tok.encode(p) for p in PROMPTS}
    plain = {p: tokens(mlx_lm.stream_generate(target, tok, ids[p], max_tokens=N)) for p in PROMPTS}
    kinds = {
        "draft model": (
            lambda: dict(draft_model=draft, num_draft_tokens=K),
            {
                p: tokens(
                    mlx_lm.stream_generate(
                        target, tok, ids[p], max_tokens=N, draft_model=draft, num_draft_tokens=K
                    )
                )
                for p in PROMPTS
            },
        ),
        "prompt lookup": (
            lambda: dict(draft_model=od_moe.PromptLookup(), num_draft_tokens=K),
            {
                p: tokens(stream_lookup(target, tok, ids[p], N, LookupCounts(), num_draft_tokens=K))
                for p in PROMPTS
            },
        ),
    }
    print(
        "| draft | path | capacity | = reference | = undrafted | accepted "
        "| experts/token undrafted -> drafted |"
    )
    print("|---|---|---|---|---|---|---|")
    for two_tier in (False, True):
        for capacity in (0.125, 0.25, 0.5, 1.0):
            undrafted, u = run(capacity, two_tier, dict)
            for name, (options, want) in kinds.items():
                got, d = run(capacity, two_tier, options)
                same = sum(got[p] == want[p] for p in PROMPTS)
                agree = sum(got[p] == plain[p] for p in PROMPTS)
                a, path = d["drafts"], "two-tier" if two_tier else "per-layer"
                print(
                    f"| {name} | {path} | {capacity:.1%} | {same}/{len(PROMPTS)} | {agree}/{len(PROMPTS)} | "
                    f"{a['accepted']}/{a['drafted']} | "
                    f"{u['experts_per_token']:.2f} -> {d['experts_per_token']:.2f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
