"""Optimistic decode passes (`od_moe/per_layer/optimistic.py`): one sync per token where nothing misses, a
second run from the first layer that missed where something does; tokens and counts as in exact mode."""

import numpy as np

import od_moe
from conftest import NEW_TOKENS, PROMPTS, invariants, od_moe_tokens, slots_hold_their_experts
from od_moe.per_layer import PerLayerSettings
from od_moe.per_layer import optimistic as optimistic_module
from od_moe.prefetch.governor import PrefetchSettings

TOKENS = NEW_TOKENS // 2  # the first half of the reference's greedy tokens


def _run(capacity, optimistic, prompts=PROMPTS):
    engine = od_moe.load(
        capacity=capacity, prefetch="none", path_settings=PerLayerSettings(optimistic=optimistic)
    )
    tokens = od_moe_tokens(engine, prompts, TOKENS)
    return engine, tokens, engine.stats()


def _counts(stats):
    decode, io = stats["total"]["decode"], stats["io"]["decode"]
    layers = [(row["lookups"], row["hits"]) for row in stats["layers"]]
    return decode["lookups"], decode["hits"], io["experts_loaded"], io["bytes_read"], layers


def test_optimistic_passes_give_exact_tokens_the_same_counts_and_fewer_syncs(bundled_reference):
    _, exact_tokens, exact = _run(0.875, optimistic=False)
    engine, tokens, stats = _run(0.875, optimistic=True)
    assert tokens == exact_tokens == [r[:TOKENS] for r in bundled_reference]
    assert _counts(stats) == _counts(exact)
    passes, missed = stats["optimistic"]["passes"], stats["optimistic"]["missed"]
    assert passes > 0 and 0 < missed < passes  # both ways through: passes that stood and passes run again
    assert exact["optimistic"]["passes"] == 0
    assert stats["optimistic"]["host_syncs"] < exact["optimistic"]["host_syncs"]
    slots_hold_their_experts(engine)


def test_tokens_that_keep_missing_turn_optimistic_passes_off():
    """At 25% nearly every token misses somewhere: after the first decode token, no pass runs
    optimistically (a second run would cost more than the syncs it saves)."""
    engine, _, stats = _run(0.25, optimistic=True, prompts=PROMPTS[:1])
    assert stats["optimistic"]["passes"] <= 1
    assert stats["optimistic"]["token_miss_rate"] >= optimistic_module.OPTIMISTIC_BELOW


def test_a_continued_prompt_cache_stays_exact(bundled_reference):
    """Optimistic passes take back the KV entries of a pass that missed (trimming every layer's cache):
    a conversation continued on the same prompt cache gives stock mlx-lm's tokens."""
    from mlx_lm import load as mlx_lm_load
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache

    from od_moe.memory import backend

    model, tokenizer = mlx_lm_load(str(od_moe.DEFAULT_MODEL))
    model.set_dtype(backend.compute_dtype("auto"))
    at_once = PerLayerSettings(optimistic=True, assumed_token_miss_rate=0.0)  # optimistic from the start
    engine = od_moe.load(capacity=0.875, prefetch="none", path_settings=at_once)
    theirs, ours = make_prompt_cache(model), make_prompt_cache(engine.model)
    for prompt in PROMPTS[:2]:
        want = [
            r.token for r in stream_generate(model, tokenizer, prompt, max_tokens=24, prompt_cache=theirs)
        ]
        got = [r.token for r in engine.stream_generate(prompt, max_tokens=24, prompt_cache=ours)]
        assert got == want
        assert [c.offset for c in ours] == [c.offset for c in theirs]
    assert engine.stats()["optimistic"]["missed"] > 0


def test_optimistic_passes_record_the_routing_exact_mode_records():
    """A recording (the bench's, for Belady's MIN) no longer keeps passes exact: the flags' sync gives it
    each optimistic pass's routing, and a pass that ran again its later layers', as exact mode records."""
    recordings = []
    for optimistic in (False, True):
        settings = PerLayerSettings(optimistic=optimistic, assumed_token_miss_rate=0.0)
        engine = od_moe.load(capacity=0.875, prefetch="none", path_settings=settings)
        engine.runtime.start_recording()
        od_moe_tokens(engine, PROMPTS[:2], TOKENS)
        recordings.append(engine.runtime.stop_recording())
        passes = engine.stats()["optimistic"]
    assert passes["passes"] > passes["missed"] > 0
    exact, optimistic = recordings
    assert len(exact) == len(optimistic)
    for a, b in zip(exact, optimistic):
        assert sorted(a) == sorted(b)
        assert all(np.array_equal(a[layer], b[layer]) for layer in a)


def test_no_pass_runs_optimistically_while_prefetch_runs(bundled_reference):
    """Optimistic passes run only without prefetch (prefetching from them was measured slower than a sync
    per layer and removed): with the oracle prefetching and `optimistic` on, every pass syncs per layer,
    and the tokens are stock mlx-lm's."""
    prompt, expected = PROMPTS[0], bundled_reference[0]
    trace = od_moe.load(capacity="25%", prefetch="none").record_routing(prompt, TOKENS)
    engine = od_moe.load(capacity="25%", prefetch="none", path_settings=PerLayerSettings(optimistic=True))
    engine.configure_prefetch("oracle", oracle_trace=trace, settings=PrefetchSettings(timed_checks=False))
    assert od_moe_tokens(engine, [prompt], TOKENS)[0] == expected[:TOKENS]
    stats = engine.stats()
    invariants(stats)
    assert stats["optimistic"]["passes"] == 0 and stats["prefetch"]["installed"] > 0
