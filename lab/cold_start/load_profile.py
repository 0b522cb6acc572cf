"""Lab: how long `od_moe.load` and its stacks' reads (`two_tier/mapped.read_stacks`, `read_stack` before
0f94c3c) take, under cProfile, for a model at 25% (two-tier where `load` picks it: on CUDA), then how long
the first token of a short prompt takes after the load, and the first tokens of two more; with TOP, the
calls that took longest in each (cumulative, then by own time). Run it in alternating processes with
PYTHONPATH at two checkouts to compare.

  PYTHONPATH=CHECKOUT [WARM=1] python3 lab/cold_start/load_profile.py LABEL MODEL [TOP]

WARM=1: before the first token, compile the device-kept rows' kernel for one sequence's lanes
(`prepare_batches`), timed apart: what of the first token is that compile.
"""

import cProfile
import os
import pstats
import sys
import time

import od_moe
from od_moe.memory.capacity import experts_per_token


def show(profile, top):
    pstats.Stats(profile).sort_stats("cumulative").print_stats(top)
    pstats.Stats(profile).sort_stats("tottime").print_stats(top)


top = int(sys.argv[3]) if len(sys.argv) > 3 else 0
profile = cProfile.Profile()
start = time.perf_counter()
profile.enable()
engine = od_moe.load(sys.argv[2], capacity=0.25)  # as `command_to_token.py` loads it
profile.disable()
load = time.perf_counter() - start
reads = [v[3] for k, v in pstats.Stats(profile).stats.items() if k[2] in ("read_stack", "read_stacks")]
print(f"{sys.argv[1]} load {load:.2f} s, read_stack {sum(reads):.2f} s", flush=True)
if top:
    show(profile, top)
if os.environ.get("WARM"):  # the device-kept rows' kernel compiled first, for one sequence's lanes
    start = time.perf_counter()
    engine.runtime.prepare_batches(experts_per_token(engine.model))
    print(f"{sys.argv[1]} prepare_batches {time.perf_counter() - start:.2f} s", flush=True)
first = cProfile.Profile()
start = time.perf_counter()
first.enable()
next(engine.stream_generate("def fibonacci(n):\n", max_tokens=1))
first.disable()
print(f"{sys.argv[1]} first token {time.perf_counter() - start:.2f} s after the load", flush=True)
if top:
    show(first, top)
# what of the first token is once a process: the next prompts' first tokens, then a decoded token's time
for prompt in ("class Stack:\n", "import os\n"):
    start = time.perf_counter()
    times = [time.perf_counter() for _ in engine.stream_generate(prompt, max_tokens=8)]
    print(
        f"{sys.argv[1]} next prompt: first token {times[0] - start:.3f} s, then "
        f"{(times[-1] - times[0]) / (len(times) - 1) * 1e3:.1f} ms a token",
        flush=True,
    )
