"""The host's time of a decoded token's forward (the model call that builds the pass's graph) on this CPU:
stock mlx-lm against two-tier mode's device path (`KeptRows` deciding in its kernel, each MoE block one
compiled call), with the kernel replaced by a stand-in of plain MLX operations that gives its outputs'
shapes and leaves every lane reading its expert's own row (so tokens stay stock's). What it measures is
the Python and graph-building work a layer adds, which is the same on every backend; what it cannot: the
kernel's encoding and device time (CUDA only: `lab/tools/host_time.py`, `per_layer_cost.sh`).

    python3 lab/tools/forward_host_cpu.py [MODEL] [TOKENS] [--profile]

Per decoded token (the first excluded), medians over rounds of the bench's prompts, stock then the row;
`--profile` prints cProfile's top functions of the row's forward. Not a test or a bench: a lab measurement.
"""

import cProfile
import pstats
import statistics
import sys
from unittest import mock

import host_time
import mlx.core as mx
import mlx_lm

import od_moe
from od_moe.bench.foundation import PROMPTS
from od_moe.bench.two_tier_grid import WARM_PROMPT
from od_moe.two_tier.kernels import FUSED_OUTPUTS, KEPT_ROWS_INPUTS, KEPT_ROWS_OUTPUTS
from od_moe.two_tier.settings import KeptRowsSettings, TwoTierSettings

ROUNDS = 3


def stand_in(tables: bool):
    """A callable with `mx.fast.cuda_kernel`'s keywords whose outputs have the kernel's shapes and dtypes:
    rows and state as they came in, each lane reading its expert's own row."""
    names = list(KEPT_ROWS_OUTPUTS if tables else FUSED_OUTPUTS)

    def call(inputs, output_shapes, output_dtypes, **_):
        state = dict(zip(KEPT_ROWS_INPUTS, inputs[-len(KEPT_ROWS_INPUTS) :]))
        cand, base = state["cand"], state["base"]
        lanes = output_shapes[names.index("lane_rows")][0]  # the padded count; past the ids given: row E
        if cand.size < lanes:
            cand = mx.concatenate([cand, mx.full((lanes - cand.size,), base.size, cand.dtype)])
        made = dict(rows=base, found=base, held_out=state["held"], age_out=state["age"])
        made.update(counted_out=state["counted"], score_out=state["score"], lane_rows=cand)
        made.update(lane_hit=cand < 0)
        return [
            (made[n] + 0).astype(d).reshape(s) if made[n].size == mx.zeros(s).size else mx.zeros(s, d)
            for n, s, d in zip(names, output_shapes, output_dtypes)
        ]

    return call


def kernel_stand_in(name: str, **_):
    """`mx.fast.cuda_kernel` while the row runs: the kept rows' kernel (a fused pass's or one with tables, by
    its name) as `stand_in` (the kept rows make their kernels at their first call)."""
    return stand_in(tables="fused" not in name)


DEVICE_PATH = TwoTierSettings(kept_rows=KeptRowsSettings(by_kernel=True))  # the kept rows' device path


def main():
    with mock.patch.object(mx.fast, "cuda_kernel", kernel_stand_in):  # the kept rows' kernels, stood in
        measure()


def measure():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    path = args[0] if args else od_moe.DEFAULT_MODEL
    tokens = int(args[1]) if len(args) > 1 else 32
    stock, tokenizer = mlx_lm.load(str(path))
    stock = host_time._TimedModel(stock)
    # stock's dtype: its tokens
    engine = od_moe.load(str(path), capacity=0.25, two_tier="lru", dtype="model", path_settings=DEVICE_PATH)
    engine.forward = host_time._TimedModel(engine.forward)
    for _ in range(2):
        list(engine.stream_generate(WARM_PROMPT, max_tokens=tokens))
    runs = {"stock": [], "row": []}
    same = 0
    for _ in range(ROUNDS):
        for prompt in PROMPTS:
            theirs, ours = [], []
            stream = mlx_lm.stream_generate(stock, tokenizer, prompt, max_tokens=tokens)
            runs["stock"].append(host_time.per_token(host_time.collected(stream, theirs)))
            stream = engine.stream_generate(prompt, max_tokens=tokens)
            runs["row"].append(host_time.per_token(host_time.collected(stream, ours)))
            same += ours == theirs
    layers = len(engine.runtime.caches)
    runs_made = ROUNDS * len(PROMPTS)
    print(f"{path}: {layers} MoE layers, {tokens} tokens, {ROUNDS} rounds; same tokens: {same}/{runs_made}")
    print("run | wall ms/token | forward ms/token | forward us/layer over stock")
    base = statistics.median(r[1] for r in runs["stock"])
    for run, rows in runs.items():
        wall, forward = (statistics.median(r[i] for r in rows) for i in range(2))
        print(f"{run} | {wall:.3f} | {forward:.3f} | {(forward - base) / layers * 1e3:+.1f}")
    if "--profile" in sys.argv:
        profile = cProfile.Profile()
        profile.enable()
        for prompt in PROMPTS:
            list(engine.stream_generate(prompt, max_tokens=tokens))
        profile.disable()
        pstats.Stats(profile).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
