"""Replaying routing under eviction rules: Belady's MIN against hand-worked cases, the other rules and the
engine's own reads."""

import numpy as np
import pytest

import od_moe
from od_moe import PrefetchSettings
from od_moe.caching.replay import first_uses, replay_layer, replay_recording


def _steps(seq):
    return [np.array([e]) for e in seq]


def test_min_on_a_worked_sequence():
    # capacity 2, accesses 1 2 3 1 2: at 3, expert 1 is needed next (pass 3), 2 later (pass 4): MIN evicts 2
    steps = _steps([1, 2, 3, 1, 2])
    assert replay_layer(steps, 2, "min").reads == 4
    assert replay_layer(steps, 2, "lru").reads == 5
    # knowing one pass ahead is enough here; knowing none is LRU
    assert replay_layer(steps, 2, "min", horizon=1).reads == 4
    assert replay_layer(steps, 2, "min", horizon=0).reads == 5


def test_an_observer_sees_each_passs_misses_and_what_was_held_before_it():
    # capacity 2, LRU, accesses 1 2 3 1: 3 evicts 1, so 1 misses again with {2, 3} held
    seen = []
    tally = replay_layer(_steps([1, 2, 3, 1]), 2, "lru", observe=lambda t, m, held: seen.append((t, m, held)))
    assert seen == [(0, [1], set()), (1, [2], {1}), (2, [3], {1, 2}), (3, [1], {2, 3})]
    assert tally.reads == sum(len(m) for _, m, _ in seen)


def test_min_never_reads_more_than_the_others():
    rng = np.random.default_rng(0)
    popularity = rng.dirichlet(np.full(32, 0.3))
    steps = [rng.choice(32, size=4, replace=False, p=popularity) for _ in range(400)]
    counted = [t >= 50 for t in range(len(steps))]
    for capacity in (6, 8, 16):
        best = replay_layer(steps, capacity, "min", counted=counted)
        assert replay_layer(steps, capacity, "min", horizon=len(steps), counted=counted).reads == best.reads
        for rule in ("lru", "lfu"):
            other = replay_layer(steps, capacity, rule, counted=counted)
            assert best.reads <= other.reads and best.lookups == other.lookups == 4 * 350
        knows_more = [
            replay_layer(steps, capacity, "min", horizon=h, counted=counted).reads for h in (1, 4, 64)
        ]
        assert best.reads <= knows_more[-1] and knows_more[0] >= best.reads
        assert best.hit_rate == pytest.approx(
            1 - best.reads / best.lookups
        )  # decode-like: one token per pass


def test_next_use_evicts_as_min_when_its_distances_are_true():
    rng = np.random.default_rng(1)
    steps = [rng.choice(16, size=2, replace=False) for _ in range(200)]
    table = first_uses(steps, 16)
    true = table[1:] - np.arange(len(steps))[:, None]  # passes after each pass until each expert's use
    for capacity in (4, 8):
        best = replay_layer(steps, capacity, "min")
        assert replay_layer(steps, capacity, "next-use", distances=true).reads == best.reads
        noisy = true + rng.exponential(4.0, true.shape)
        assert best.reads <= replay_layer(steps, capacity, "next-use", distances=noisy).reads
    with pytest.raises(ValueError, match="distances"):
        replay_layer(steps, 4, "next-use")


def test_min_bounds_the_engine_on_its_own_recording():
    engine = od_moe.load(capacity="25%", prefetch="none")
    recording = engine.record_routing("def fibonacci(n):", 24)
    stats = engine.stats()
    read = stats["io"]["decode"]["experts_loaded"]
    capacity = engine.caches[0].capacity
    best = replay_recording(recording, capacity, "min")
    lru = replay_recording(recording, capacity, "lru")
    assert best.passes == stats["positions"]["decode"] == lru.passes
    assert best.lookups == stats["total"]["decode"]["lookups"]
    assert 0 < best.reads <= read and best.reads < lru.reads


def test_the_oracle_evicts_as_min_does_and_reads_what_min_reads():
    """Knowing the future, the engine's eviction and prefetch installs read about what Belady's MIN reads
    (prefetch reads counted), with exact tokens."""
    prompt = "def fibonacci(n):"
    trace = od_moe.load(capacity="25%", prefetch="none").record_routing(prompt, 24)
    engine = od_moe.load(capacity="25%", prefetch="none")
    engine.configure_prefetch(
        "oracle", oracle_trace=trace, settings=PrefetchSettings(timed_checks=False, synchronous=True)
    )
    engine.runtime.start_recording()
    tokens = [r.token for r in engine.stream_generate(prompt, max_tokens=24)]
    best = replay_recording(engine.runtime.stop_recording(), engine.caches[0].capacity, "min")
    stats = engine.stats()
    read = stats["io"]["decode"]["bytes_read"] / engine.caches[0].layout.expert_nbytes
    lru = replay_recording(trace, engine.caches[0].capacity, "lru")
    assert tokens == [r.token for r in od_moe.load(capacity=1.0).stream_generate(prompt, max_tokens=24)]
    assert best.reads <= read <= 1.1 * best.reads < lru.reads
    assert stats["total"]["decode"]["hit_rate"] >= 0.99
