"""The two-tier grid of `od-moe bench` (`--two-tier` alone, and after the prefetch grid with `--gpu`): how
close to stock mlx-lm decoding gets when misses are read in place from host memory
(`two_tier/two_tier_runtime.py`), and how close to the bound the machine sets.

Per model (the bundled one, and the widened copy unless `--widen 0`) and per fraction of experts in device
slots (0 / 25 / 50 / 100%), one engine in two-tier mode, with the slots "auto" would keep there (the
device's least recently used for large experts, some in slots: `assembly.auto_tiers`), is
warmed on a prompt of its own, then alternates prompt by prompt with stock mlx-lm in the same process for
`rounds` rounds (x stock: the median of the rounds' ratios; machines drift, the ratio within a round
holds). Then the same prompts once more with the routing recorded, for Belady's MIN on it (greedy decoding
routes every round alike).

Bytes moved per decoded token are the experts the device read in place (mapped lanes, the misses) plus
those copied into slots (with device-kept slots, each miss is one copy), against MIN's reads at the same
number of slots (from empty caches at each prompt, decode passes only: the fewest experts a cache that
holds what it computes on must take in; a miss read in place takes nothing in, so a policy could move
fewer). The roofline is a bound: max(the resident step, stock's ms per token; moved bytes / the faster of
two bandwidths the runtime measures (`Runtime.transfer_rates`): one layer's computation reading every expert
of the mapped stack in place, and a staged pass's copy of them to the device). On the CPU and
Metal the stack is plain memory: the counts and tokens hold, the speeds are that machine's.
Not here: the two-tier runtime (`two_tier/two_tier_runtime.py`), the per-layer path's grid (`prefetch.py`).
"""

import gc
import statistics
import time
from pathlib import Path

import mlx.core as mx

from .. import load
from ..accounting.ledger import experts_moved
from ..accounting.report import table
from ..assembly import auto_tiers
from ..caching.replay import replay_recording
from ..preflight import inspect_model
from ..runtime import TwoTierMode
from ..units import MB
from .foundation import PROMPTS, decoded, stock_decode, stock_model
from .roofline import roofline_ms

WARM_PROMPT = "from collections import defaultdict\n\n\ndef group(items, key):\n    "
FRACTIONS = (0.0, 0.25, 0.5, 1.0)


def experts_across_bus(engine, phase: str | None = None) -> float:
    """Experts a two-tier engine moved across the bus in `phase` (None: both): lanes read in place (misses),
    the distinct experts staged passes copied from host rows (once for all their lanes:
    `two_tier/staged_passes.py`), and copies into slots. With device-kept rows (`two_tier="lru"`) a miss is
    copied into a row and read there, so a pass moves its copies, and a staged pass also the experts no row
    held after them; a pass of one position copies every miss (its top-k fit in the rows at every fraction the
    benches run)."""
    engine.stats()  # settled: the device's counts read
    return experts_moved(engine.runtime.ledger, True, engine.runtime.figures().kept_by_device, phase)


def moved_per_token(engine) -> float:
    """Experts that crossed the bus per decoded token (`experts_across_bus`)."""
    stats = engine.stats()
    return experts_across_bus(engine, "decode") / max(1, stats["positions"]["decode"])


def load_stock(path: Path, tokens: int):
    """Stock mlx-lm on `path` (`stock_model`), warmed up, and its greedy tokens for `PROMPTS`."""
    stock, tokenizer = stock_model(path)
    stock_decode(stock, tokenizer, WARM_PROMPT, 8)
    return stock, tokenizer, [stock_decode(stock, tokenizer, p, tokens)[1] for p in PROMPTS]


def alternate(engine, stock, tokenizer, reference, tokens: int, rounds: int, gaps: dict | None = None):
    """Rounds of `PROMPTS`, stock and `engine` alternating prompt by prompt: (each round's tok/s over
    stock's, (stock tok/s, tok/s) per round, prompts that gave stock's tokens). `gaps`: where given, each
    decoded token's seconds as the loop saw them go into its lists "stock" and "row"."""
    ratios, speeds, same = [], [], 0
    gaps = {} if gaps is None else gaps
    stock_gaps, row_gaps = gaps.setdefault("stock", []), gaps.setdefault("row", [])
    for _ in range(rounds):
        pairs = []
        for i, prompt in enumerate(PROMPTS):
            stock_tps = stock_decode(stock, tokenizer, prompt, tokens, stock_gaps)[0]
            got, last = decoded(engine.stream_generate(prompt, max_tokens=tokens), row_gaps)
            same += got == reference[i]
            pairs.append((stock_tps, last.generation_tps))
        speeds.append(tuple(statistics.mean(p[k] for p in pairs) for k in (0, 1)))
        ratios.append(speeds[-1][1] / speeds[-1][0])
    return ratios, speeds, same


def _min_reads_per_token(engine, tokens: int) -> float | None:
    """Belady's MIN on the prompts' routing at the engine's slots, experts per decoded token."""
    if engine.capacity in (0, engine.caches[0].num_experts):
        return None  # nothing to choose: every lane mapped, or every expert in a slot
    engine.runtime.start_recording()
    for prompt in PROMPTS:
        list(engine.stream_generate(prompt, max_tokens=tokens))
    recording = engine.runtime.stop_recording()
    tally = replay_recording(recording, engine.capacity, "min")
    return tally.reads / max(1, tally.passes)


def run_row(
    path: Path,
    fraction: float,
    slot_nbytes: int,
    stock,
    tokenizer,
    reference,
    tokens: int,
    rounds: int,
    bw=None,
):
    """One fraction of experts in slots, of `slot_nbytes` each (which slots "auto" keeps); `bw`: the bus
    bandwidths (`Runtime.transfer_rates`: read in place, copied, the best; measured here where None)."""
    two_tier = auto_tiers("auto", TwoTierMode.ON, "", slot_nbytes, fraction)[0].argument  # "lru", or True
    t0 = time.perf_counter()
    engine = load(str(path), capacity=fraction, two_tier=two_tier)
    load_s = time.perf_counter() - t0
    bw = bw or engine.runtime.transfer_rates()
    for _ in range(2):  # kernels, then admission settles on the warm prompt's experts
        list(engine.stream_generate(WARM_PROMPT, max_tokens=tokens))
    engine.reset_stats()
    ratios, speeds, same = alternate(engine, stock, tokenizer, reference, tokens, rounds)
    stats = engine.stats()
    memory = stats["memory"]  # as the driver and the OS count it (`backend.memory_in_use`)
    passes = max(1, stats["positions"]["decode"])
    mapped = stats["total"]["decode"]["misses"] / passes
    copies = stats["io"]["decode"]["experts_loaded"] / passes
    expert_bytes = engine.caches[0].layout.expert_nbytes
    kept = engine.runtime.figures().kept_by_device
    moved = moved_per_token(engine)
    minimum = _min_reads_per_token(engine, tokens)
    stock_tps = statistics.median(s for s, _ in speeds)
    tps = statistics.median(t for _, t in speeds)
    floor_ms, bound = roofline_ms(1e3 / stock_tps, moved * expert_bytes, bw["best"], 0, 1)
    row = {
        "capacity": fraction,
        "slots": engine.capacity,
        "slots_kind": "lru" if kept else "counted",
        "decode_hit_rate": stats["total"]["decode"]["hit_rate"],
        "mapped_per_token": mapped,
        "copies_per_token": copies,
        "moved_bytes_per_token": moved * expert_bytes,
        "min_per_token": minimum,
        "moved_over_min": moved / minimum if minimum else None,
        "stock_tok_s": stock_tps,
        "tok_s": tps,
        "x_stock": statistics.median(ratios),
        "x_stock_rounds": [round(r, 3) for r in ratios],
        "x_stock_spread": [min(ratios), max(ratios)],
        "device_bytes": memory["device_bytes"],
        "host_bytes": memory["host_bytes"],
        "bus_bw": bw,
        "roofline_ms_per_token": floor_ms,
        "roofline_bound": "pcie" if bound == "read" else bound,
        "x_roofline": floor_ms / (1e3 / tps),
        "same_tokens": f"{same}/{rounds * len(PROMPTS)}",
        "exact": same == rounds * len(PROMPTS),
        "load_s": load_s,
        "stack_moves": engine.runtime.figures().stack_moves,
    }
    del engine
    gc.collect()
    mx.clear_cache()
    return row


COLUMNS = (
    ("slots", lambda r: f"{r['capacity']:.1%}"),
    ("kept by", lambda r: "device (lru)" if r["slots_kind"] == "lru" else "counts"),
    ("decode hit", lambda r: r["decode_hit_rate"]),
    ("mapped/tok", lambda r: r["mapped_per_token"]),
    ("copies/tok", lambda r: r["copies_per_token"]),
    ("MB moved/tok", lambda r: r["moved_bytes_per_token"] / MB),
    ("MIN/tok", lambda r: r["min_per_token"]),
    ("x MIN", lambda r: r["moved_over_min"]),
    ("stock tok/s", lambda r: r["stock_tok_s"]),
    ("tok/s", lambda r: r["tok_s"]),
    ("x stock", lambda r: r["x_stock"]),
    ("spread", lambda r: "{:.3f}-{:.3f}".format(*r["x_stock_spread"])),
    ("roofline ms", lambda r: r["roofline_ms_per_token"]),
    ("bound", lambda r: r["roofline_bound"]),
    ("x roofline", lambda r: r["x_roofline"]),
    ("same tokens", lambda r: r["same_tokens"]),
    ("device GB", lambda r: None if r["device_bytes"] is None else r["device_bytes"] / 1e9),
    ("host GB", lambda r: None if r["host_bytes"] is None else r["host_bytes"] / 1e9),
)


def run_two_tier_grid(models: list[tuple[str, Path, int]], fractions, rounds: int, printer=print) -> dict:
    """`models`: (name, folder, new tokens per prompt). Rows of every model at every fraction."""
    say = printer or (lambda *_: None)
    rows = []
    for name, path, tokens in models:
        stock, tokenizer, reference = load_stock(path, tokens)
        bw, model_rows = None, []
        slot_nbytes = inspect_model(path)["expert_bytes"]  # as `load` counts a slot; no expert is read
        for fraction in fractions:
            row = run_row(path, fraction, slot_nbytes, stock, tokenizer, reference, tokens, rounds, bw)
            bw = row["bus_bw"]
            model_rows.append({"model": name, **row})
            say(f"  {name} {fraction:.1%}: x stock {row['x_stock']:.3f}, x roofline {row['x_roofline']:.3f}")
        assert bw is not None  # the first row measured it: `fractions` is never empty (`_capacities`)
        title = (
            f"\n{name} model, two-tier mode on {mx.default_device()}, {len(PROMPTS)} prompts x {tokens} "
            f"greedy tokens, {rounds} rounds alternating with stock mlx-lm; experts cross the bus at "
            f"{bw['best'] / 1e9:.2f} GB/s (read in place {bw['in_place'] / 1e9:.2f}, copied "
            f"{bw['copied'] / 1e9:.2f})"
        )
        say(
            table(
                [c for c, _ in COLUMNS], [[cell(r) for _, cell in COLUMNS] for r in model_rows], title=title
            )
        )
        rows += model_rows
        del stock
        gc.collect()
        mx.clear_cache()
    return {"rows": rows}
