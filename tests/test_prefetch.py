"""Prefetch: exact tokens under every policy, pinned experts stay, stale requests are dropped, read
failures surface clearly and leave the caches consistent, and the prefetch statistics add up."""

import contextlib
import shutil
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

import od_moe
from conftest import NEW_TOKENS, PROMPTS, od_moe_tokens
from conftest import consistent as _consistent
from conftest import invariants as _invariants
from od_moe.errors import UserError
from od_moe.predictor import PredictorConfig, ShadowPredictor
from od_moe.prefetch.governor import PrefetchSettings
from od_moe.prefetch.policies import Prediction, Step


@pytest.fixture(scope="module")
def predictor_dir(tmp_path_factory):
    """An untrained predictor for the bundled model (it starts as next-gate speculation): enough for
    exactness, which must not depend on how good the predictions are."""
    identity = od_moe.load(capacity=8).identity
    folder = tmp_path_factory.mktemp("predictor")
    predictor = ShadowPredictor(PredictorConfig(identity, 8, 64, 192, 8, lookahead=4, rank=16, next_use=True))
    head = predictor.next_use  # random, so that its distances differ from expert to expert
    head.proj = mx.random.normal(head.proj.shape, key=mx.random.key(0)) * 0.1
    head.bias = mx.random.normal(head.bias.shape, key=mx.random.key(1))
    predictor.save(folder)
    return folder


def _engine(policy, predictor_dir, capacity="25%", prompt=None, self_checks=False, **settings):
    """An engine with prefetch `policy`; without `self_checks` prefetch never pauses itself (on this tiny
    model it would, after two tokens), so every token exercises it."""
    engine = od_moe.load(capacity=capacity, predictor=predictor_dir, prefetch="none")
    trace = None
    if policy == "oracle":
        trace = engine.record_routing(prompt, NEW_TOKENS)
        engine = od_moe.load(capacity=capacity, predictor=predictor_dir, prefetch="none")
    engine.configure_prefetch(
        policy, oracle_trace=trace, settings=PrefetchSettings(timed_checks=self_checks, **settings)
    )
    return engine


@pytest.mark.parametrize("policy", ["none", "profile", "next-gate", "predictor", "oracle"])
def test_exact_tokens_under_every_policy(policy, predictor_dir, bundled_reference):
    for prompt, expected in zip(PROMPTS, bundled_reference):
        engine = _engine(policy, predictor_dir, "25%", prompt)
        assert od_moe_tokens(engine, [prompt], NEW_TOKENS)[0] == expected
        stats = engine.stats()
        _invariants(stats)
        for cache in engine.caches:
            _consistent(cache)
        if policy in ("next-gate", "predictor", "oracle"):
            assert stats["prefetch"]["issued"] > 0 and stats["prefetch"]["useful"] > 0
    if policy == "oracle":  # the true future routing, prefetched, is the upper bound: nearly all hits;
        # a read may still go unused when an expert needed sooner evicts it first (as MIN would). Measured
        # with every read landing before the next layer (`synchronous`): a read still in flight when its
        # layer runs (how late depends on the machine's load) is a demand read, and its prefetch is wasted
        engine = _engine(policy, predictor_dir, "25%", prompt, synchronous=True)
        assert od_moe_tokens(engine, [prompt], NEW_TOKENS)[0] == expected
        stats = engine.stats()
        assert stats["total"]["decode"]["hit_rate"] > 0.9 and stats["prefetch"]["precision"] > 0.99


def test_prefetch_raises_the_hit_rate_for_the_bytes_it_reads(predictor_dir):
    """Next-gate prefetch raises the decode hit rate over on-demand loading. With the governor's floor on
    how likely a predicted expert must be to be read, it reads about what on-demand reads; without it,
    far more, for a few more hits."""
    figures = {}
    for policy, floor in (("none", 0.4), ("next-gate", 0.4), ("next-gate", 0.0)):
        engine = _engine(policy, predictor_dir, "25%", min_score=floor)
        engine.generate(PROMPTS[0], max_tokens=NEW_TOKENS)
        stats = engine.stats()
        figures[policy, floor] = (stats["total"]["decode"]["hit_rate"], stats["io"]["decode"]["bytes_read"])
    (none_hit, none_read), (hit, read), (eager_hit, eager_read) = figures.values()
    assert hit > none_hit + 0.03 and read < 1.1 * none_read
    assert eager_hit > hit and eager_read > 1.5 * read


def test_the_next_use_head_orders_eviction_and_refuses_reads_that_do_not_pay(predictor_dir):
    """With a next-use head the predictor policy estimates every expert's next use (at least the next
    pass, finite) and reads a predicted expert only if it is needed sooner than what it would evict."""
    engine = _engine("predictor", predictor_dir, "25%", min_score=0.0)
    engine.generate(PROMPTS[0], max_tokens=NEW_TOKENS)
    policy, runtime = engine.runtime.policy, engine.runtime
    for layer, cache in enumerate(engine.caches):
        distance = policy.next_uses(runtime.passes.index, layer)
        assert distance.shape == (cache.num_experts,) and np.all(np.isfinite(distance) & (distance >= 1))
    refused = engine.stats()["io"]["decode"]["bytes_read"]
    # the same predictions, eviction by LRU, every prediction read
    blind = _engine("predictor", predictor_dir, "25%", min_score=0.0, next_use_estimates=False)
    blind.generate(PROMPTS[0], max_tokens=NEW_TOKENS)
    assert refused < blind.stats()["io"]["decode"]["bytes_read"]


def test_the_head_runs_once_per_layer_and_pass_and_its_estimates_stay_current(predictor_dir, monkeypatch):
    """The runtime asks for next-use estimates many times a layer (reads, installs, every prediction for
    the layer): the head itself runs at most once per layer and pass, and the estimates it serves are the
    ones a fresh computation gives."""
    engine = _engine("predictor", predictor_dir, "25%", min_score=0.0)
    policy, runtime = engine.runtime.policy, engine.runtime
    runs, asks = [], []
    distances, next_uses = policy.head.distances, policy.next_uses
    monkeypatch.setattr(policy.head, "distances", lambda *a: runs.append(a[0]) or distances(*a))
    monkeypatch.setattr(policy, "next_uses", lambda *a: asks.append(a) or next_uses(*a))
    engine.generate(PROMPTS[0], max_tokens=NEW_TOKENS)
    passes = engine.stats()["forwards"]
    assert len(asks) > 2 * len(runs) and len(runs) <= passes * len(engine.caches)
    for layer in range(len(engine.caches)):
        served = next_uses(runtime.passes.index, layer)
        policy._base.clear(), policy._estimates.clear()
        assert np.array_equal(served, next_uses(runtime.passes.index, layer))


def test_paused_prefetch_leaves_eviction_and_reads_to_the_demand_path(predictor_dir, monkeypatch):
    """Where the governor paused prefetch (its reads cost too little to pay for predicting), the next-use
    head is idle too: eviction falls back to the cache's own rule and demand reads skip the reader."""
    engine = _engine("predictor", predictor_dir, "25%")
    engine.generate(PROMPTS[0], max_tokens=8)
    policy, runtime = engine.runtime.policy, engine.runtime
    assert any(policy.next_uses(runtime.passes.index, layer) is not None for layer in range(8))
    runtime.governor._set_mode("paused", "gain")
    runtime.reader.drain()
    runtime.loader.install_ready({})
    handed = []
    fetch = runtime.reader.fetch
    monkeypatch.setattr(runtime.reader, "fetch", lambda *a, **k: handed.append(a) or fetch(*a, **k))
    before = engine.stats()["io"]["decode"]["experts_loaded"]
    engine.generate(PROMPTS[1], max_tokens=8)
    assert engine.stats()["io"]["decode"]["experts_loaded"] > before  # it read on demand...
    assert handed == []  # ...on the generation thread
    assert all(policy.next_uses(runtime.passes.index, layer) is None for layer in range(8))


def test_profile_pins_the_prompts_hottest_experts_and_they_are_never_evicted(predictor_dir):
    engine = _engine("profile", predictor_dir, "25%")
    engine.generate(PROMPTS[1], max_tokens=NEW_TOKENS)
    pinned = [np.flatnonzero(c.pinned) for c in engine.caches]
    held = [c.expert_in_slot[p].copy() for c, p in zip(engine.caches, pinned)]
    for cache, slots, counts in zip(engine.caches, pinned, engine.runtime.policy.counts):
        assert len(slots) == 4  # a quarter of 16 slots: the prompt's four most used experts of the layer
        assert set(cache.expert_in_slot[slots]) == set(np.argsort(-counts, kind="stable")[:4])
    engine.configure_prefetch("none")  # keep the pins, stop re-seeding
    engine.reset_stats()
    engine.generate(PROMPTS[2], max_tokens=NEW_TOKENS)
    for row, cache, slots, experts in zip(engine.stats()["layers"], engine.caches, pinned, held):
        assert row["evictions"] > 0  # many evictions later the pinned experts are still in their slots
        assert np.array_equal(cache.expert_in_slot[slots], experts) and cache.pinned[slots].all()
        _consistent(cache)
    small = _engine(
        "profile", predictor_dir, "12.5%"
    )  # 8 slots for 8 experts a token: pins would split layers
    small.generate(PROMPTS[1], max_tokens=NEW_TOKENS)
    assert not any(c.pinned.any() for c in small.caches)


@contextlib.contextmanager
def _stalled_disk(engine):
    """Reads block until the block ends: the reader thread starts at most one read and holds it."""
    gate = threading.Event()
    real_read = engine.runtime.store.read
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(engine.runtime.store, "read", lambda *a: (gate.wait(10), real_read(*a))[1])
        try:
            yield
        finally:
            gate.set()


def _submit(engine, layer, experts, scores):
    """Queue reads as the runtime does with a layer's predictions."""
    engine.runtime.loader.submit(
        [Prediction(layer, np.asarray(experts), np.asarray(scores, dtype=np.float32))]
    )


def test_stale_requests_are_dropped(predictor_dir):
    engine = _engine("next-gate", predictor_dir, "25%")
    reader, ledger = engine.runtime.reader, engine.runtime.ledger
    with _stalled_disk(engine):
        missing = np.flatnonzero(engine.caches[3].slot_of < 0)[:6]
        _submit(engine, 3, missing, np.linspace(1, 0.5, len(missing)))
        _submit(engine, 5, missing[:2], [0.9, 0.8])
        issued = ledger.reader["issued"]
        assert reader.counts()["pending"] + issued == 8
        reader.withdraw(3)  # layer 3 ran: its requests not yet started are useless now
        issued = ledger.reader["issued"]
        assert issued <= 1 and ledger.reader["dropped"] == 6 - issued  # at most one read started (and stalls)
        assert all(layer != 3 for layer, _ in reader._pending) and reader.counts()["pending"] == 2
    engine.generate(PROMPTS[0], max_tokens=8)
    _invariants(engine.stats())


def test_a_layer_about_to_run_withdraws_its_predicted_reads_not_started(predictor_dir):
    """`Reader.fetch(read=False)`: the layer's prefetches not started are withdrawn, not read; the other
    layers' requests stay queued."""
    engine = _engine("next-gate", predictor_dir, "25%")
    reader, ledger = engine.runtime.reader, engine.runtime.ledger
    bound, reader.max_inflight_bytes = reader.max_inflight_bytes, 0  # no prefetch may start by itself
    missing = np.flatnonzero(engine.caches[3].slot_of < 0)[:4]
    _submit(engine, 3, missing, [0.9, 0.8, 0.7, 0.6])
    _submit(engine, 5, missing[:2], [0.9, 0.8])
    assert reader.counts() == {"pending": 6, "reading": 0, "ready": 0} and ledger.reader["issued"] == 0
    assert reader.fetch(3, missing[:2], read=False) == ([], [])
    assert ledger.reader["issued"] == 0 and reader.counts()["pending"] == 4
    reader.max_inflight_bytes = bound
    engine.generate(PROMPTS[0], max_tokens=8)
    _invariants(engine.stats())


def test_a_nearer_prediction_supersedes_a_farther_one(predictor_dir):
    engine = _engine("next-gate", predictor_dir, "25%")
    reader = engine.runtime.reader
    with _stalled_disk(engine):
        missing = np.flatnonzero(engine.caches[4].slot_of < 0)[:6]
        _submit(engine, 4, missing[:4], [0.5, 0.4, 0.3, 0.2])  # from two layers back
        _submit(engine, 4, missing[2:], [0.9, 0.8, 0.7, 0.6])  # from the layer before: it knows better
        with reader._lock:  # the reader holds at most one read (stalled), started before or after the second
            started = {e for layer, e in reader._reading}
            pending = {e for layer, e in reader._pending}
        assert pending == set(missing[2:].tolist()) - started  # the farther guesses not started are withdrawn
        assert reader.wanted(4) == sorted(
            missing[2:].tolist()
        )  # and only the nearer ones are kept at installs
        assert engine.runtime.ledger.reader["dropped"] == len(set(missing[:2].tolist()) - started)
    engine.generate(PROMPTS[0], max_tokens=8)
    _invariants(engine.stats())


def test_the_predictor_reads_more_one_layer_ahead_and_fewer_farther(predictor_dir):
    from od_moe.prefetch.policies import experts_at_distance

    assert [experts_at_distance(8, d) for d in (1, 2, 3, 4)] == [10, 4, 2, 1]
    engine = _engine("predictor", predictor_dir, "25%")
    x = engine.model.model.embed_tokens(mx.array([[5]]))
    step = Step(1, 0, "decode", x, engine.router(0)(x), predict=True, prefetching=True)
    made = engine.runtime.policy.before_layer(step)
    assert [(j, len(np.array(ids))) for j, ids, _ in made] == [(1, 10), (2, 4), (3, 2), (4, 1)]
    assert (
        engine.runtime.policy.before_layer(Step(1, 0, "decode", x, None, predict=False, prefetching=True))
        == []
    )


def test_prefetch_read_failure_is_a_clear_error_and_leaves_caches_consistent(predictor_dir, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(od_moe.DEFAULT_MODEL, model)
    engine = od_moe.load(str(model), capacity="25%", prefetch="next-gate")
    engine.generate(PROMPTS[0], max_tokens=4)
    data = model / "model.safetensors"
    data.chmod(0o644)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 3)
    engine.runtime.store.drop_page_cache()
    with pytest.raises(OSError, match="changed since od-moe loaded it"):
        engine.generate(PROMPTS[1], max_tokens=32)
    for cache in engine.caches:
        _consistent(cache)


def test_prefetch_backs_off_when_it_does_not_pay(predictor_dir):
    # an oracle replaying another prompt's routing predicts wrongly: precision falls, prefetch backs off
    wrong = od_moe.load(capacity="25%").record_routing(PROMPTS[1], NEW_TOKENS)
    engine = od_moe.load(capacity="25%")
    engine.configure_prefetch(
        "oracle", oracle_trace=wrong, settings=PrefetchSettings(window=8, timed_checks=False)
    )
    assert od_moe_tokens(engine, [PROMPTS[0]], NEW_TOKENS)[0]  # still exact and running
    p = engine.stats()["prefetch"]
    assert p["backoffs"] >= 1 and p["experts_per_layer"] < 8 and "precision" in p["backoff_reason"]


def test_policy_errors_are_clear(predictor_dir):
    with pytest.raises(UserError, match="unknown prefetch policy"):
        od_moe.load(capacity=8, prefetch="psychic")
    with pytest.raises(UserError, match="needs a shadow predictor"):
        od_moe.load(capacity=8, prefetch="predictor")
    with pytest.raises(UserError, match="oracle"):
        od_moe.load(capacity=8, prefetch="oracle")
    with pytest.raises(UserError, match="miss_policy='load'"):
        od_moe.load(capacity=8, miss_policy="skip", prefetch="next-gate")


def test_prefetch_pauses_when_it_costs_more_than_it_saves(predictor_dir):
    engine = _engine(
        "next-gate",
        predictor_dir,
        "25%",
        self_checks=True,
        first_check=10**9,  # the probe alone
        first_probe=16,
        probe_every=16,
        probe_tokens=8,
        pause_tokens=32,
    )
    queue = engine.runtime.governor
    for _ in range(16):
        queue.end_token("decode", 0.010)  # 10 ms per token with prefetch on
    assert queue.mode == "probe" and not queue.active
    for _ in range(8):
        queue.end_token("decode", 0.006)  # faster without it
    assert queue.mode == "paused" and queue.backoffs == 1
    assert "costs more than it saves" in queue.backoff_reason
    assert not queue.active  # paused: the runtime asks the policy for no predictions
    for _ in range(32):
        queue.end_token("decode", 0.006)
    assert queue.mode == "on" and queue.active
    # when tokens are slower without prefetch, it stays on
    for _ in range(16):
        queue.end_token("decode", 0.010)
    for _ in range(8):
        queue.end_token("decode", 0.020)
    assert queue.mode == "on" and queue.backoffs == 1
    assert queue.stats()["cost_probe"]["off_ms"] == pytest.approx(20.0)


def test_what_prefetch_costs_counts_its_bookkeeping_not_only_predicting(predictor_dir, monkeypatch):
    """The gain check weighs what prefetch costs the generation thread: besides predicting and queueing,
    the policy's bookkeeping after each routing and choosing which finished reads go in count too."""
    import od_moe.per_layer.loader as loader_module

    engine = _engine("predictor", predictor_dir, "25%")
    runtime, policy = engine.runtime, engine.runtime.policy
    slept = []

    def slow(f, counts=lambda *a: True):
        def wrapped(*a, **k):
            if counts(*a):
                time.sleep(0.002)
                slept.append(0.002)
            return f(*a, **k)

        return wrapped

    monkeypatch.setattr(
        policy, "after_routing", slow(policy.after_routing, lambda step, ids: step.prefetching)
    )
    monkeypatch.setattr(loader_module, "_paying", slow(loader_module._paying))
    engine.generate(PROMPTS[0], max_tokens=6)
    assert len(slept) > 20
    assert runtime.ledger.reader["busy_s"] >= sum(slept)


def _token(queue, seconds, useful=0, read_s=0.0, busy_s=0.0, stall_s=0.0, demand=0):
    """One decode token as the prefetch queue sees it: `useful` prefetches used, each read in `read_s`;
    `busy_s` of prefetch work on the generation thread; `stall_s` of demand reads of `demand` experts."""
    ledger = queue.ledger
    ledger.add("decode", 0, prefetch_useful=useful, read_s=stall_s, experts_read=demand)
    ledger.reader["completed"] += useful
    ledger.reader["reader_s"] += useful * read_s
    ledger.reader["busy_s"] += busy_s
    queue.end_token("decode", seconds)


def test_prefetch_pauses_when_the_reads_it_saves_cannot_repay_its_cost(predictor_dir):
    engine = _engine("next-gate", predictor_dir, "25%", self_checks=True)
    queue = engine.runtime.governor
    engine.reset_stats()
    queue.end_token("prefill", 0.1)
    for _ in range(
        queue.settings.first_check
    ):  # 10 useful prefetches of 0.1 ms reads, 3 ms of work, per token
        _token(queue, 0.020, useful=10, read_s=1e-4, busy_s=0.003)
    assert queue.mode == "paused" and not queue.active and queue.backoffs == 1
    assert "saves 1.00 ms of demand reads per token and costs 3.00 ms" in queue.backoff_reason
    for _ in range(queue.settings.probe_tokens):  # paused: the demand stall stays small
        _token(queue, 0.020, stall_s=0.001)
    assert queue.mode == "paused"
    for _ in range(queue.settings.probe_tokens):  # reads got slow (the page cache went cold): worth it again
        _token(queue, 0.030, stall_s=0.008)
        if queue.active:
            break
    assert queue.mode == "on" and queue.active
    for _ in range(queue.settings.first_check):  # and now it saves 30 ms per token for its 3 ms: it stays on
        _token(queue, 0.030, useful=10, read_s=3e-3, busy_s=0.003)
    assert queue.mode == "on" and queue.backoffs == 1
    assert queue.stats()["gain"]["hidden_ms"] == pytest.approx(30.0)


def test_a_saved_read_is_priced_at_what_demand_reads_cost_the_generation_thread(predictor_dir):
    """Where the disk likes a deep queue, one read takes long but a layer's misses read together cost the
    generation thread less per expert: a useful prefetch saves that, not the reader's time for one read.
    Without demand reads to go by, the reader's mean read time stands in."""
    engine = _engine("next-gate", predictor_dir, "25%", self_checks=True)
    queue = engine.runtime.governor
    engine.reset_stats()
    queue.end_token("prefill", 0.1)
    for _ in range(queue.settings.first_check):  # reads of 3 ms each, 4 demand misses read in 4 ms
        _token(queue, 0.040, useful=10, read_s=3e-3, busy_s=0.015, stall_s=0.004, demand=4)
    assert queue.mode == "paused"
    assert queue.stats()["gain"]["hidden_ms"] == pytest.approx(10.0)  # 10 saved at 1 ms, not at 3
    assert "saves 10.00 ms of demand reads per token and costs 15.00 ms" in queue.backoff_reason

    engine.reset_stats()
    queue.reset()
    queue.end_token("prefill", 0.1)
    for _ in range(queue.settings.first_check):  # every expert came from prefetch: no demand read to go by
        _token(queue, 0.040, useful=10, read_s=3e-3, busy_s=0.015)
    assert queue.mode == "on" and queue.stats()["gain"]["hidden_ms"] == pytest.approx(30.0)


def test_a_baseline_starts_prefetch_paused_and_prices_a_saved_read_at_demand_reads_alone(predictor_dir):
    """Demand reads beside prefetch reads wait for the disk, the CPU and the GIL they share: priced by
    them, useful prefetches seemed to save more than a token without prefetch took (H100, widened copy at
    25%, warm reads). With a baseline the first decode tokens run with prefetch paused, and demand reads in
    paused decode set the price where they are cheaper."""
    engine = _engine("next-gate", predictor_dir, "25%", self_checks=True, baseline_tokens=2)
    queue = engine.runtime.governor
    engine.reset_stats()
    queue.ledger.add("prefill", 0, experts_read=8, read_s=0.080)  # prefill's reads do not count
    queue.end_token("prefill", 0.1)
    for _ in range(queue.settings.baseline_tokens):  # alone: 1 ms per expert
        assert queue.mode == "paused" and not queue.active and not queue.measuring
        _token(queue, 0.030, stall_s=0.004, demand=4)
    assert queue.mode == "on" and queue.measuring and queue.backoffs == 0
    for _ in range(queue.settings.first_check):  # beside prefetch reads: 3 ms per expert
        _token(queue, 0.040, useful=10, read_s=3e-3, busy_s=0.015, stall_s=0.012, demand=4)
    assert queue.mode == "paused"
    assert queue.stats()["gain"]["hidden_ms"] == pytest.approx(10.0)  # 10 saved at 1 ms, not at 3
    for _ in range(queue.settings.probe_tokens):  # paused decode counts as well: now 2 ms per expert
        _token(queue, 0.030, stall_s=0.003, demand=1)
    queue._set_mode("on")
    for _ in range(queue.settings.first_check):  # no demand read in the stretch: that price alone
        _token(queue, 0.040, useful=10, read_s=3e-3, busy_s=0.015)
    assert queue.mode == "on" and queue.stats()["gain"]["hidden_ms"] == pytest.approx(20.0)
    queue._set_mode("on")
    for _ in range(queue.settings.first_check):  # cheaper beside prefetch than alone: the lower price
        _token(queue, 0.040, useful=10, read_s=3e-3, busy_s=0.015, stall_s=0.002, demand=4)
    assert queue.mode == "paused" and queue.stats()["gain"]["hidden_ms"] == pytest.approx(5.0)


def test_the_gain_check_still_decides_after_the_counts_are_reset(predictor_dir):
    """After `reset_stats` the first token booked is one of unknown time (the pass before the reset):
    the gain check waits a token for a clean window instead of never deciding."""
    engine = _engine("next-gate", predictor_dir, "25%", self_checks=True)
    queue = engine.runtime.governor
    engine.reset_stats()
    queue.end_token("decode", None)  # the last pass of the previous prompt, its time unknown
    queue.end_token("prefill", 0.1)
    for _ in range(queue.settings.first_check):  # the window of its last two tokens holds that one
        assert queue.measuring
        _token(queue, 0.020, useful=10, read_s=1e-4, busy_s=0.003)
    assert queue.mode == "paused" and queue.backoffs == 1 and not queue.measuring
    assert "costs 3.00 ms" in queue.backoff_reason


def test_a_one_off_cost_in_the_first_tokens_does_not_decide_the_gain_check(predictor_dir):
    """The predictor's kernels compile on first use, inside prefetch's timed work (15.3 s over the two
    measuring tokens of a process's first prompt on the H100): the check waits for a window without such a
    token instead of pausing on it."""
    engine = _engine("next-gate", predictor_dir, "25%", self_checks=True)
    queue = engine.runtime.governor
    engine.reset_stats()
    queue.end_token("prefill", 0.1)
    _token(queue, 15.0, useful=10, read_s=3e-3, busy_s=14.9)  # compiling
    for _ in range(queue.settings.first_check):  # then 30 ms saved per token for 3 ms of work
        assert queue.measuring and queue.mode == "on"
        _token(queue, 0.030, useful=10, read_s=3e-3, busy_s=0.003)
    assert queue.mode == "on" and queue.backoffs == 0 and not queue.measuring
    assert queue.stats()["gain"]["cost_ms"] == pytest.approx(3.0)


def test_where_reads_are_the_bottleneck_only_confident_predictions_are_read(predictor_dir):
    """Tokens spent mostly waiting for expert reads make the read path the bottleneck: the score floor for
    speculative reads rises to `read_bound_score`, and falls back once the waits shrink."""
    engine = _engine("next-gate", predictor_dir, "25%", self_checks=True)
    queue = engine.runtime.governor
    window = queue.settings.read_window
    queue.end_token("prefill", 0.1)
    for _ in range(window):  # 6 of 20 ms waiting: prefetch hides enough
        _token(queue, 0.020, useful=10, read_s=3e-3, busy_s=0.001, stall_s=0.006)
    assert not queue.read_bound and queue.min_score == queue.settings.min_score
    assert queue.stats()["stall_share"] == pytest.approx(0.3)
    for _ in range(window):  # 14 of 20 ms: the reads are the bottleneck
        _token(queue, 0.020, useful=10, read_s=3e-3, busy_s=0.001, stall_s=0.014)
    assert queue.read_bound and queue.min_score == queue.settings.read_bound_score > queue.settings.min_score
    assert queue.mode == "on"  # still prefetching, only the confident predictions
    for _ in range(window):  # 8 of 20 ms: between the thresholds, it stays
        _token(queue, 0.020, useful=10, read_s=3e-3, busy_s=0.001, stall_s=0.008)
    assert queue.read_bound
    for _ in range(window):  # 2 of 20 ms: not any more
        _token(queue, 0.020, useful=10, read_s=3e-3, busy_s=0.001, stall_s=0.002)
    assert not queue.read_bound and queue.min_score == queue.settings.min_score


def test_a_read_bound_runtime_queues_no_prediction_below_the_raised_floor(predictor_dir, monkeypatch):
    def submitted(read_bound):
        # no timed checks: the verdict stays
        engine = _engine("predictor", predictor_dir, "25%", read_bound_at_start=read_bound)
        asked = []
        submit = engine.runtime.reader.submit
        monkeypatch.setattr(
            engine.runtime.reader,
            "submit",
            lambda layer, chosen, absent: (
                asked.extend(chosen[e] for e in absent) or submit(layer, chosen, absent)
            ),
        )
        engine.generate(PROMPTS[0], max_tokens=NEW_TOKENS)
        return asked, engine.stats()["io"]["decode"]["bytes_read"]

    (usual, usual_bytes), (bound, bound_bytes) = submitted(False), submitted(True)
    floor = PrefetchSettings().read_bound_score
    assert bound and min(bound) >= floor  # it still reads ahead, what is likely
    assert any(score < floor for score in usual)  # the usual floor lets less likely ones through
    assert bound_bytes < usual_bytes


def test_the_reader_thread_ends_with_its_engine():
    import gc
    import time

    def readers():
        return sum(t.name == "od-moe-reader" for t in threading.enumerate())

    gc.collect()
    before = readers()
    engine = od_moe.load(capacity=16, prefetch="next-gate")
    engine.generate(PROMPTS[0], max_tokens=8)
    assert readers() == before + 1  # small experts: one reader thread
    del engine
    gc.collect()
    deadline = time.time() + 5
    while readers() > before and time.time() < deadline:
        time.sleep(0.05)
    assert readers() == before


def test_a_prefetch_never_evicts_an_expert_predicted_for_the_same_layer(predictor_dir):
    engine = _engine("next-gate", predictor_dir, 16)
    runtime, cache = engine.runtime, engine.caches[3]
    runtime.load(cache, np.arange(16))
    cache.touch(np.arange(16), np.ones(16), clock=1.0 + np.arange(16))  # expert 0 is the least recently used
    _submit(engine, 3, [0, 20], [0.9, 0.8])  # 0 is resident and predicted: only 20 is read
    runtime.reader.drain()
    assert runtime.ledger.reader["issued"] == 1
    runtime.loader.install_ready({})
    assert cache.slot_of[20] >= 0 and cache.slot_of[0] >= 0  # LRU alone would have evicted 0 for 20
    assert cache.slot_of[1] < 0  # the next least recently used went instead
    _consistent(cache)


def test_next_token_lens_names_the_next_first_layer_experts(monkeypatch):
    """At the last layer the logit lens guesses the next token's first-layer experts far better than
    repeating this token's (the bundled predictor's policy; truth from the recorded routing)."""
    engine = od_moe.load(capacity="25%", predictor=od_moe.DEFAULT_PREDICTOR)
    engine.configure_prefetch(
        "predictor", settings=PrefetchSettings(timed_checks=False)
    )  # predict at every token
    lens, guesses = engine.runtime.policy.lens, []
    real = lens.predict
    monkeypatch.setattr(
        lens,
        "predict",
        lambda x, k: guesses.append((engine.runtime.ledger.forwards, real(x, k))) or guesses[-1][1],
    )
    routing = engine.record_routing(PROMPTS[1], max_tokens=48)
    lens_recall, repeat_recall = [], []
    for forward, (ids, _) in guesses:
        if forward < len(routing):  # forwards count from 1: routing[forward] is the next pass
            truth = set(routing[forward][0][-1].tolist())
            lens_recall.append(len(truth & set(np.array(ids).tolist())) / len(truth))
            repeat_recall.append(len(truth & set(routing[forward - 1][0][-1].tolist())) / len(truth))
    assert len(lens_recall) >= 40
    assert np.mean(lens_recall) > 0.55 and np.mean(lens_recall) > np.mean(repeat_recall) + 0.2, (
        np.mean(lens_recall),
        np.mean(repeat_recall),
    )


@pytest.mark.parametrize("policy", ["none", "next-gate"])
def test_several_reader_threads_give_exact_tokens(policy, predictor_dir, bundled_reference):
    """Demand misses read by the generation thread with helpers, prefetches by four threads at once."""
    engine = od_moe.load(capacity="25%", prefetch="none", read_threads=4)
    engine.configure_prefetch(policy, settings=PrefetchSettings(timed_checks=False))
    assert od_moe_tokens(engine, PROMPTS[:2], NEW_TOKENS) == bundled_reference[:2]
    stats = engine.stats()
    _invariants(stats)
    # every expert read, demand or prefetch, installed or not, is counted once with its bytes
    assert (
        stats["total"]["bytes_read"] == stats["total"]["experts_read"] * engine.caches[0].layout.expert_nbytes
    )


def test_device_copy_path_gives_exact_tokens(monkeypatch, bundled_reference):
    """The CUDA install path, taken on any backend: reader threads make the MLX arrays of what they read
    and installs are MLX slice updates from them (no numpy writes)."""
    monkeypatch.setattr(od_moe.memory.backend, "arrays_in_host_memory", lambda: False)
    monkeypatch.setattr(
        od_moe.memory.backend, "copies_into_arrays", lambda: False
    )  # no CUDA runtime's copies
    engine = od_moe.load(capacity="25%", prefetch="none", read_threads=4)
    engine.configure_prefetch("next-gate", settings=PrefetchSettings(timed_checks=False))
    assert engine.runtime.reader.make_arrays
    assert od_moe_tokens(engine, PROMPTS[:2], NEW_TOKENS) == bundled_reference[:2]
    assert not any(cache.host_writes for cache in engine.caches)
    stats = engine.stats()
    _invariants(stats)
    assert stats["prefetch"]["installed"] > 0
    for cache in engine.caches:
        _consistent(cache)


def test_stats_say_in_one_line_when_prefetch_paused_why_and_when_it_would_pay(predictor_dir):
    from od_moe.accounting.report import pause_line

    engine = _engine("next-gate", predictor_dir, "25%", self_checks=True)
    queue = engine.runtime.governor
    engine.reset_stats()
    assert pause_line(queue.stats()) is None  # never paused: no line
    queue.end_token("prefill", 0.1)
    for _ in range(queue.settings.first_check):  # saves 1 ms a token for 3 ms of work
        _token(queue, 0.020, useful=10, read_s=1e-4, busy_s=0.003)
    line = pause_line(queue.stats())
    at = queue.settings.first_check
    assert line.startswith(f"prefetch paused at decode token {at} and stayed paused: its reads saved 1.00 ms")
    assert "cost 3.00 ms of a 20.0 ms token" in line and "once they stall a token 6.00 ms or more" in line
    for _ in range(queue.settings.probe_tokens):  # the stall grew past twice its cost: it resumes
        _token(queue, 0.030, stall_s=0.008)
        if queue.active:
            break
    assert "and resumed later" in pause_line(queue.stats()) and "\n" not in line
