"""Lab: how long `od_moe.load` and its stacks' reads (`two_tier/mapped.read_stack`) take, under cProfile, for
one two-tier model at 25%, and the calls that took longest (cumulative) where TOP is given. Run it in
alternating processes with PYTHONPATH at two checkouts to compare.

  PYTHONPATH=CHECKOUT python3 lab/cold_start/load_profile.py LABEL MODEL [TOP]
"""

import cProfile
import pstats
import sys
import time

import od_moe

profile = cProfile.Profile()
start = time.perf_counter()
profile.enable()
engine = od_moe.load(sys.argv[2], capacity=0.25, two_tier=True, prefetch="none")
profile.disable()
load = time.perf_counter() - start
reads = [v[3] for k, v in pstats.Stats(profile).stats.items() if k[2] == "read_stack"]
print(f"{sys.argv[1]} load {load:.2f} s, read_stack {reads[0]:.2f} s", flush=True)
if len(sys.argv) > 3:
    pstats.Stats(profile).sort_stats("cumulative").print_stats(int(sys.argv[3]))
