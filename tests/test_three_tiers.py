"""Three tiers (device slots, a bounded host tier, the disk): exact against stock mlx-lm, tiers that do not
overlap and hold the checkpoint's bytes, counts that add up, and a failed read that corrupts nothing."""

import mlx.core as mx
import numpy as np
import pytest

import od_moe
from conftest import NEW_TOKENS, PROMPTS, od_moe_tokens, reference_tokens
from od_moe.errors import ExpertReadError, UserError
from od_moe.runtime import TwoTierMode
from od_moe.two_tier.settings import (
    ADMIT_EVERY,
    ADMIT_EVERY_PAST_HOST,
    ADMIT_PASSES,
    DISK_SPAN,
    FLAGGED_RUNS,
    AdmissionSettings,
    KeptRowsSettings,
    TwoTierSettings,
)
from od_moe.two_tier.two_tier_runtime import TwoTierRuntime
from tiny_models import FAMILIES, write_mlx_model


def three_tiers(host: int, prefetch: str = "routed", path=None, capacity=0.25, rerun="exact", **settings):
    given = TwoTierSettings(host_experts=host, disk_prefetch=prefetch, disk_rerun=rerun, **settings)
    args = (str(path),) if path is not None else ()
    return od_moe.load(*args, capacity=capacity, two_tier=True, path_settings=given)


def tiers_hold_their_experts(engine):
    """Each host row and slot holds the bytes of the expert the tables give it, and no expert is in both."""
    weights = {}
    for f in sorted(engine.model_path.glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    runtime, H = engine.runtime, engine.runtime.host_rows
    for cache, stack in zip(engine.caches, runtime.stacks):
        row_of = runtime.host_tier.row_of[cache.layer]
        assert not ((row_of >= 0) & (cache.slot_of >= 0)).any(), "an expert in two tiers"
        in_host, in_slot = np.flatnonzero(row_of >= 0), np.flatnonzero(cache.slot_of >= 0)
        assert len(in_host) <= H
        rows = np.concatenate([row_of[in_host], H + cache.slot_of[in_slot]])
        experts = np.concatenate([in_host, in_slot])
        for part in cache.layout.parts:
            held = stack[part.proj, part.name][mx.array(rows)]
            expected = weights[f"{cache.layout.module_path}.{part.proj}.{part.name}"][mx.array(experts)]
            assert mx.array_equal(held, expected.astype(held.dtype)), (cache.layer, part.proj, part.name)


@pytest.mark.parametrize(
    "host, prefetch, rerun, span",
    # span: an expert's read in requests of at most that many bytes (the bundled model's parts are 384 B to
    # 6 KB: 4 KB cuts some), 0 one thread an expert
    [(16, "routed", "exact", DISK_SPAN), (16, "none", "exact", 0), (8, "routed", "flagged", 4096)],
)
def test_three_tiers_match_mlx_lm(bundled_reference, host, prefetch, rerun, span):
    engine = three_tiers(host, prefetch, rerun=rerun, disk_span=span)
    prompts = 2 if rerun == "exact" else 1  # flagged second runs run more passes: one prompt
    assert od_moe_tokens(engine, PROMPTS[:prompts], NEW_TOKENS) == bundled_reference[:prompts]
    stats = engine.stats()
    tiers, total = stats["tiers"], stats["total"]
    assert tiers["experts_per_layer"] == {"device": 16, "host": host, "disk": 64 - 16 - host}
    lanes = tiers["lanes"]
    assert lanes["device"] == total["hits"] and sum(lanes.values()) == total["lookups"]
    assert lanes["disk"] > 0 and lanes["host"] > 0 and lanes["device"] > 0  # every tier computed
    disk = tiers["disk"]
    assert disk["bytes_read"] == disk["experts_read"] * engine.caches[0].layout.expert_nbytes > 0
    # a pass runs again once where the second run waits at each layer, up to FLAGGED_RUNS times otherwise
    assert 0 < disk["reruns"] <= stats["passes"]["decode"] * (FLAGGED_RUNS if rerun == "flagged" else 1)
    assert 0 < disk["stopped_passes"] <= disk["reruns"]  # most stop a few layers past their first miss
    if prefetch == "none":
        assert disk["prefetch_reads"] == disk["prefetch_late"] == 0
    else:
        assert disk["prefetch_useful"] > 0
        # each read ahead is used, evicted unused, or still unused in its row
        assert disk["prefetch_useful"] + disk["prefetch_wasted"] <= disk["prefetch_reads"]
    tiers_hold_their_experts(engine)
    assert engine.runtime.figures().stack_moves == 0  # no view of a stack held while MLX filled it
    engine.close()


def test_a_flagged_pass_read_only_with_its_logits_runs_to_the_end(bundled_reference):
    """`flag_lag=0`: a flagged pass's counts are read with the logits alone, so none stops early; the
    tokens are the same."""
    engine = three_tiers(16, flag_lag=0)
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]
    disk = engine.stats()["tiers"]["disk"]
    assert disk["reruns"] > 0 and disk["stopped_passes"] == 0


def test_a_pass_run_again_skips_the_layers_before_its_first_miss(bundled_reference, monkeypatch):
    """A decode pass that met an expert on disk runs again from its first miss's decoder layer: the layers
    before it give the outputs they gave (not computed again, their caches as they were), so layer i is
    computed once a pass plus once a run again whose first miss is at i or before; the tokens are stock's,
    with runs again flagged or exact, passes stopping at their first miss or running on, and the first
    layers learning their routing first (none of them then misses)."""
    computed: list[int] = []
    layer_type = type(od_moe.load(capacity=0.25).model.model.layers[0])
    call = layer_type.__call__

    def counted(self, *args, **kwargs):
        computed.append(id(self))
        return call(self, *args, **kwargs)

    monkeypatch.setattr(layer_type, "__call__", counted)
    for settings in (
        dict(rerun="exact"),
        dict(rerun="flagged", flag_stop=False),
        dict(rerun="exact", flag_stop=False, exact_layers=2),
    ):
        engine = three_tiers(8, **settings)
        index = {id(layer): i for i, layer in enumerate(engine.model.model.layers)}
        firsts: list[int] = []
        read_ahead = engine.forward._read_ahead
        monkeypatch.setattr(
            engine.forward, "_read_ahead", lambda m, f=firsts, r=read_ahead: (f.append(m.first), r(m))
        )
        computed.clear()
        assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1], settings
        disk = engine.stats()["tiers"]["disk"]
        assert disk["reruns"] == len(firsts) and any(f > 0 for f in firsts)  # some layers skipped
        runs = np.bincount([index[i] for i in computed], minlength=len(index))
        firsts_by_layer = np.bincount(firsts, minlength=len(index))
        passes = runs[0] - firsts_by_layer[0]  # layer 0 runs once a pass, again only where it missed
        ran_again = np.cumsum(firsts_by_layer)  # runs again that computed layer i
        if disk["stopped_passes"] == 0:  # every run computed to the last layer
            assert (runs == passes + ran_again).all(), (settings, runs, firsts)
        else:  # a run that stopped early computed none past its stop
            assert (runs <= passes + ran_again).all() and runs[-1] < passes + ran_again[-1]
        assert (runs < passes + len(firsts))[1:].any()  # fewer than every run again from layer 0
        if settings.get("exact_layers"):
            assert min(firsts) >= 2
        tiers_hold_their_experts(engine)
        engine.close()


def test_forecasts_read_later_layers_experts_from_disk_ahead(bundled_reference):
    """Next-gate forecasts at the layers that wait for their routing read the experts two layers on from
    disk ahead of them: reads ahead are counted and most are used; the tokens are stock's."""
    from od_moe.two_tier.settings import ForecastSettings

    engine = three_tiers(16, prefetch="none", forecast=ForecastSettings(kind="next-gate", distance=2))
    assert od_moe_tokens(engine, PROMPTS[:2], NEW_TOKENS) == bundled_reference[:2]
    disk = engine.stats()["tiers"]["disk"]
    assert disk["prefetch_reads"] > 0 and disk["prefetch_useful"] > disk["prefetch_reads"] / 2
    # no expert's top-k x probability reaches 8.5 (top-8: at most 8): nothing is read ahead
    never = ForecastSettings(kind="next-gate", distance=2, floor=8.5)
    engine = three_tiers(16, prefetch="none", forecast=never)
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]
    disk = engine.stats()["tiers"]["disk"]
    assert disk["prefetch_reads"] == 0 and disk["experts_read"] > 0


def _bundled_predictor():
    from od_moe.predictor import load_predictor
    from od_moe.storage.model_files import DEFAULT_PREDICTOR

    return load_predictor(DEFAULT_PREDICTOR, od_moe.load(capacity=1.0, two_tier=False).identity)


def test_the_next_use_head_orders_the_host_tiers_eviction(bundled_reference):
    """With the shadow network's next-use head the host tier gives up the row whose expert is estimated to
    be needed last, not the least recently used; every layer has estimates after decoding; the tokens are
    stock's."""
    engine = three_tiers(8, prefetch="none", host_next_use=_bundled_predictor())
    assert od_moe_tokens(engine, PROMPTS[:2], NEW_TOKENS) == bundled_reference[:2]
    runtime = engine.runtime
    tier, due = runtime.host_tier, runtime.next_use.due
    assert tier.due is due and np.isfinite(due).all()
    assert engine.stats()["tiers"]["host_eviction"] == "next-use"
    held = tier.expert_in_row[3].copy()
    last_due = int(np.argmax(due[3, held]))
    tier.last_use[3] = 100
    tier.last_use[3, (last_due + 1) % tier.rows] = 0  # the least recently used row: another one
    tier.boundary()
    assert tier._free_row(3, keep=set()) == last_due
    tiers_hold_their_experts(engine)
    engine.close()


def test_a_next_use_order_without_its_head_or_for_another_model_is_refused():
    from dataclasses import replace
    from types import SimpleNamespace

    c = _bundled_predictor().config
    with pytest.raises(UserError, match="next-use head"):
        three_tiers(16, host_next_use=SimpleNamespace(config=replace(c, next_use=False)))
    with pytest.raises(UserError, match=r"does not fit this model: num_experts 32 \(the model has 64\)"):
        three_tiers(16, host_next_use=SimpleNamespace(config=replace(c, num_experts=32)))


def test_a_prompt_whose_experts_overflow_the_host_tier_reads_each_once(bundled_reference, monkeypatch):
    """A prompt's layer routes to more experts than the host tier has rows: its lanes run in groups of
    experts, each computed on a device copy of its experts before the next one's reads take its rows; the
    prompt's pass reads no expert twice, and the tokens stay stock's."""
    from od_moe.two_tier.host_tier import HostTier

    groups, reads = [], []
    original_groups, original_fetch = TwoTierRuntime._expert_groups, HostTier.fetch

    def counted(self, layer, ids):
        found = original_groups(self, layer, ids)
        groups.append(len(found))
        return found

    def fetch(self, layer, ids, protect=(), clock=0, ahead=False):
        absent = [int(e) for e in np.asarray(ids).tolist() if self.in_host(layer)[e] < 0]
        reads.extend((clock, layer, e) for e in absent)
        return original_fetch(self, layer, ids, protect, clock, ahead)

    from od_moe.two_tier import staged_passes

    copied, original_take = [], staged_passes.take_rows

    def take_rows(arrays, sources, count, by_kernel):
        copied.append((sources.size, int(count.item())))
        return original_take(arrays, sources, count, by_kernel)

    monkeypatch.setattr(TwoTierRuntime, "_expert_groups", counted)
    monkeypatch.setattr(HostTier, "fetch", fetch)
    monkeypatch.setattr(staged_passes, "take_rows", take_rows)
    engine = three_tiers(8)
    assert od_moe_tokens(engine, PROMPTS[:1], 16) == [bundled_reference[0][:16]]
    assert max(groups) > 1
    # the prompt's groups computed on device copies of their experts, each copied once: at most the rows
    # of the tiers a group spans (8 host rows and 16 slots), and as many as it routes to
    assert copied and all(rows == count <= 8 + 16 for rows, count in copied)
    prompt = [r for r in reads if r[0] == reads[0][0]]  # the first pass: all but the prompt's last token
    assert len(prompt) > 8 and len(set(prompt)) == len(prompt)


def test_no_computation_reads_a_row_past_a_bounded_stack(monkeypatch):
    """Every product a bounded stack's layer computes (a pass's, and the compile check's of each block)
    reads rows inside the stack: on CUDA a row past it faults (an H100 did, in `compiles_exactly`), while
    the CPU reads on."""
    from od_moe.two_tier.layer_step import LayerSteps

    original, outside = LayerSteps.compute, []

    def checked(self, arrays, x, rows, traced=False):
        try:  # concrete rows only: a trace's cannot be evaluated
            past = int(mx.max(rows).item()) >= arrays[0].shape[0]
        except ValueError:
            past = False
        outside.append(past)
        return original(self, arrays, x, rows, traced)

    monkeypatch.setattr(LayerSteps, "compute", checked)
    engine = three_tiers(8)
    od_moe_tokens(engine, PROMPTS[:1], 8)
    assert outside and not any(outside)


def test_a_direct_call_of_the_model_is_exact(bundled_reference):
    """A pass not run through `engine.forward` (no flags read) learns each layer's routing: stock logits."""
    from mlx_lm import load as mlx_lm_load

    from od_moe.memory import backend

    stock, _ = mlx_lm_load(str(od_moe.DEFAULT_MODEL))
    stock.set_dtype(backend.compute_dtype("auto"))
    engine = three_tiers(8)
    tokens = mx.array([[1, 17, 300, 42, 9, 88, 5, 600]])
    assert mx.array_equal(engine.model(tokens), stock(tokens))


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "qwen3_next", "gpt_oss"])
def test_other_families_match_mlx_lm(tmp_path, name):
    path = write_mlx_model(tmp_path / name, FAMILIES[name])
    prompts = [[1, 17, 300, 42, 9, 88], [5, 600, 23, 23, 7]]
    reference = reference_tokens(path, prompts, 12)
    config = FAMILIES[name]
    E = config.get("num_local_experts") or config.get("n_routed_experts") or config["num_experts"]
    engine = three_tiers(max(E // 4, config["num_experts_per_tok"]), path=path)
    assert od_moe_tokens(engine, prompts, 12) == reference, name
    assert engine.stats()["tiers"]["lanes"]["disk"] > 0


def test_a_failed_read_fails_the_request_and_corrupts_nothing(bundled_reference, monkeypatch):
    """A read that fails mid-token (EIO) fails that generation with the store's error; its row is free
    again, no table names it, and the next generation gives stock's tokens."""
    engine = three_tiers(8)
    store = engine.runtime.store
    original, calls = store.read_span, []

    def failing(layout, expert, span):  # one request of an expert's read, on a reader thread
        calls.append(1)
        if len(calls) == 40:
            raise ExpertReadError(f"{layout.module_path}: [Errno 5] Input/output error")
        return original(layout, expert, span)

    monkeypatch.setattr(store, "read_span", failing)
    with pytest.raises(ExpertReadError, match="Input/output error"):
        od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS)
    assert len(calls) >= 40
    tier = engine.runtime.host_tier
    assert not (tier.expert_in_row == -2).any()  # no row left taken by a read
    tiers_hold_their_experts(engine)
    assert od_moe_tokens(engine, PROMPTS[1:], NEW_TOKENS) == bundled_reference[1:]


def test_what_three_tiers_do_not_run_is_refused():
    with pytest.raises(UserError, match="at least the experts a position routes to"):
        three_tiers(7)
    with pytest.raises(UserError, match="two_tier=True"):
        three_tiers(8, kept_rows=KeptRowsSettings(rows=4))
    # admission off: the slots stay empty, every lane read from the host tier or the disk, still exact
    engine = three_tiers(16, admission=AdmissionSettings(enabled=False))
    assert engine.runtime.figures().tiers == {"device": 16, "host": 16, "disk": 32}


def test_every_path_reports_its_tiers():
    per_layer = od_moe.load(capacity=0.25, two_tier=False)
    assert per_layer.stats()["tiers"]["experts_per_layer"] == {"device": 16, "host": 0, "disk": 48}
    two = od_moe.load(capacity=0.25, two_tier=True)
    assert two.stats()["tiers"]["experts_per_layer"] == {"device": 16, "host": 64, "disk": 0}
    assert per_layer.stats()["tiers"]["host_eviction"] is two.stats()["tiers"]["host_eviction"] is None


def test_past_the_hosts_memory_auto_sizes_a_host_tier():
    """On a GPU with memory of its own, where the host's budget cannot hold every expert, "auto" (and
    two_tier=True) runs three tiers with a host tier of what the budget holds; the per-layer path where
    that is fewer than a position's experts, or where two tiers cannot run what was asked."""
    from od_moe import assembly

    ON, OFF = TwoTierMode.ON, TwoTierMode.OFF
    expert, layers, E, k = 2_650_000, 48, 128, 8

    def plan(asked, budget, clash=False, mode=OFF):
        return assembly.three_tiers(asked, clash, mode, "why", budget, expert, layers, E, k)

    assert plan("auto", expert * E * layers, mode=ON) == (ON, "why", None)  # every expert fits
    mode, why, host = plan("auto", expert * 32 * layers + 1)
    assert (mode, host) == (ON, 32) and why.startswith("three tiers: 32 of 128 experts a layer")
    assert plan(True, expert * 32 * layers, mode=ON)[2] == 32  # forced on: the budget still bounds the host
    mode, why, host = plan("auto", expert * 7 * layers)
    assert (mode, host) == (OFF, None) and "fewer than 8 experts a layer" in why
    assert plan("auto", expert * 32 * layers, clash=True) == (OFF, "why", None)  # predictive prefetch asked
    assert plan(False, expert * 32 * layers) == (OFF, "why", None)
    settings = assembly.settings_for_path(ON, None, "load", 4, host_experts=32)
    assert isinstance(settings, TwoTierSettings) and settings.host_experts == 32
    given = TwoTierSettings(host_experts=16)  # the caller's own host tier stands
    assert assembly.settings_for_path(ON, given, "load", 4, host_experts=32).host_experts == 16


def test_slots_are_admitted_oftener_past_the_hosts_memory_unless_the_caller_says():
    assert AdmissionSettings().cadence(past_host_memory=True) == ADMIT_EVERY_PAST_HOST
    assert AdmissionSettings().cadence(past_host_memory=False) == ADMIT_EVERY > ADMIT_EVERY_PAST_HOST
    assert AdmissionSettings(every=64).cadence(past_host_memory=True) == 64
    # the running engines': 24 tokens past the host's memory admit every 8 passes (at least `ADMIT_PASSES`
    # apart), and with every expert in host memory only the prompt's routing is admitted (at its first
    # decoded token), the next due 64 positions on
    last = {}
    for host_experts in (16, None):
        engine = three_tiers(host_experts) if host_experts else od_moe.load(capacity=0.25, two_tier=True)
        list(engine.stream_generate("def f(x):", max_tokens=24))
        last[host_experts] = engine.runtime._admitted_at  # the pass of the last admission
        engine.close()
    assert last[16] >= 3 * ADMIT_PASSES and last[None] < ADMIT_PASSES


def test_inspect_says_each_tiers_experts():
    from od_moe import preflight

    report = preflight.inspect_model(capacity=0.25)
    assert report["two_tier"]["tiers"] == {"device": 16, "host": 0, "disk": 48}  # the CPU: per-layer path
    text = preflight.format_inspection(report)
    assert "16 in slots, 0 in host memory read in place, 48 read from disk when routed" in text


def test_stats_health_and_metrics_give_each_tier_and_a_failed_read_fails_one_request(monkeypatch):
    """`--stats`, /health and /metrics show lanes per tier and what the disk did; a read that fails under a
    running server (EIO) fails that request with one error, and the server goes on serving exactly."""
    import json
    import threading
    import urllib.error
    import urllib.request

    from werkzeug.serving import make_server

    from od_moe.accounting.report import tiers_line
    from od_moe.server import create_app
    from od_moe.server.worker import GenerationWorker

    engine = three_tiers(16)
    worker = GenerationWorker(engine)
    srv = make_server("127.0.0.1", 0, create_app(worker=worker), threaded=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_port}"

    def call(path, body=None):
        data = json.dumps(body).encode() if body is not None else None
        request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=300) as r:
            text = r.read().decode()
            return json.loads(text) if r.headers.get_content_type() == "application/json" else text

    body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
    try:
        first = call("/v1/completions", body)["choices"][0]["text"]
        health, metrics = call("/health"), call("/metrics")
        tiers = health["expert_cache_stats"]["tiers"]
        assert tiers["experts_per_layer"] == {"device": 16, "host": 16, "disk": 32}
        assert tiers["lanes"]["disk"] > 0 and tiers["disk"]["reruns"] > 0
        assert f'expert_tier_lanes_total{{tier="disk"}} {tiers["lanes"]["disk"]}' in metrics
        assert f"expert_disk_reads_total {tiers['disk']['experts_read']}" in metrics
        line = tiers_line(tiers)
        assert line.startswith("tiers: experts a layer device 16 / host 16 / disk 32; lanes device ")
        assert "passes run again" in line and "MB read in" in line and "host tier evicts by recency" in line
        assert tiers["host_eviction"] == "recency"
        card = call("/dashboard/data")["tiers"]  # the live page's
        assert card["experts_per_layer"] == tiers["experts_per_layer"] and card["host_eviction"] == "recency"
        assert card["disk_bytes_read"] >= tiers["disk"]["bytes_read"] > 0 and card["reruns"] > 0
        assert sum(card["lane_shares"].values()) == pytest.approx(1.0) and card["lane_shares"]["disk"] > 0

        store = engine.runtime.store
        original = store.read_span

        def failing(layout, expert, span):
            raise ExpertReadError(f"{layout.module_path}: [Errno 5] Input/output error")

        monkeypatch.setattr(store, "read_span", failing)
        other = {"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0}
        with pytest.raises(urllib.error.HTTPError) as failed:
            call("/v1/completions", other)
        error = json.loads(failed.value.read().decode())
        assert "Input/output error" in json.dumps(error)
        monkeypatch.setattr(store, "read_span", original)
        assert call("/v1/completions", body)["choices"][0]["text"] == first  # served on, exactly
        tiers_hold_their_experts(engine)
    finally:
        srv.shutdown()
        worker.stop()


@pytest.fixture
def past_the_hosts_memory(monkeypatch):
    """`load` placing experts as on a GPU with memory of its own (8 GB) whose process holds 1 MB besides the
    experts: `--memory-budget` is then the host's, and 8 MB holds 28 of the bundled model's 64 experts a
    layer beside 16 slots (three tiers)."""
    from od_moe.memory import backend

    monkeypatch.setattr(backend, "device_memory", lambda: (8 * 10**9, 8 * 10**9))
    monkeypatch.setattr(backend, "resident_bytes", lambda: 10**6)


def test_a_predictor_given_to_load_orders_the_host_tiers_eviction(past_the_hosts_memory, bundled_reference):
    """A predictor given to `load` past the host's memory, no prefetch policy asked: three tiers (not the
    per-layer path), the host tier evicting by its next-use head, which its report found reading fewer
    experts than recency; the mode line says so, the tokens are stock's. Asking for predictive prefetch
    still takes the per-layer path; two tiers asked for take the predictor alone the same way."""
    from od_moe.storage.model_files import DEFAULT_PREDICTOR

    engine = od_moe.load(memory_budget="8MB", capacity=16, predictor=DEFAULT_PREDICTOR)
    stats = engine.stats()
    assert engine.mode is TwoTierMode.ON and stats["tiers"]["experts_per_layer"]["disk"] > 0
    assert stats["tiers"]["host_eviction"] == "next-use" and engine.policy_name == "none"
    assert "evicts by the predictor's next-use head (its report: 7.4 experts" in engine.mode_reason
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]
    engine.close()
    asked = od_moe.load(memory_budget="8MB", capacity=16, predictor=DEFAULT_PREDICTOR, prefetch="predictor")
    assert asked.mode is TwoTierMode.OFF and asked.policy_name == "predictor"
    asked.close()
    # two tiers asked for (`--two-tier on`) run the same three tiers; with every expert in host memory a
    # predictor alone is predictive prefetch, which two tiers refuse
    forced = od_moe.load(memory_budget="8MB", capacity=16, predictor=DEFAULT_PREDICTOR, two_tier=True)
    assert forced.stats()["tiers"]["host_eviction"] == "next-use" and forced.policy_name == "none"
    forced.close()
    with pytest.raises(UserError, match="it takes no predictive prefetch"):
        od_moe.load(memory_budget="8GB", capacity=16, predictor=DEFAULT_PREDICTOR, two_tier=True)


def test_a_predictor_whose_report_finds_its_head_reading_more_leaves_recency(past_the_hosts_memory, tmp_path):
    """Where the predictor's own report has its next-use head reading more experts than recency at the
    resident fraction nearest the tiers', the host tier keeps recency, and the mode line says why."""
    import json
    import shutil

    from od_moe.storage.model_files import DEFAULT_PREDICTOR

    folder = shutil.copytree(DEFAULT_PREDICTOR, tmp_path / "predictor")
    report = json.loads((folder / "report.json").read_text())
    report["eviction"]["0.5"]["next-use"]["reads_per_token"] = 12.0  # recency: 11.2
    (folder / "report.json").write_text(json.dumps(report))
    engine = od_moe.load(memory_budget="8MB", capacity=16, predictor=str(folder))
    assert engine.mode is TwoTierMode.ON and engine.stats()["tiers"]["host_eviction"] == "recency"
    assert (
        "evicts by recency: the predictor's next-use head reads more (its report: 12.0" in engine.mode_reason
    )
    engine.close()
