"""The foundation benchmark: speed, memory, hit rate and reads of od-moe against stock mlx-lm.

Two parts, each in one process so ratios are taken side by side:
1. The bundled model: stock mlx-lm, then od-moe (exact) at each capacity; decode tok/s and its ratio to
   stock, peak memory, decode hit rate, bytes read per token, and whether the tokens equal stock's.
2. A widened copy (see `widen.py`) where reads matter: stock mlx-lm fully resident gives the compute cost
   per token; od-moe runs under memory budgets sized for each capacity, with the page cache dropped and
   every read made cold, and reports bytes read, stall (waiting for reads) and install time per decoded
   token, peak memory against the budget, and tok/s as a ratio to the resident model.
"""

import platform
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate as mlx_lm_stream_generate

from .. import load
from ..accounting.report import mb, table
from ..engine import DEFAULT_MODEL
from ..memory import backend
from ..memory.capacity import budget_for, working_nbytes
from ..units import KB, MB
from .widen import widen_model

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):"]


def decoded(generator, gaps: list | None = None):
    """The tokens of a generation and its last response; into `gaps` (if given) the seconds between one
    response and the next, from the first token on (each decoded token's time as the caller sees it)."""
    tokens, last, times = [], None, []
    for last in generator:
        times.append(time.perf_counter())
        tokens.append(last.token)
    if gaps is not None:
        gaps.extend(b - a for a, b in zip(times, times[1:]))
    return tokens, last


def stock_decode(model, tokenizer, prompt: str, max_tokens: int, gaps=None) -> tuple[float, list[int]]:
    """Decode tok/s of one greedy stock mlx-lm generation, and its tokens; each decoded token's seconds
    into `gaps` where given (`decoded`)."""
    tokens, last = decoded(mlx_lm_stream_generate(model, tokenizer, prompt, max_tokens=max_tokens), gaps)
    return last.generation_tps, tokens


def stock_model(path):
    """Stock mlx-lm's model and tokenizer for `path`, every expert resident, cast as od-moe computes on
    this backend (`backend.compute_dtype`): the reference the benchmarks compare with."""
    model, tokenizer = mlx_lm_load(str(path))
    dtype = backend.compute_dtype()
    if dtype is not None:
        model.set_dtype(dtype)
    return model, tokenizer


def run_stock(path, prompts, max_tokens):
    """Stock mlx-lm with od-moe's backend cast: tokens, decode tok/s, peak memory."""
    mx.clear_cache()
    backend.reset_peak_memory()
    model, tokenizer = stock_model(path)
    tokens, tps = [], []
    for p in prompts:
        t, last = decoded(mlx_lm_stream_generate(model, tokenizer, p, max_tokens=max_tokens))
        tokens.append(t)
        tps.append(last.generation_tps)
    peak = backend.peak_memory_bytes()
    del model
    mx.clear_cache()
    return {"tokens": tokens, "tok_s": sum(tps) / len(tps), "peak_bytes": peak}


def _stock_row(model: str, stock: dict, **extra) -> dict:
    return {
        "model": model,
        "capacity": 1.0,
        "policy": "stock mlx-lm",
        "tok_s": stock["tok_s"],
        "tok_s_ratio_resident": 1.0,
        "peak_bytes": stock["peak_bytes"],
        "exact": True,
        **extra,
    }


def run_od_moe(path, prompts, max_tokens, cold=False, **load_kwargs):
    """od-moe on the same prompts: tokens, decode tok/s, and the engine's statistics."""
    mx.clear_cache()
    backend.reset_peak_memory()
    engine = load(str(path), **load_kwargs)
    load_peak = engine.load_peak_bytes
    store = engine.runtime.store
    store.drop_pages_after_read(cold)
    tokens, tps = [], []
    for p in prompts:
        if cold:
            store.drop_page_cache()
        t, last = decoded(engine.stream_generate(p, max_tokens=max_tokens))
        tokens.append(t)
        tps.append(last.generation_tps)
    stats = engine.stats()
    del engine
    mx.clear_cache()
    return {"tokens": tokens, "tok_s": sum(tps) / len(tps), "stats": stats, "load_peak_bytes": load_peak}


def _row(model, capacity_fraction, result, stock, budget=None):
    stats = result["stats"]
    decode_passes = max(stats["positions"]["decode"], 1)
    io = stats["io"]["decode"]
    peak = max(stats["memory"]["peak_bytes"], result["load_peak_bytes"])
    return {
        "model": model,
        "capacity": capacity_fraction,
        "slots": stats["capacity"],
        "miss_policy": stats["miss_policy"],
        "eviction": stats["eviction"],
        "reads": "cold" if budget is not None else "warm",
        "hit_rate": stats["total"]["decode"]["hit_rate"],
        "prefill_hit_rate": stats["total"]["prefill"]["hit_rate"],
        "bytes_per_token": io["bytes_read"] / decode_passes,
        "stall_ms_per_token": io["stall_s"] * 1e3 / decode_passes,
        "install_ms_per_token": io["install_s"] * 1e3 / decode_passes,
        "tok_s": result["tok_s"],
        "tok_s_ratio_resident": result["tok_s"] / stock["tok_s"],
        "peak_bytes": peak,
        "budget_bytes": budget,
        "exact": result["tokens"] == stock["tokens"],
    }


def run_foundation(capacities, max_tokens, widen, widened_tokens, workdir: Path, printer=print):
    say = printer or (lambda *_: None)
    rows = []
    say(f"od-moe bench on {platform.machine()} {mx.default_device()}, {len(PROMPTS)} prompts")
    stock = run_stock(DEFAULT_MODEL, PROMPTS, max_tokens)
    rows.append(_stock_row("bundled", stock))
    for fraction in capacities:
        for eviction in ("lru", "lfu") if fraction < 1 else ("lru",):
            result = run_od_moe(DEFAULT_MODEL, PROMPTS, max_tokens, capacity=fraction, eviction=eviction)
            rows.append(_row("bundled", fraction, result, stock))
    say(
        table(
            [
                "capacity",
                "eviction",
                "exact",
                "decode hit",
                "decode tok/s",
                "x stock",
                "kB read/tok",
                "stall ms/tok",
                "peak MB",
            ],
            [
                [
                    r.get("policy") or f"{r['capacity']:.1%}",
                    r.get("eviction"),
                    r["exact"],
                    r.get("hit_rate"),
                    r["tok_s"],
                    r["tok_s_ratio_resident"],
                    None if "bytes_per_token" not in r else r["bytes_per_token"] / KB,
                    r.get("stall_ms_per_token"),
                    mb(r["peak_bytes"]),
                ]
                for r in rows
            ],
            title=f"\nBundled model, {max_tokens} greedy tokens per prompt, load (exact) mode",
        )
    )
    if widen:
        t0 = time.perf_counter()
        wide = widen_model(DEFAULT_MODEL, workdir / f"widened-x{widen}", widen)
        say(f"\nwidened model x{widen} at {wide} ({time.perf_counter() - t0:.1f}s to build or verify)")
        rows += _run_widened(wide, widen, capacities, widened_tokens, say)
    return {"rows": rows}


def _run_widened(path, factor, capacities, max_tokens, say):
    stock = run_stock(path, PROMPTS, max_tokens)
    probe = load(str(path), capacity=1)
    slot, layers, non_expert = probe.caches[0].slot_nbytes, len(probe.caches), probe.non_expert_nbytes
    expert_disk = probe.caches[0].layout.expert_nbytes
    working = working_nbytes(probe.model, layers, probe.num_experts, kv_per_token=probe.kv_nbytes_per_token)
    del probe
    rows = [_stock_row("widened", stock, compute_ms_per_token=1e3 / stock["tok_s"])]
    for fraction in capacities:
        if fraction >= 1:
            continue
        slots = max(1, round(fraction * 64))
        budget = budget_for(slots, layers, slot, non_expert, working)
        result = run_od_moe(path, PROMPTS, max_tokens, cold=True, memory_budget=budget)
        rows.append(_row("widened", fraction, result, stock, budget=budget))
    say(
        table(
            [
                "capacity",
                "exact",
                "decode hit",
                "MB read/tok",
                "stall ms/tok",
                "install ms/tok",
                "tok/s",
                "x resident",
                "peak MB",
                "budget MB",
                "peak/budget",
            ],
            [
                [
                    r.get("policy") or f"{r['capacity']:.1%}",
                    r["exact"],
                    r.get("hit_rate"),
                    None if "bytes_per_token" not in r else mb(r["bytes_per_token"]),
                    r.get("stall_ms_per_token"),
                    r.get("install_ms_per_token"),
                    r["tok_s"],
                    r["tok_s_ratio_resident"],
                    mb(r["peak_bytes"]),
                    None if not r.get("budget_bytes") else mb(r["budget_bytes"]),
                    None if not r.get("budget_bytes") else r["peak_bytes"] / r["budget_bytes"],
                ]
                for r in rows
            ],
            title=(
                f"Widened model (experts x{factor}: {expert_disk / MB:.2f} MB each on disk), "
                f"{max_tokens} tokens "
                f"per prompt, cold reads, memory budget sized per capacity; stock compute "
                f"{1e3 / stock['tok_s']:.0f} ms/token"
            ),
        )
    )
    return rows
