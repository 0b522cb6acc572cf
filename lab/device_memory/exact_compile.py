"""Lab: does compiling a whole MoE block (`layer_step.CompiledBlock`) change the tokens (not product code)?
Stock mlx-lm against od-moe two tiers at 100%: as built, with every block run eagerly (its switch still
compiled), and with MLX_DISABLE_COMPILE set by the caller. python3 lab/device_memory/exact_compile.py MODEL"""

import sys

from mlx_lm import load, stream_generate

import od_moe
from od_moe.two_tier import TwoTierSettings
from od_moe.two_tier.layer_step import CompiledBlock

model = sys.argv[1]
m, tok = load(model)
prompts = ["def fib(n):", "Once upon a time"]
stock = [[r.token for r in stream_generate(m, tok, p, max_tokens=16)] for p in prompts]
del m
for eager in (False, True):
    settings = TwoTierSettings(compile_blocks=not eager)
    engine = od_moe.load(model, capacity=1.0, two_tier=True, path_settings=settings)
    blocks = [b for _, b in engine.model.named_modules() if isinstance(b, CompiledBlock)]
    got = [[r.token for r in engine.stream_generate(p, max_tokens=16)] for p in prompts]
    print(f"blocks {len(blocks)} eager={eager}: equal {[g == s for g, s in zip(got, stock)]}", flush=True)
    del engine
