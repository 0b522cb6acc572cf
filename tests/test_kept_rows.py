"""Rows kept by the device in two-tier mode (`od_moe/two_tier/kept_rows.py`): least recently used, filled
by the layer's misses and by predictions; exact tokens, rows holding what they say, and the decisions the
CUDA kernel makes (its numpy twin `plan`, which the CPU runs)."""

import shutil

import cuda_emulation
import mlx.core as mx
import numpy as np
import pytest

import od_moe
from conftest import NEW_TOKENS, PROMPTS, od_moe_tokens, reference_tokens
from od_moe.bench.prefetch import _predictor_for
from od_moe.errors import UserError
from od_moe.two_tier import forecast, kept_rows
from od_moe.two_tier.settings import ADMIT_EVERY, ForecastSettings, KeptRowsSettings, TwoTierSettings
from tiny_models import FAMILIES, write_mlx_model

E, C, EMPTY = 16, 2, kept_rows.AGE_EMPTY


def test_plan_keeps_wanted_rows_and_evicts_the_least_recently_used():
    base = np.arange(E)  # nothing in a slot
    held, age = np.array([3, 5, -1, 7]), np.array([0, 4, EMPTY, 2])
    rows, now, new_age, copies, _ = kept_rows.plan([5, 9, 9, 11], base, held, age, E, C, demand=True)
    # 5 is kept; 9 (once) goes to the empty row, 11 to the oldest of the rest (row 3, age 2 beats 0)
    assert copies == [(9, E + C + 2), (11, E + C + 3)]
    assert now.tolist() == [3, 5, 9, 11] and new_age.tolist() == [1, 0, 0, 0]
    assert rows[5] == E + C + 1 and rows[9] == E + C + 2 and rows[3] == E + C + 0 and rows[7] == 7


def test_plan_skips_experts_in_slots_and_stops_when_rows_run_out():
    base = np.arange(E)
    base[4] = E + 1  # expert 4 is in slot 1
    held, age = np.array([-1, -1]), np.array([EMPTY, EMPTY])
    rows, now, new_age, copies, _ = kept_rows.plan([4, 6, 8, 10], base, held, age, E, C, demand=False)
    assert [e for e, _ in copies] == [6, 8] and rows[4] == E + 1 and rows[10] == 10
    # a prediction (not the layer's own routing) ages nothing
    _, _, aged, _, _ = kept_rows.plan([], base, now, new_age, E, C, demand=False)
    assert aged.tolist() == [0, 0]


def test_plan_by_decayed_counts_admits_a_miss_only_over_a_lower_count():
    """With a decay, a demand call's counts decay and rise by 1 where routed; a miss takes the
    lowest-counted row not wanted (empty rows first) only where its own count is higher, else it is read
    in place; the next miss may still take that row."""
    base = np.arange(E)
    held, age = np.array([3, 5, 7]), np.zeros(3, np.int64)
    score = np.zeros(E, np.float32)
    score[[3, 5, 7, 9, 11]] = [4.0, 2.0, 1.0, 0.5, 3.0]
    rows, now, _, copies, after = kept_rows.plan([5, 9, 11], base, held, age, E, C, True, score, 0.5)
    # counts after: 3 -> 2.0, 5 -> 2.0 (routed), 7 -> 0.5, 9 -> 1.25 (routed), 11 -> 2.5 (routed)
    assert after[[3, 5, 7, 9, 11]].tolist() == [2.0, 2.0, 0.5, 1.25, 2.5] and after.dtype == np.float32
    # 9 beats row 2's 7 (1.25 > 0.5) and takes it; 11 (2.5) beats nothing below it but 3 (2.0): row 0
    assert copies == [(9, E + C + 2), (11, E + C + 0)] and now.tolist() == [11, 5, 9]
    _, now, _, copies, _ = kept_rows.plan([9], base, np.array([3, -1]), age[:2], E, C, True, after, 0.5)
    assert copies == [(9, E + C + 1)]  # an empty row takes any miss
    _, _, _, copies, _ = kept_rows.plan([13], base, np.array([3, 5]), age[:2], E, C, True, after, 0.5)
    assert copies == []  # 13's count (1.0) is not above 3's (1.0) nor 5's: read in place


def test_demand_calls_take_a_few_sizes_padded_with_an_id_no_call_copies():
    """A batch's routed lanes are padded to a power of two from 8 candidates (the kernel compiles per
    size), with E, which the decision drops: the same copies and rows as the lanes alone."""
    assert [kept_rows.padded_size(n) for n in (1, 8, 9, 16, 17, 40, 64, 80)] == [
        8,
        8,
        16,
        16,
        32,
        64,
        64,
        128,
    ]
    assert kept_rows.demand_sizes(64) == [8, 16, 32, 64]
    assert kept_rows.demand_sizes(80) == [8, 16, 32, 64, 128]  # a batch of 8 at top-10 (Qwen3-Next)
    ids = mx.array([5, 9, 9, 11, 2, 3, 4, 6, 8, 1], mx.uint32)
    cand = kept_rows.padded(ids, E)
    assert cand.dtype == mx.uint32 and cand.size == 16 and cand[10:].tolist() == [E] * 6
    assert kept_rows.padded(ids[:8], E).size == 8
    base, held, age = np.arange(E), np.array([3, 5, -1, 7]), np.array([0, 4, EMPTY, 2])
    alone = kept_rows.plan(ids.tolist(), base, held, age, E, C, demand=True)
    with_pad = kept_rows.plan(cand.tolist(), base, held, age, E, C, demand=True)
    assert (
        alone[3] == with_pad[3]
        and np.array_equal(alone[0], with_pad[0])
        and np.array_equal(alone[1], with_pad[1])
    )


def test_a_demand_call_takes_a_batch_of_any_size():
    """72 routed lanes (9 sequences at top-8, past the 64 a call once took): the layer's misses are copied
    into its rows, as many as it has, and each lane reads its expert's row; the rest read in place."""
    S = 4
    stack = {("p", "w"): mx.array(np.arange((E + S) * 8, dtype=np.uint8).reshape(E + S, 8))}
    rows = kept_rows.KeptRows([stack], E, [0], S, KeptRowsSettings())
    ids = mx.array(np.resize([3, 5, 7, 9, 11], 72).astype(np.uint32).reshape(9, 8))
    lanes = rows.lanes(0, mx.arange(E, dtype=mx.uint32))
    arrays, read, outputs = lanes.read(ids, *lanes.inputs)
    copied, hits = rows.read()
    assert not lanes.traced and arrays == (stack["p", "w"],)
    assert outputs == {} and copied.tolist() == [4] and hits.tolist() == [0]  # all missed; 4 rows filled
    want = {3: E, 5: E + 1, 7: E + 2, 9: E + 3, 11: 11}
    assert read.tolist() == [[want[e] for e in row] for row in ids.tolist()]
    assert kept_rows.wrong_rows(rows) == 0


def test_a_fused_pass_gives_the_kernel_and_the_products_the_stack_once(monkeypatch):
    """The device's one-call plan (CUDA only, so its kernel is stood in for here): the stack goes into the
    compiled call once, both the kernel and the products get each of its arrays whole, and the kernel is
    asked for no tables and given the routed ids as they are (compiled for their padded count)."""
    S = 4
    stack = {("p", "w"): mx.array(np.arange((E + S) * 8, dtype=np.uint8).reshape(E + S, 8))}
    rows = kept_rows.KeptRows([stack], E, [0], S, KeptRowsSettings())
    given = []

    def stand_in(layer, count, ahead, tables=True, lanes=None):
        def launch(*inputs):
            given.append((inputs[0], tables, inputs[1].tolist(), count, lanes))
            lane_rows = mx.arange(count, dtype=mx.uint32)
            state = [rows.held[0], rows.age[0], rows.counts.of(0), rows.score[0]]
            return [*state, lane_rows]  # a fused pass's kernel: the rows' state, the lanes' rows

        return launch

    monkeypatch.setattr(rows, "_kernel_call", stand_in)
    lanes = rows.fused_lanes(0, mx.arange(E, dtype=mx.uint32))
    ids = mx.array([[3, 5]], mx.uint32)
    arrays, read, outputs = lanes.read(ids, *lanes.inputs)
    assert arrays == (stack["p", "w"],) and read.tolist() == [[0, 1]] and len(outputs["rows"]) == 4
    assert lanes.traced and len(lanes.inputs) == 1 + 5 + 1  # the table, the rows' state, the stack's array
    ((kernel_array, tables, cand, count, lanes),) = given
    assert kernel_array is stack["p", "w"] and not tables  # the products read only the lanes' rows
    assert cand == [3, 5] and (count, lanes) == (kept_rows.padded_size(2), 2)


def test_rows_count_copies_and_hits_as_running_totals_read_at_any_time():
    """Each layer's call adds to its running count of copies and hit lanes (`KeptRows.counted`): nothing
    a pass makes waits for the host to read it, however long the generation, and reading every few
    tokens or only at each request's end books the same totals."""
    totals = []
    for read_between in (True, False):
        engine = od_moe.load(capacity=0.25, two_tier="lru")
        for prompt in PROMPTS:
            for i, _ in enumerate(engine.stream_generate(prompt, max_tokens=NEW_TOKENS)):
                if read_between and i % 3 == 1:
                    engine.stats()  # settles: reads the rows' counts mid-generation
        total = engine.stats()["total"]
        totals.append((total["experts_loaded"], total["decode"]["hits"], total["decode"]["misses"]))
    assert totals[0] == totals[1] and totals[0][0] > 0 and totals[0][1] > 0


def test_a_long_generation_books_the_rows_counts_as_it_goes():
    """A server reads the ledger while it decodes (`stats(settle=False)`): every `ADMIT_EVERY` positions the
    rows' counts of a pass a few passes back (done) are booked, with no wait, so a batch that never empties
    shows its hits; the request's end books the rest."""
    engine = od_moe.load(capacity=0.25, two_tier="lru")
    seen = []
    for _ in engine.stream_generate(PROMPTS[0], max_tokens=ADMIT_EVERY + 16):
        seen.append(engine.stats(settle=False)["total"]["decode"]["hits"])
    assert seen[8] == 0 and seen[-1] > 0  # booked mid-generation, before the request ended
    total = engine.stats()["total"]
    assert total["decode"]["hits"] >= seen[-1] and total["experts_loaded"] == total["decode"]["misses"]


def test_top_ranks_as_the_kernel_does():
    scores = np.array([0.5, 2.0, 2.0, -1.0, 3.0], np.float32)
    assert kept_rows.top(scores, 3) == [4, 1, 2]  # ties: the lower id first


@pytest.mark.parametrize("fraction", [0.125, 0.25, 0.5])
def test_device_lru_matches_mlx_lm(bundled_reference, fraction):
    engine = od_moe.load(capacity=fraction, two_tier="lru")
    runtime = engine.runtime
    assert runtime.device_lru and runtime.kept_rows.rows == engine.capacity and not runtime.admissions
    assert "least recently used" in engine.mode_reason
    assert od_moe_tokens(engine, PROMPTS, NEW_TOKENS) == bundled_reference
    stats = engine.stats()
    total = stats["total"]
    assert total["lookups"] == total["hits"] + total["misses"] and 0 < total["hits"] < total["lookups"]
    # every decoded miss was copied into a row (prefill reads in place); nothing read from disk
    assert total["experts_loaded"] == total["decode"]["misses"] > 0 and total["bytes_read"] == 0
    # a later prompt's prefill reads the experts the rows hold from them (before: every lane mapped)
    assert total["prefill"]["hits"] > 0
    assert kept_rows.wrong_rows(runtime.kept_rows) == 0
    assert all((c.slot_of < 0).all() for c in engine.caches)  # the host keeps none
    assert int(runtime.tally.counts.sum()) == 0  # routing counts feed admission alone: with it off, none


def test_device_rows_by_decayed_counts_match_mlx_lm_and_copy_fewer_experts(bundled_reference):
    """Rows kept by decayed routing counts (`KeptRowsSettings.decay`) give stock's tokens; a miss that does
    not earn a row is read in place, so fewer experts are copied than under least recently used for the
    same prompts, and every row holds the expert it is said to."""
    copied = {}
    for decay in (None, 0.9):
        by_counts = TwoTierSettings(kept_rows=KeptRowsSettings(decay=decay))
        engine = od_moe.load(capacity=0.25, two_tier="lru", path_settings=by_counts)
        assert od_moe_tokens(engine, PROMPTS[:2], NEW_TOKENS) == bundled_reference[:2]
        total = engine.stats()["total"]
        copied[decay] = total["experts_loaded"]
        assert total["bytes_read"] == 0 and kept_rows.wrong_rows(engine.runtime.kept_rows) == 0
    assert 0 < copied[0.9] < copied[None]


def test_device_lru_at_full_capacity_is_the_plain_mode(bundled_reference):
    engine = od_moe.load(capacity=1.0, two_tier="lru")
    assert not engine.runtime.device_lru and engine.runtime.kept_rows is None
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3"])
def test_device_lru_other_families(tmp_path, name):
    path = write_mlx_model(tmp_path / name, FAMILIES[name])
    prompts = [[1, 17, 300, 42, 9, 88], [5, 600, 23, 23, 7]]
    engine = od_moe.load(str(path), capacity=0.25, two_tier="lru")
    assert od_moe_tokens(engine, prompts, 12) == reference_tokens(path, prompts, 12)
    assert kept_rows.wrong_rows(engine.runtime.kept_rows) == 0


@pytest.mark.parametrize("kind", ["shadow", "next-gate"])
def test_rows_filled_by_prediction_ahead_stay_exact(bundled_reference, kind):
    """Slots kept by the host (admission) plus 8 rows per layer filled from forecasts one layer ahead
    (`ForecastSettings`): hits rise above the slots' own, every copy is booked, tokens stay stock's."""
    predictor = _predictor_for("bundled") if kind == "shadow" else None
    ahead = TwoTierSettings(
        kept_rows=KeptRowsSettings(rows=8, demand=False),
        forecast=ForecastSettings(kind=kind, distance=1, predictor=predictor),
    )
    engine = od_moe.load(capacity=0.125, two_tier=True, path_settings=ahead)
    assert od_moe_tokens(engine, PROMPTS, NEW_TOKENS) == bundled_reference
    total = engine.stats()["total"]
    assert total["decode"]["hit_rate"] > 0.5 and total["experts_loaded"] > 0
    assert kept_rows.wrong_rows(engine.runtime.kept_rows) == 0


def test_forecasts_need_rows_and_a_known_kind():
    """A forecast copies into device-kept rows: asked for with none, or of a kind that does not exist, the
    load says so; by default none runs."""
    with pytest.raises(UserError, match="rows the device keeps"):
        od_moe.load(
            capacity=0.25,
            two_tier=True,
            path_settings=TwoTierSettings(forecast=ForecastSettings("next-gate")),
        )
    unknown = TwoTierSettings(kept_rows=KeptRowsSettings(rows=4), forecast=ForecastSettings("oracle"))
    with pytest.raises(UserError, match="forecast kind must be one of"):
        od_moe.load(capacity=0.25, two_tier=True, path_settings=unknown)
    assert od_moe.load(capacity=0.25, two_tier="lru").runtime.forecast is None


def test_the_folded_shadow_network_scores_as_the_network():
    engine = od_moe.load(capacity=0.25, two_tier=True)
    predictor = _predictor_for(engine.identity)
    predictor.attach_routers(*engine.routers())
    weights, biases = (mx.array(a) for a in engine.routers())
    x = mx.random.normal((3, weights.shape[-1]), key=mx.random.key(0))
    folded = forecast.shadow_forecast(predictor, 2, engine.routers())
    for source in (0, 4):
        reference = predictor(source, x, x @ weights[source].T + biases[source])
        for target, scores in folded(source, x):
            assert np.allclose(scores, reference[:, target - source - 1], atol=1e-4)


def test_a_bad_two_tier_value_is_refused():
    with pytest.raises(UserError, match="'lru'"):
        od_moe.load(capacity=0.25, two_tier="sometimes")


@pytest.mark.skipif(
    shutil.which("g++") is None,
    reason="the CUDA kernel's emulation compiles with g++ (Debian: apt-get install g++); .ci/run installs it",
)
@pytest.mark.parametrize(
    "E, C, S, P, sizes, decay, calls",
    [
        (128, 4, 32, 4, [12, 4], None, 60),  # 4-byte loads, 3 threads a block
        (128, 4, 32, 4, [12, 4], 0.9, 60),
        (64, 0, 8, 8, [12, 4], None, 60),  # few rows: evictions at most calls
        # 256 threads a block, each a thread of this machine meeting at every barrier (49 s for 60 calls on
        # 2 cores, 10 s for 20): fewer calls
        (64, 0, 8, 8, [1024, 12], 0.9, 20),
        (512, 0, 128, 10, [12, 4], None, 60),  # Qwen3-Next's experts and rows at 25%
    ],
)
def test_the_cuda_kernel_emulated_decides_and_copies_as_plan(E, C, S, P, sizes, decay, calls):
    """The device-kept rows' CUDA source, compiled for the CPU (`cuda_emulation.py`), against `plan` over the
    same calls: every table, lane, row, age, score and count equal after each call, and the same bytes in the
    rows at the end. It fails on a kernel whose blocks all leave before copying, or that breaks an age tie
    the other way."""
    assert cuda_emulation.differences(calls, E, C, S, P, sizes, seed=E + S, decay=decay) == []
