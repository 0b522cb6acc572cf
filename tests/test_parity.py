"""Exact mode generates stock mlx-lm's tokens on the bundled trained model, at every capacity."""

import pytest

import od_moe
from conftest import NEW_TOKENS, PROMPTS, od_moe_tokens, reference_tokens
from od_moe.per_layer import PerLayerSettings


@pytest.mark.parametrize("fraction", [1.0, 0.5, 0.25, 0.125])
def test_load_mode_matches_mlx_lm(bundled_reference, fraction):
    engine = od_moe.load(capacity=fraction)
    assert engine.capacity == round(64 * fraction)
    assert od_moe_tokens(engine, PROMPTS, NEW_TOKENS) == bundled_reference
    stats = engine.stats()
    total = stats["total"]
    tokens = stats["positions"]["prefill"] + stats["positions"]["decode"]
    assert (
        total["lookups"] == tokens * stats["moe_layers"] * stats["top_k"] == total["hits"] + total["misses"]
    )
    assert tokens >= sum(len(t) for t in bundled_reference)
    assert sum(l["lookups"] for l in stats["layers"]) == total["lookups"]
    assert all(l["resident"] <= l["capacity"] == engine.capacity for l in stats["layers"])
    if fraction < 1:
        assert (
            total["misses"] > 0 and total["bytes_read"] > 0 and total["experts_loaded"] >= total["evictions"]
        )
        assert total["bytes_read"] == total["experts_read"] * engine.caches[0].layout.expert_nbytes
        assert total["experts_loaded"] <= total["experts_read"]
    else:
        assert total["misses"] == 0 and total["bytes_read"] == 0  # preloaded at start, not counted here


def test_capacity_below_top_k_computes_in_rounds(bundled_reference):
    engine = od_moe.load(capacity=3)  # fewer slots than the 8 experts each token needs
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]


def test_checkpoint_dtype_matches_unmodified_mlx_lm():
    """dtype="model" keeps bfloat16 scales: compare with mlx-lm loaded exactly as it comes."""
    reference = reference_tokens(od_moe.DEFAULT_MODEL, PROMPTS[:1], 24, dtype="model")
    engine = od_moe.load(capacity=0.25, dtype="model")
    assert od_moe_tokens(engine, PROMPTS[:1], 24) == reference


def test_skip_mode_runs_and_counts_misses(bundled_reference):
    """Skip mode is approximate, and deterministic: the figures a correct engine gives on this CPU backend
    (mlx 0.32) are pinned, so a change in what it drops or loads shows."""
    engine = od_moe.load(capacity=0.25, miss_policy="skip")
    out = od_moe_tokens(engine, PROMPTS, NEW_TOKENS)
    stats = engine.stats()["total"]
    assert (stats["lookups"], stats["hits"], stats["experts_loaded"]) == (14080, 8078, 5182)
    assert [len(t) for t in out] == [len(t) for t in bundled_reference]
    same = sum(a == b for x, y in zip(out, bundled_reference) for a, b in zip(x, y))
    assert same == 10  # of 192 tokens: dropping experts changes the text early on


def test_skip_mode_with_every_expert_resident_is_exact(bundled_reference):
    engine = od_moe.load(capacity=1.0, miss_policy="skip")
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]


def test_generate_and_module_one_liner(bundled_reference):
    engine = od_moe.load(capacity=16)
    text = engine.generate(PROMPTS[0], max_tokens=NEW_TOKENS)
    assert text == engine.tokenizer.decode(bundled_reference[0])
    assert od_moe.generate(PROMPTS[0], max_tokens=NEW_TOKENS, capacity=16) == text
    responses = list(od_moe.stream_generate(PROMPTS[0], max_tokens=8, capacity=16))
    assert responses[-1].finish_reason == "length" and responses[-1].generation_tokens == 8


def test_a_synced_layer_starts_computing_at_once(bundled_reference, monkeypatch):
    """After the host waited for a layer's routing, the switch starts that layer's computation at once
    (`mx.async_eval`) so the device works while the next layer is built; the tokens stay exact."""
    import mlx.core as mx

    from od_moe.per_layer import offloaded_switch as switch

    launched = []

    class CountingMx:
        def __getattr__(self, name):
            return getattr(mx, name)

        def async_eval(self, *arrays):
            launched.append(len(arrays))
            return mx.async_eval(*arrays)

    monkeypatch.setattr(switch, "mx", CountingMx())
    one_round = PerLayerSettings(
        split_on_miss=False
    )  # split rounds start at once whatever `launch_early` says
    engine = od_moe.load(capacity=0.25, prefetch="none", path_settings=one_round)
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]
    stats = engine.stats()
    assert 0 < len(launched) <= engine.runtime.host_syncs  # one per layer that synced, in one round
    assert len(launched) >= stats["positions"]["decode"] * stats["moe_layers"] // 2
    settings = PerLayerSettings(split_on_miss=False, launch_early=False)
    engine = od_moe.load(capacity=0.25, prefetch="none", path_settings=settings)
    count = len(launched)
    assert od_moe_tokens(engine, PROMPTS[1:2], 8) == [bundled_reference[1][:8]]
    assert len(launched) == count


@pytest.mark.parametrize("prefetch", ["none", "predictor"])
def test_a_missing_layer_computes_its_resident_experts_while_the_rest_are_read(
    prefetch, bundled_reference, monkeypatch
):
    """On the CPU backend a decode layer with large experts that misses comes back in two rounds: the
    resident experts, started before the missing ones are read (their installs do not wait for the
    device), then the missing ones; every routed expert is computed once and the tokens are stock
    mlx-lm's."""
    from od_moe.caching.layer_cache import LayerCache

    events, real_install = [], LayerCache.install

    def install(self, *args, synchronize=True, **kwargs):
        events.append(("install", self.layer, synchronize))
        return real_install(self, *args, synchronize=synchronize, **kwargs)

    monkeypatch.setattr(LayerCache, "install", install)
    from od_moe.per_layer import per_layer_runtime as runtime_module

    predictor = od_moe.DEFAULT_PREDICTOR if prefetch == "predictor" else None
    assert not od_moe.load(capacity=0.25).runtime.settings.split_on_miss  # 20 KB experts: nothing to hide
    monkeypatch.setattr(runtime_module, "SMALL_EXPERT_BYTES", 1)  # as if they were large

    def watched(engine):  # its rounds of positions go to `events`
        real_route = engine.runtime.route

        def route(layer, x, indices):
            for r in real_route(layer, x, indices):
                if r.lanes is not None:
                    events.append(("lanes", layer, tuple(r.lanes.tolist()), r.slots.shape[-1]))
                yield r

        monkeypatch.setattr(engine.runtime, "route", route)
        return engine

    engine = watched(od_moe.load(capacity=0.25, prefetch=prefetch, predictor=predictor))
    assert engine.runtime.settings.split_on_miss  # on the CPU backend
    assert od_moe_tokens(engine, PROMPTS[:2], NEW_TOKENS) == bundled_reference[:2]
    rounds = [e for e in events if e[0] == "lanes"]
    assert rounds and all(e[3] == len(e[2]) for e in rounds)  # each round computes its positions only
    for first, second in zip(rounds[::2], rounds[1::2]):  # together, every routed position once
        assert first[1] == second[1] and sorted(first[2] + second[2]) == list(range(engine.top_k))
    between, inside = [], False  # the misses' installs, made while the first round computes
    for e in events:
        if e[0] == "lanes":
            inside = not inside
        elif inside:
            between.append(e)
    assert between and not any(e[2] for e in between)
    one_round = PerLayerSettings(split_on_miss=False)
    engine = watched(
        od_moe.load(capacity=0.25, prefetch=prefetch, predictor=predictor, path_settings=one_round)
    )
    events.clear()
    assert od_moe_tokens(engine, PROMPTS[2:], NEW_TOKENS) == bundled_reference[2:]
    assert not [e for e in events if e[0] == "lanes"]
