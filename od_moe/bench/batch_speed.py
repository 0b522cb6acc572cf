"""`od-moe bench --batch`: many greedy requests decoded together, od-moe against stock mlx-lm.

For each batch size (1, 2, 8, 32 by default) the same number of distinct prompts (cut from the bundled
Python text) is decoded in one batch, by stock mlx-lm's `batch_generate` with every expert resident and by
od-moe at each capacity (`Engine.batch_generate`), in one process. A row gives the aggregate decode
throughput (generated tokens over the whole batch's time), the per-request share of it, the median time
to a request's first token, experts read per generated token (demand and prefetch alike), and the gain
over batch 1 beside stock's own gain. Tokens are checked against stock's batch for the same prompts.
Not here: the server's continuous batching.
"""

import statistics
import time
from pathlib import Path

from mlx_lm.generate import batch_generate as mlx_lm_batch_generate

from .. import load
from ..accounting.report import table
from ..engine import DEFAULT_MODEL
from ..training.data import load_documents
from .foundation import stock_model
from .two_tier_grid import experts_across_bus
from .widen import widen_model


def batch_prompts(count: int) -> list[str]:
    """`count` distinct prompts: the first line of function definitions in the bundled Python text."""
    prompts, seen = [], set()
    for doc in load_documents(None).texts:
        for line in doc.splitlines():
            line = line.strip()
            if line.startswith("def ") and line.endswith(":") and line not in seen:
                seen.add(line)
                prompts.append(line + "\n")
                if len(prompts) == count:
                    return prompts
    raise ValueError(f"the bundled text has fewer than {count} distinct function definitions")


def _decode(run, prompts: list, max_tokens: int) -> dict:
    """Wall time, time to each request's first token and the token ids of one batched generation."""
    start = time.perf_counter()
    first: dict[int, float] = {}
    tokens = run(prompts, max_tokens, lambda i: first.setdefault(i, time.perf_counter() - start))
    seconds = time.perf_counter() - start
    generated = sum(len(t) for t in tokens)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tok_s": generated / seconds,
        "ttft_s": statistics.median(first.values()) if first else None,
    }


def _stock_runner(path):
    """Stock mlx-lm's `batch_generate` on `path` fully resident, in od-moe's compute dtype, warmed up."""
    model, tokenizer = stock_model(path)

    def run(prompts, n, seen):
        ids = [tokenizer.encode(p) for p in prompts]
        out = mlx_lm_batch_generate(model, tokenizer, ids, max_tokens=n, return_token_ids=True)
        for i in range(len(ids)):
            seen(i)  # mlx-lm's batch_generate returns at the end: its first tokens are not observable
        return out.token_ids

    run(["def f(x):\n"], 2, lambda i: None)
    return run


def _od_moe(path, capacity, prompts, max_tokens) -> dict:
    """One batch on a fresh engine (so every row starts from the same empty cache)."""
    engine = load(str(path), capacity=capacity)

    def run(texts, n, seen):
        tokens = [[] for _ in texts]
        for step in engine.stream_batch_generate(texts, max_tokens=n):
            for t in step:
                seen(t.index)
                if t.finish_reason != "stop":
                    tokens[t.index].append(t.token)
        return tokens

    result = _decode(run, prompts, max_tokens)
    stats = engine.stats()
    generated = max(stats["generated_tokens"], 1)
    # two-tier mode reads nothing from disk: its bytes are the experts it moved across the bus
    two_tier = engine.mode.tiered
    moved = experts_across_bus(engine) if two_tier else stats["total"]["experts_read"]
    result["experts_per_token"] = moved / generated
    result["hit_rate"] = stats["total"]["decode"]["hit_rate"]
    engine.close()
    return result


def _median_run(runs: list[dict]) -> dict:
    """The run of median throughput (its other figures with it)."""
    return sorted(runs, key=lambda r: r["tok_s"])[len(runs) // 2]


def run_batch_grid(sizes, capacities, max_tokens, widen, workdir: Path, say=print, rounds: int = 3) -> dict:
    """The batch rows for the embedded model (and its widened copy when `widen`), as printed. Each batch
    runs `rounds` times, stock and od-moe's capacities alternating, and the median run counts (machines
    are noisy: a lone batch-1 run would set every gain)."""
    say = say or (lambda *_: None)
    models = [("bundled", DEFAULT_MODEL)]
    if widen:
        models.append(("widened", widen_model(DEFAULT_MODEL, workdir / f"widened-x{widen}", widen)))
    rows, sizes = [], sorted(sizes)
    for name, path in models:
        prompts, stock_run = batch_prompts(max(sizes)), _stock_runner(path)
        base: dict[float, dict] = {}  # each capacity's run at the first (smallest) size
        stock_base: float | None = None  # stock's tok/s at the first size
        for capacity in capacities:  # kernels compiled and files in the page cache before any row
            _od_moe(path, capacity, prompts[:2], 2)
        for size in sizes:
            runs: dict[str | float, list[dict]] = {key: [] for key in ["stock", *capacities]}
            for _ in range(rounds):
                runs["stock"].append(_decode(stock_run, prompts[:size], max_tokens))
                for capacity in capacities:
                    runs[capacity].append(_od_moe(path, capacity, prompts[:size], max_tokens))
            stock = _median_run(runs["stock"])
            if stock_base is None:
                stock_base = stock["tok_s"]
            for capacity in capacities:
                got = _median_run(runs[capacity])
                base.setdefault(capacity, got)
                rows.append(
                    {
                        "model": name,
                        "capacity": capacity,
                        "batch": size,
                        "tok_s": got["tok_s"],
                        "tok_s_per_request": got["tok_s"] / size,
                        "ttft_s": got["ttft_s"],
                        "experts_per_token": got["experts_per_token"],
                        "experts_per_token_vs_batch_1": got["experts_per_token"]
                        / max(base[capacity]["experts_per_token"], 1e-9),
                        "hit_rate": got["hit_rate"],
                        "gain": got["tok_s"] / base[capacity]["tok_s"],
                        "stock_tok_s": stock["tok_s"],
                        "stock_gain": stock["tok_s"] / stock_base,
                        "same_tokens": got["tokens"] == stock["tokens"],
                    }
                )
    columns = ["model", "capacity", "batch", "tok/s", "tok/s each", "ttft s", "experts/tok", "x batch 1"]
    columns += ["decode hit", "gain", "stock tok/s", "stock gain", "gain / stock's", "same tokens"]
    say(
        table(
            columns,
            [
                [
                    r["model"],
                    f"{r['capacity']:.1%}",
                    r["batch"],
                    r["tok_s"],
                    r["tok_s_per_request"],
                    r["ttft_s"],
                    r["experts_per_token"],
                    r["experts_per_token_vs_batch_1"],
                    r["hit_rate"],
                    r["gain"],
                    r["stock_tok_s"],
                    r["stock_gain"],
                    r["gain"] / r["stock_gain"],
                    r["same_tokens"],
                ]
                for r in rows
            ],
            title=f"Batched greedy decoding, {max_tokens} tokens per request, warm reads, median of {rounds} "
            "rounds; stock mlx-lm fully resident in the same process, alternating",
        )
    )
    return {"rows": rows}
