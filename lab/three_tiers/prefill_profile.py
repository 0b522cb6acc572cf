"""Lab: profile one long prompt's pass on a two-tier row (`benchmarks/two_tier.py`'s row syntax, e.g.
`tt:0.25:host=32:disk=none`): the prompt's wall time and cProfile's top functions by cumulative time and by
own time. Every `--stacks` seconds meanwhile every thread's stack goes to stderr (a pass that never ends
still says where it is).

    python lab/three_tiers/prefill_profile.py MODEL ROW [--tokens 4096] [--top 30] [--direct-io on]
        [--stacks 30]
"""

import argparse
import cProfile
import faulthandler
import pstats
import runpy
import time
from pathlib import Path

import od_moe


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("row")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--direct-io", default="on", choices=["on", "off"])
    parser.add_argument("--stacks", type=float, default=30.0, help="seconds between stack dumps")
    args = parser.parse_args()
    bench = runpy.run_path(str(Path(__file__).parents[2] / "benchmarks" / "two_tier.py"))
    kind, fraction, *knobs = args.row.split(":")
    settings = bench["settings_for"](knobs, Path(args.model))
    engine = od_moe.load(
        args.model,
        capacity=float(fraction),
        two_tier=True,
        path_settings=settings,
        direct_io=args.direct_io == "on",
    )
    print(engine.mode)
    prompt = bench["prefill_prompt"](engine.tokenizer, args.tokens)
    list(engine.stream_generate(prompt[:64], max_tokens=2))  # kernels
    faulthandler.dump_traceback_later(args.stacks, repeat=True)
    profile = cProfile.Profile()
    start = time.perf_counter()
    profile.enable()
    out = list(engine.stream_generate(prompt, max_tokens=1))
    profile.disable()
    faulthandler.cancel_dump_traceback_later()
    print(f"{len(prompt)} tokens: {time.perf_counter() - start:.2f} s, prompt {out[-1].prompt_tps:.1f} tok/s")
    print(engine.stats().get("io", {}))
    pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()
