"""Both runtimes hold to the one interface the rest of the package uses (`od_moe.runtime.Runtime`): each class
declares it, and every member does what its docstring says on both, the per-layer path and two tiers (forced
on the CPU, where host memory stands in for the device's), on the bundled model. Members are exercised
through their behaviour, not their signatures: the same slots give the same bytes and the same logits on
both paths."""

import mlx.core as mx
import numpy as np
import pytest

import od_moe
from conftest import NEW_TOKENS, PROMPTS, od_moe_tokens
from od_moe.caching.layer_cache import LayerCache
from od_moe.errors import UserError
from od_moe.prefetch.governor import PrefetchSettings
from od_moe.prefetch.policies import OnDemand, make_policy
from od_moe.runtime import PathFigures, Runtime, TwoTierMode
from od_moe.storage.store import ExpertStore

PATHS = {"per-layer": False, "two-tier": True}
MEMBERS = [n for n in vars(Runtime) if not n.startswith("_")] + list(Runtime.__annotations__)


@pytest.fixture(scope="module", params=list(PATHS))
def engine(request):
    engine = od_moe.load(capacity=0.25, two_tier=PATHS[request.param])
    assert engine.mode.path == request.param
    return engine


@pytest.fixture(scope="module")
def both():
    return {path: od_moe.load(capacity=0.25, two_tier=tiered) for path, tiered in PATHS.items()}


def test_each_runtime_declares_the_interface(engine):
    runtime = engine.runtime
    assert Runtime in type(runtime).__mro__ and isinstance(runtime, Runtime)
    missing = sorted(set(MEMBERS) - set(dir(runtime)))
    assert missing == []


def test_the_data_members(engine):
    runtime = engine.runtime
    assert isinstance(runtime.store, ExpertStore)
    assert len(runtime.caches) == 8 and all(isinstance(c, LayerCache) for c in runtime.caches)
    assert {c.capacity for c in runtime.caches} == {16}
    assert runtime.miss_policy == "load"
    tiered = engine.mode.path == "two-tier"
    assert runtime.mode is (TwoTierMode.ON if tiered else TwoTierMode.OFF)
    assert isinstance(runtime.mode_reason, str) and runtime.mode_reason
    runtime.reset_counts()
    assert runtime.host_syncs == 0 and runtime.ledger.snapshot().forwards == 0
    engine.generate("def add(a, b):", max_tokens=4)
    runtime.settle()
    ledger = runtime.ledger.snapshot()
    assert ledger.forwards > 0 and ledger.positions["decode"] > 0
    # the per-layer path waits for routing at layers that may miss; two tiers never wait inside a pass
    assert runtime.host_syncs > 0 if not tiered else runtime.host_syncs >= 0
    runtime.reset_counts()
    assert runtime.host_syncs == 0 and runtime.ledger.snapshot().forwards == 0


def test_the_generation_model_gives_the_models_logits(both):
    """What generation calls computes what the model does (the per-layer path wraps it for optimistic
    passes; two tiers give the model itself), and both paths give the same logits."""
    tokens = mx.array([[1, 17, 300, 42, 9]])
    logits = {}
    for path, engine in both.items():
        forward = engine.runtime.generation_model(engine.model)
        logits[path] = forward(tokens)
        assert mx.array_equal(logits[path], engine.model(tokens))
    assert mx.allclose(logits["per-layer"], logits["two-tier"], atol=1e-4)


def test_read_ahead_is_where_a_path_reads_ahead(engine):
    ahead = engine.runtime.read_ahead()
    if engine.mode.path == "two-tier":
        assert ahead is None  # every expert is in host memory: nothing to read ahead
    else:
        clock = ahead.passes.clock
        engine.generate("x = 1", max_tokens=2)
        assert ahead.passes.clock > clock and ahead.loader.reader is not None


def test_figures_have_the_same_keys_on_both(both):
    figures = {path: engine.runtime.figures() for path, engine in both.items()}
    assert all(isinstance(f, PathFigures) for f in figures.values())
    per_layer, tiered = figures["per-layer"], figures["two-tier"]
    assert set(per_layer.prefetch) == set(tiered.prefetch) and set(per_layer.optimistic) == set(
        tiered.optimistic
    )
    assert tiered.optimistic["passes"] == 0 and tiered.prefetch["pending"] == 0
    assert not tiered.kept_by_device and tiered.stack_moves == 0
    stats = both["per-layer"].stats()
    assert stats["optimistic"]["enabled"] == per_layer.optimistic["enabled"]


class Hooked(OnDemand):
    """A policy that predicts nothing and keeps the prompts its prompt hook was given."""

    def __init__(self):
        self.prompts = []

    def prompt_start(self, prompt):
        self.prompts.append(list(prompt))


def test_set_policy_runs_its_hooks_and_prefetch_only_where_the_path_predicts(engine):
    runtime, hooked = engine.runtime, Hooked()
    runtime.set_policy(hooked)
    runtime.start_prompt([1, 2, 3])
    engine.generate("x = 1", max_tokens=2)
    assert hooked.prompts[0] == [1, 2, 3] and len(hooked.prompts) == 2
    next_gate = make_policy("next-gate", engine)
    if engine.mode.path == "two-tier":
        with pytest.raises(UserError, match="two-tier"):
            runtime.set_policy(next_gate, PrefetchSettings())
    else:
        runtime.set_policy(next_gate, PrefetchSettings(synchronous=True))
        engine.generate("def add(a, b):", max_tokens=4)
        assert runtime.figures().prefetch["mode"] != "off"
    runtime.set_policy(make_policy("none", engine))


def test_recording_gives_every_pass_routing(engine):
    runtime = engine.runtime
    runtime.start_recording()
    engine.generate("import os", max_tokens=3)
    recording = runtime.stop_recording()
    assert len(recording) >= 3 and all(set(p) == set(range(8)) for p in recording)
    assert recording[0][0].ndim == 2 and recording[0][0].shape[-1] == engine.top_k
    assert all(p[0].shape[0] == 1 for p in recording[1:])  # decode passes: one position
    assert runtime.stop_recording() is None


def test_load_place_and_slot_arrays_hold_the_same_bytes_on_both(both):
    """Experts loaded or placed sit in the slots named, and the slots hold the same bytes on both paths."""
    held = {}
    for path, engine in both.items():
        runtime, cache = engine.runtime, engine.caches[3]
        runtime.place(cache, np.full(cache.capacity, -1))
        runtime.load(cache, [5, 9, 40])
        assert {5, 9, 40} <= set(cache.expert_in_slot.tolist())
        order = np.arange(cache.capacity)[::-1] + 30
        runtime.place(cache, order)
        assert np.array_equal(cache.expert_in_slot, order)
        arrays = runtime.slot_arrays(cache)
        assert arrays and all(a.shape[0] == cache.capacity for a in arrays.values())
        held[path] = arrays
    per_layer, tiered = held["per-layer"], held["two-tier"]
    assert set(per_layer) == set(tiered)
    assert all(mx.array_equal(per_layer[k], tiered[k]) for k in per_layer)


def test_transfer_rates_leave_the_slots_as_they_were(engine):
    before = [c.expert_in_slot.copy() for c in engine.caches]
    rates = engine.runtime.transfer_rates(repeats=2)
    assert rates["best"] == max(v for k, v in rates.items() if k != "best") > 0
    assert all(np.array_equal(a, c.expert_in_slot) for a, c in zip(before, engine.caches))


def test_prepare_batches_then_batches_and_close_keep_generating(engine, bundled_reference):
    engine.runtime.prepare_batches(2 * engine.top_k)
    texts = engine.batch_generate(["def f(x):", "import sys"], max_tokens=3).texts
    assert len(texts) == 2
    engine.runtime.close()
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]
