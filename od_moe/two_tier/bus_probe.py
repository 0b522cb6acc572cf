"""How fast two tiers bring an expert to where a layer computes it (`TwoTierRuntime.transfer_rates`), the two
ways bytes cross the bus: read in place by the layer's own products (a miss), and copied to the device by a
staged pass (`staged_passes.py`).

Each is measured on one layer's stack, every expert at once: one token routed to every expert (every lane
a host row) through mlx-lm's switch, and a staged pass's copy of every expert's host row, the best of a few
runs after a warm-up. Nothing is written into the stack: the slots hold what they held. On the CPU and
Metal the stack is plain memory and the rates are that memory's. Not here: what the rates bound (the bench's
roofline, `bench/roofline.py`), the copies and products themselves (`staged_passes.py`, mlx-lm).
"""

import time

import mlx.core as mx

from . import slot_fill, staged_passes
from .layer_step import LayerSteps


def best_seconds(run, repeats: int) -> float:
    """The fastest of `repeats` evaluations of `run()`, after one to warm up."""
    mx.eval(run())
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        mx.eval(run())
        best = min(best, time.perf_counter() - t0)
    return best


def hidden_input(stack: dict) -> mx.array:
    """One position's hidden state for the layer whose stack this is: as wide as its last projection's
    output (`down_proj`, or `fc2` for a `SwitchMLP`), in its scales' dtype where it is quantized."""
    last = "down_proj" if ("down_proj", "weight") in stack else "fc2"
    dtype = stack.get((last, "scales"), stack[last, "weight"]).dtype
    return mx.zeros((1, 1, stack[last, "weight"].shape[1]), dtype)


def read_in_place(
    steps: LayerSteps, stack: dict, num_experts: int, expert_nbytes: int, repeats: int
) -> float:
    """Bytes a second at which the layer's products read experts in place: one token routed to every
    expert of its stack, each read from its host row."""
    x, indices = hidden_input(stack), mx.arange(num_experts, dtype=mx.uint32)[None, None]
    arrays = tuple(stack.values())
    return num_experts * expert_nbytes / best_seconds(lambda: steps.compute(arrays, x, indices), repeats)


def copied(stack: dict, num_experts: int, expert_nbytes: int, repeats: int) -> float:
    """Bytes a second at which a staged pass's copy (a kernel of 16-byte loads on CUDA) brings every expert's
    host row to the device."""
    rows, count = mx.arange(num_experts, dtype=mx.int32), mx.array(num_experts)
    arrays, by_kernel = list(stack.values()), slot_fill.available()
    seconds = best_seconds(lambda: staged_passes.take_rows(arrays, rows, count, by_kernel), repeats)
    return num_experts * expert_nbytes / seconds


def transfer_rates(
    steps: LayerSteps, stack: dict, num_experts: int, expert_nbytes: int, repeats: int
) -> dict:
    """{"in_place", "copied": the two ways' bytes a second, "best": the faster}."""
    found = {
        "in_place": read_in_place(steps, stack, num_experts, expert_nbytes, repeats),
        "copied": copied(stack, num_experts, expert_nbytes, repeats),
    }
    return {**found, "best": max(found.values())}
