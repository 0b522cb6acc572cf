"""Lab: cProfile of three tiers decoding on this CPU (the bundled model, device 16 + host 16 of 64): one
prompt to warm up, then two prompts x 32 tokens profiled; prints the seconds and the 30 costliest calls by
cumulative time. Usage: python lab/three_tiers/profile_cpu.py"""

import cProfile
import pstats
import time

import od_moe
from od_moe.two_tier.settings import TwoTierSettings

engine = od_moe.load(capacity=0.25, two_tier=True, path_settings=TwoTierSettings(host_experts=16))
list(engine.stream_generate("def fibonacci(n):", max_tokens=32))
start = time.perf_counter()
profile = cProfile.Profile()
profile.enable()
for prompt in ["import os\nimport sys\n\n", "class Stack:\n    def __init__(self):"]:
    list(engine.stream_generate(prompt, max_tokens=32))
profile.disable()
print("seconds", time.perf_counter() - start)
pstats.Stats(profile).sort_stats("cumulative").print_stats(30)
