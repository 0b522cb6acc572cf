"""Three tiers replayed against a clock (`od_moe/caching/tier_replay.py`): hand-worked passes (a stop, a
late read ahead, demand reads first, a read ahead taken off the queue), properties on random routing, and
the bench's recording of the bundled model's decode."""

import numpy as np
import pytest

import od_moe
from od_moe.bench.tier_replay import forecasts, next_use_distances, record_decode, replay_rows
from od_moe.caching.tier_replay import Forecast, SlotAdmission, TierClock, replay_tiers
from od_moe.storage.model_files import DEFAULT_PREDICTOR
from od_moe.two_tier.settings import ADMIT_EVERY_PAST_HOST, AdmissionSettings


def _one_layer(*experts):
    return [[np.array([e])] for e in experts]


def test_a_pass_meeting_an_expert_on_disk_stops_reads_and_waits():
    # 1 slot + 1 row; a read takes 10 ms, a layer 1 ms; a stop runs 2 layers past the miss
    clock = TierClock(layer_ms=1, disk_rate=1000, expert_bytes=10, lag=2)
    f = replay_tiers(_one_layer(0, 0, 1), device=1, host=1, clock=clock)
    # pass 0: 0 absent -> stop (2 ms), read (10 ms); pass 1: 0 in its slot; pass 2: as pass 0 with 1
    assert (f.stopped, f.wasted_ms, f.stall_ms, f.compute_ms) == (2, 4.0, 20.0, 3.0)
    assert (f.demand_reads, f.device_lanes, f.disk_lanes, f.host_lanes) == (2, 1, 2, 0)
    assert f.token_ms == pytest.approx(27 / 3)


def _ahead_for_layer_one(*experts):
    """One pass of two layers routing [0] then [1], and a forecast made at layer 0 naming `experts` for
    layer 1."""
    ids = np.array(experts)
    return [[np.array([0]), np.array([1])]], Forecast("f@1", [[{1: (ids, np.ones(len(ids)))}, {}]])


@pytest.mark.parametrize("demand_first, stall", [(False, 9.0), (True, 6.0)])
def test_a_layers_own_read_waits_behind_reads_ahead_unless_it_goes_first(demand_first, stall):
    # lag 0: flags and forecasts read at once. At layer 0's stop (time 0) reads ahead of 1 (0-3 ms) and 2
    # (queued); expert 0's own read goes after both (6-9 ms) or after the one started (3-6 ms)
    routing, forecast = _ahead_for_layer_one(1, 2)
    clock = TierClock(layer_ms=1, disk_rate=1000, expert_bytes=3, lag=0)
    f = replay_tiers(routing, 1, 2, clock, forecast=forecast, demand_first=demand_first)
    assert f.stall_ms == stall
    assert (f.demand_reads, f.ahead_reads, f.ahead_used, f.ahead_late) == (1, 2, 1, 0)
    assert (f.host_lanes, f.disk_lanes) == (1, 1)  # expert 1 landed before layer 1 ran


def test_a_read_ahead_not_started_when_its_layer_ran_without_it_is_taken_off_the_queue():
    # reads ahead of 1 (0-3 ms), 2 and 3 queued; 0's own read first (3-6); at layer 1 (7 ms) 2 has started
    # (6-9), 3 has not: layer 1 routed 1 only, so 3 is never read
    routing, forecast = _ahead_for_layer_one(1, 2, 3)
    clock = TierClock(layer_ms=1, disk_rate=1000, expert_bytes=3, lag=0)
    f = replay_tiers(routing, 1, 3, clock, forecast=forecast, demand_first=True)
    assert (f.ahead_reads, f.ahead_cancelled, f.ahead_used, f.reads) == (2, 1, 1, 3)


def test_a_read_ahead_landing_after_its_layer_needs_it_is_late_and_waited_for():
    # a read takes 5 ms; forecast at layer 0 (its stop, time 0): 1 lands at 5; 0's own read 5-10, so layer
    # 1 runs at 11 with 1 landed; with 0 in a slot already (a second pass) 1 is needed at 1 ms: late
    clock = TierClock(layer_ms=1, disk_rate=1000, expert_bytes=5, lag=0)
    routing = [[np.array([0]), np.array([2])], [np.array([0]), np.array([1])]]
    ahead = [[{}, {}], [{1: (np.array([1]), np.ones(1))}, {}]]
    f = replay_tiers(routing, 1, 1, clock, forecast=Forecast("f@1", ahead), warm=1)
    # pass 1: layer 0 hits its slot (no stop), the forecast is read at once; layer 1 stops (1 landed after
    # the pass began), waits from 1 to 5
    assert (f.stopped, f.ahead_used, f.ahead_late, f.disk_lanes) == (1, 1, 1, 1)
    assert f.stall_ms == pytest.approx(5 - 1)


def _skewed(seed=0, layers=4, experts=16, k=2, passes=300):
    rng = np.random.default_rng(seed)
    p = np.arange(1, experts + 1) / np.arange(1, experts + 1).sum()
    return [
        [np.sort(rng.choice(experts, k, replace=False, p=p)) for _ in range(layers)] for _ in range(passes)
    ]


def _true_distances(routing, experts):
    """(passes, layers, experts): passes until each expert is routed again, after each pass (an exact
    next-use head)."""
    T, L = len(routing), len(routing[0])
    out = np.full((T, L, experts), float(T))
    for j in range(L):
        nxt = np.full(experts, np.inf)
        for t in range(T - 1, -1, -1):
            out[t, j] = np.minimum(nxt - t, T)
            nxt[routing[t][j]] = t
    return out


def test_every_lane_is_in_one_tier_and_reads_add_up():
    routing = _skewed()
    clock = TierClock(layer_ms=1, disk_rate=1e3, expert_bytes=2, lag=2)
    gate = Forecast(
        "g@1", [[{j + 1: (step[j + 1], np.ones(2))} if j < 3 else {} for j in range(4)] for step in routing]
    )
    for kw in ({}, dict(oracle_distance=2), dict(forecast=gate, eviction="predicted")):
        f = replay_tiers(routing, 2, 3, clock, warm=20, **kw)
        assert f.device_lanes + f.host_lanes + f.disk_lanes == 280 * 4 * 2
        assert f.reads == f.demand_reads + f.ahead_reads and f.ahead_used + f.ahead_wasted <= f.ahead_reads
        assert f.passes == 280


def test_with_every_expert_resident_nothing_is_read_after_the_warm_up():
    every = [[np.array([2 * i, 2 * i + 1])] * 4 for i in range(8)]  # each of the 16 experts routed once
    f = replay_tiers(every + _skewed(), 8, 8, TierClock(1, 1e3, 2), warm=8)
    assert (f.reads, f.stopped, f.stall_ms, f.disk_lanes) == (0, 0, 0.0, 0)
    assert f.token_ms == 4.0


def test_the_oracle_and_a_true_next_use_head_read_less_than_demand_with_lru():
    routing = _skewed(1)
    clock = TierClock(layer_ms=1, disk_rate=1e3, expert_bytes=2, lag=2)
    demand = replay_tiers(routing, 2, 3, clock, warm=20)
    oracle = replay_tiers(routing, 2, 3, clock, warm=20, oracle_distance=2)
    head = replay_tiers(
        routing, 2, 3, clock, warm=20, eviction="next-use", distances=_true_distances(routing, 16)
    )
    assert oracle.token_ms < demand.token_ms and oracle.ahead_wasted == 0
    assert head.demand_reads < demand.demand_reads and head.ahead_reads == 0


def test_bad_settings_are_refused():
    routing, clock = _skewed(passes=4), TierClock(1, 1e3, 2)
    with pytest.raises(ValueError, match="eviction must be"):
        replay_tiers(routing, 2, 2, clock, eviction="mru")
    with pytest.raises(ValueError, match="only it"):
        replay_tiers(routing, 2, 2, clock, eviction="next-use")
    with pytest.raises(ValueError, match="not both"):
        replay_tiers(routing, 2, 2, clock, forecast=Forecast("f@1", []), oracle_distance=1)


def test_the_bundled_models_decode_is_recorded_and_replayed_under_every_policy():
    engine = od_moe.load(capacity=1.0, two_tier=False, predictor=DEFAULT_PREDICTOR)
    recording = record_decode(engine, ["def fibonacci(n):", "class Stack:"], max_tokens=9)
    agree, compared = recording.agreement
    assert compared == 2 * 8 * 8 and agree == compared  # teacher-forced routing is the decode's
    assert len(recording.routing) == 2 * 8 and all(len(step) == 8 for step in recording.routing)
    k = engine.top_k
    predicted = forecasts(recording, engine.routers(), k, k, 1, engine.predictor)
    gate = forecasts(recording, engine.routers(), k, k, 1)
    # the predictor names layer 1's experts from layer 0 better than chance (k of 64)
    hits = [len(set(predicted.ahead[t][0][1][0]) & set(step[1])) for t, step in enumerate(recording.routing)]
    assert np.mean(hits) > 2 * k * k / 64
    head = next_use_distances(recording, engine.predictor)
    assert head is not None and head.shape == (16, 8, 64)
    clock = TierClock(0.5, 1e9, 2_654_208)
    rows = replay_rows(
        recording.routing, [(16, 8)], clock, [predicted, gate], [1], warm=4, distances_ahead=head
    )
    names = [(r.policy, r.eviction) for r in rows]
    assert names[:3] == [("demand", "lru"), ("demand", "next-use"), ("oracle@1", "true next use")]
    assert len(rows) == 3 + 2 * 3 and all(r.figures.passes == 12 for r in rows)
    assert rows[2].hidden == 1.0 and rows[0].hidden is None


def test_admitted_slots_change_only_at_admissions_recency_slots_at_every_use():
    # expert 1 for 64 passes, then expert 2 for 65: admitted slots (every 64 passes, by decayed counts) hold
    # 1 until pass 128, so 2 is read in place from its host row meanwhile; recency slots take 2 at once
    routing = _one_layer(*([1] * 64 + [2] * 65))
    clock = TierClock(layer_ms=1, disk_rate=1000, expert_bytes=1)
    admitted = replay_tiers(
        routing, 1, 3, clock, warm=64, slots="admitted", admission=SlotAdmission(every=64)
    )
    recency = replay_tiers(routing, 1, 3, clock, warm=64)
    assert (admitted.disk_lanes, admitted.host_lanes, admitted.device_lanes) == (1, 63, 1)
    assert (recency.disk_lanes, recency.host_lanes, recency.device_lanes) == (1, 0, 64)
    with pytest.raises(ValueError, match="slots must be"):
        replay_tiers(routing, 1, 3, clock, slots="pinned")


def test_admission_half_life_and_margin_decide_when_a_newcomer_takes_the_slot():
    # expert 1 for 64 passes, then expert 2 for 64, one slot admitted every 8 passes: counts that halve each
    # pass give 2 the slot at the first admission after it is routed (pass 72); halving every 8 passes, 2
    # passes 1's count by the margin of 2 after 11 passes (pass 75), so it takes the slot at pass 80; counts
    # that do not decay keep 1 (64 uses) in the slot throughout
    routing = _one_layer(*([1] * 64 + [2] * 64))
    clock = TierClock(layer_ms=1, disk_rate=1000, expert_bytes=1)

    def device_lanes(half_life: float, margin: float) -> int:
        admission = SlotAdmission(every=8, half_life=half_life, margin=margin)
        return replay_tiers(routing, 1, 3, clock, warm=64, slots="admitted", admission=admission).device_lanes

    assert device_lanes(1.0, 0.0) == 128 - 72
    assert device_lanes(8.0, 2.0) == 128 - 80
    assert device_lanes(1e9, 2.0) == 0


def test_the_replays_admission_is_the_products_past_the_hosts_memory():
    replayed, product = SlotAdmission(), AdmissionSettings()
    assert replayed.every == ADMIT_EVERY_PAST_HOST
    assert (replayed.half_life, replayed.margin) == (product.half_life, product.margin)
