"""The floor of a sync per MoE layer: stock mlx-lm as it is, and the same model with nothing added but a
host sync per MoE layer (its routing evaluated and read, as an exact engine must before a partly resident
layer computes), in one process, alternating prompt by prompt. The ratio bounds what any exact per-layer
demand-loading engine can reach on the machine where nearly every layer misses.

    python benchmarks/sync_floor.py [--model PATH] [--rounds 3] [--tokens 32]
"""

import argparse

import mlx.core as mx
import mlx.nn as nn
from mlx_lm import load as mlx_lm_load

import od_moe
from od_moe import backend
from od_moe.bench.foundation import PROMPTS, stock_decode
from od_moe.report import table
from od_moe.surgery import find_moe_blocks


class SyncedSwitch(nn.Module):
    """The stock switch, after a host sync on its routing when `syncing[0]` is set."""

    def __init__(self, inner: nn.Module, syncing: list):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "syncing", syncing)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self.syncing[0]:
            indices.tolist()  # evaluates the routing and reads it on the host
        return self.inner(x, indices)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default=str(od_moe.DEFAULT_MODEL), help="an MLX model folder (default: embedded)"
    )
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    model, tokenizer = mlx_lm_load(args.model)
    dtype = backend.compute_dtype("auto")
    if dtype is not None:
        model.set_dtype(dtype)
    syncing = [False]
    blocks = find_moe_blocks(model)
    for block in blocks:
        block.replace_switch(SyncedSwitch(block.switch, syncing))
    stock_decode(model, tokenizer, PROMPTS[0], 8)  # warm-up: kernels
    tps = {False: [], True: []}
    same = True
    for _ in range(args.rounds):
        for prompt in PROMPTS:
            runs = {}
            for sync in (False, True):
                syncing[0] = sync
                runs[sync] = stock_decode(model, tokenizer, prompt, args.tokens)
                tps[sync].append(runs[sync][0])
            same &= runs[False][1] == runs[True][1]
    stock, synced = (sum(tps[s]) / len(tps[s]) for s in (False, True))
    title = f"{args.model}, {len(PROMPTS)} prompts x {args.tokens} tokens x {args.rounds} rounds"
    title += f", {mx.default_device()}"
    columns = ["MoE layers", "tok/s stock", "tok/s, a sync per MoE layer", "ratio", "same tokens"]
    print(table(columns, [[len(blocks), stock, synced, synced / stock, same]], title=title))


if __name__ == "__main__":
    main()
