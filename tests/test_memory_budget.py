"""`--memory-budget` holds (issue 16, item 13): peak MLX memory while generating stays within 10% of the
budget, which counts the working memory (KV cache, prefill activations, router copies) besides weights
and slots; a budget below the non-expert weights is refused before anything is loaded."""

import math

import mlx.core as mx
import pytest

import od_moe
from conftest import PROMPTS
from od_moe.cli import main
from od_moe.memory import backend
from od_moe.memory.capacity import budget_for, working_nbytes
from od_moe.preflight import inspect_model

LONG = "".join(f"def f{i}(x):\n    return x + {i}\n\n" for i in range(9))  # ~170 tokens, one prefill chunk


@pytest.mark.parametrize("fraction, prefetch", [(0.125, "next-gate"), (0.5, "none")])
def test_peak_memory_stays_within_the_budget(fraction, prefetch):
    probe = od_moe.load(capacity=1)
    layers, experts = len(probe.caches), probe.num_experts
    working = working_nbytes(probe.model, layers, experts, kv_per_token=probe.kv_nbytes_per_token)
    slots = round(fraction * experts)
    budget = budget_for(slots, layers, probe.caches[0].slot_nbytes, probe.non_expert_nbytes, working)
    del probe
    engine = od_moe.load(memory_budget=budget, prefetch=prefetch)
    assert engine.capacity == slots
    mx.synchronize()
    held = backend.active_memory_bytes()  # this engine's weights and slots, and other tests' arrays
    backend.reset_peak_memory()
    for prompt in (PROMPTS[0], LONG):
        engine.generate(prompt, max_tokens=32)
    resident = sum(c.slot_nbytes * c.capacity for c in engine.caches) + engine.non_expert_nbytes
    peak = backend.peak_memory_bytes() - held + resident
    assert peak <= 1.1 * budget, peak / budget


def test_a_budget_below_the_non_expert_weights_is_refused_up_front(capsys):
    assert main(["generate", "--prompt", "x", "--memory-budget", "1MB"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("od-moe: error: memory budget 1.00 MB is too small") and "\n" not in err
    assert "working memory" in err


def test_a_two_tier_budget_keeps_room_for_a_staged_pass_copy_of_one_layers_experts():
    """In two-tier mode a prefill pass copies the experts its layer routes to into device memory
    (`two_tier/staged_passes.py`): up to all of one layer's, beyond the slots. A memory budget that buys 32
    slots a layer on the per-layer path buys as many fewer in two-tier mode as that copy takes (64 experts
    over 8 layers: 8 slots a layer)."""
    report = inspect_model(od_moe.DEFAULT_MODEL)
    layers, slot, experts = report["moe_layers"], report["expert_bytes"], report["experts_per_layer"]
    budget = budget_for(32, layers, slot, report["non_expert_bytes"], report["working_bytes"])
    assert od_moe.load(memory_budget=budget, two_tier=False).capacity == 32
    tiered = od_moe.load(memory_budget=budget, two_tier=True)
    assert tiered.capacity == 32 - math.ceil(experts * slot / (slot * layers)) == 24
