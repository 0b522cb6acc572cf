"""Lab: profile the decode of a two-tier row (`benchmarks/two_tier.py`'s row syntax, e.g.
`tt:0.25:host=32:disk=none`): the bench's prompts, `--tokens` each, after one warm prompt; each token's
milliseconds (sorted, in deciles), the engine's tier figures (reruns, waits, disk bytes), passes run again
by the MoE layer of their first miss, MoE layer passes computed a token, host syncs, and cProfile's top
functions by cumulative and by own time: where the main thread's time per token goes.

    python lab/three_tiers/decode_profile.py MODEL ROW [ROW ...] [--tokens 32] [--top 30] [--direct-io on]
"""

import argparse
import cProfile
import gc
import json
import pstats
import runpy
import time
from pathlib import Path

import numpy as np

import od_moe
from od_moe.bench.foundation import PROMPTS


def profile_row(model: str, row: str, bench: dict, tokens: int, top: int, direct_io: bool):
    kind, fraction, *knobs = row.split(":")
    settings = bench["settings_for"](knobs, Path(model))
    engine = od_moe.load(
        model, capacity=float(fraction), two_tier=True, path_settings=settings, direct_io=direct_io
    )
    print(f"== {row}: {engine.mode}", flush=True)
    list(engine.stream_generate(PROMPTS[0], max_tokens=8))  # kernels, the first reads
    engine.reset_stats()
    syncs = engine.runtime.host_syncs
    gaps: list[float] = []
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    for prompt in PROMPTS:
        last = None
        for _ in engine.stream_generate(prompt, max_tokens=tokens):
            now = time.perf_counter()
            if last is not None:  # decode tokens only: the first comes with the prompt
                gaps.append(1000 * (now - last))
            last = now
    profile.disable()
    wall = time.perf_counter() - start
    ms = np.array(gaps)
    print(
        f"{len(ms)} decode tokens, {wall:.2f} s in all; ms a token mean {ms.mean():.2f}, deciles "
        + " ".join(f"{v:.1f}" for v in np.percentile(ms, np.arange(0, 101, 10)))
    )
    stats = engine.stats()
    reruns = engine.runtime.ledger.snapshot().field("reruns").sum(axis=0)  # by the layer first missed
    print("passes run again by first missing layer:", [int(n) for n in reruns])
    print("host syncs a decode token:", round((engine.runtime.host_syncs - syncs) / max(len(ms), 1), 2))
    print("tiers:", json.dumps(stats.get("tiers", {}), default=str)[:1500])
    print("io:", json.dumps(stats.get("io", {}), default=str)[:1500])
    calls = sum(v[1] for k, v in pstats.Stats(profile).stats.items() if k[2] == "layer_pass")  # type: ignore[attr-defined]
    print("MoE layer passes a decode token:", round(calls / max(len(ms), 1), 2), "of", len(engine.caches))
    pstats.Stats(profile).sort_stats("cumulative").print_stats(top)
    pstats.Stats(profile).sort_stats("tottime").print_stats(top)
    engine.close()
    gc.collect()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("rows", nargs="+")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--direct-io", default="on", choices=["on", "off"])
    args = parser.parse_args()
    bench = runpy.run_path(str(Path(__file__).parents[2] / "benchmarks" / "two_tier.py"))
    for row in args.rows:
        profile_row(args.model, row, bench, args.tokens, args.top, args.direct_io == "on")


if __name__ == "__main__":
    main()
