"""A device with memory of its own (CUDA): the slots come from its budget, the card's free memory by
default, beside the non-expert weights and a stated context's working memory; what was chosen and why is
said, a capacity the budget cannot hold is refused with what would fit, and memory is reported as the
driver and the OS count it. The card is simulated here (`backend.device_memory`); the arithmetic is the
one CUDA runs."""

import mlx.core as mx
import mlx_lm
import pytest

import od_moe
from od_moe.cli import main
from od_moe.errors import UserError
from od_moe.memory import backend
from od_moe.memory.capacity import (
    DEVICE_BUDGET_FRACTION,
    DEVICE_LIBRARY_NBYTES,
    Context,
    budget_for,
    working_nbytes,
)

MB = 10**6


@pytest.fixture(scope="module")
def shapes():
    """The embedded model's slot bytes, non-expert bytes and the device context's working memory."""
    engine = od_moe.load(capacity=1)
    layers, experts = len(engine.caches), engine.num_experts
    slot = engine.caches[0].slot_nbytes
    context = Context.for_device(engine.max_positions)
    working = working_nbytes(engine.model, layers, experts, 0, context, engine.kv_nbytes_per_token)
    return dict(
        layers=layers, experts=experts, slot=slot, non_expert=engine.non_expert_nbytes, working=working
    )


def card(monkeypatch, free: int, total: int = 80 * 10**9):
    monkeypatch.setattr(backend, "device_memory", lambda: (free, total))


def test_with_no_capacity_the_card_s_free_memory_picks_the_most_slots_that_fit(monkeypatch, shapes):
    s = shapes
    want = 24  # experts per layer: a card whose free memory holds exactly these beside the rest
    free = (
        int(
            (budget_for(want, s["layers"], s["slot"], s["non_expert"], s["working"]) + DEVICE_LIBRARY_NBYTES)
            / DEVICE_BUDGET_FRACTION
        )
        + 1
    )
    card(monkeypatch, free)
    engine = od_moe.load()
    assert engine.capacity == want
    choice = engine.capacity_choice
    assert choice.startswith(
        f"capacity {want}/{s['experts']} experts per layer (37.5%), the most the device budget"
    )
    assert f"{DEVICE_BUDGET_FRACTION:.0%} of the card's" in choice and "a KV cache of 2,048 tokens" in choice
    assert "bytes" not in choice  # sizes in kB/MB/GB
    assert engine.generate("def add(a, b):", max_tokens=4)  # and it generates
    card(monkeypatch, 10**12)  # a card with room for every expert takes them all
    assert od_moe.load().capacity == s["experts"]


def test_a_context_and_sequences_are_counted_into_the_device_budget(monkeypatch, shapes):
    s = shapes
    card(monkeypatch, 10**12)
    engine = od_moe.load(capacity=1)
    kv = engine.kv_nbytes_per_token
    eight = working_nbytes(
        engine.model, s["layers"], s["experts"], 0, Context.for_device(2048, sequences=8), kv
    )
    # 40 slots beside 8 sequences' KV and the runtime's libraries
    given = budget_for(40, s["layers"], s["slot"], s["non_expert"], eight) + DEVICE_LIBRARY_NBYTES
    many = od_moe.load(device_memory=given, sequences=8)
    one = od_moe.load(device_memory=given)
    assert many.capacity == 40 and one.capacity == s["experts"]  # one sequence leaves room for every expert
    assert "a KV cache of 2,048 tokens for 8 sequences" in many.capacity_choice
    from od_moe.units import format_bytes

    assert f"{format_bytes(given)} (--device-memory)" in many.capacity_choice
    short = working_nbytes(
        engine.model, s["layers"], s["experts"], 0, Context.for_device(2048, 8, tokens=256), kv
    )
    assert short < eight and Context.for_device(2048, 8, tokens=256).chunk == 256


def test_inspect_says_what_the_card_holds_and_an_idle_engine_gives_mlx_s_cache_back(monkeypatch, shapes):
    """MLX's memory limit is the device budget less the runtime's libraries; `inspect` says what the card
    holds at a capacity (the context, the libraries and what those slots' budget buys); a finished request
    gives MLX's cache back."""
    s = shapes
    card(monkeypatch, 10**12)
    limits, released = [], []
    monkeypatch.setattr(backend, "limit_device_memory", limits.append)
    monkeypatch.setattr(backend, "release_cached_memory", lambda: released.append(1))
    engine = od_moe.load(capacity=10, two_tier=False)
    assert limits == [int(10**12 * DEVICE_BUDGET_FRACTION) - DEVICE_LIBRARY_NBYTES]
    engine.generate("def add(a, b):", max_tokens=3)
    assert released == [1]
    from od_moe.preflight import format_inspection, inspect_model

    report = inspect_model(capacity=10)
    device = report["device"]
    assert report["capacity"]["card_bytes"] == device["context_bytes"] + DEVICE_LIBRARY_NBYTES + budget_for(
        10, s["layers"], s["slot"], s["non_expert"], device["context"]["working_bytes"]
    )
    assert device["card_bytes"]["0.125"] < device["card_bytes"]["1"]
    text = format_inspection(report)
    assert "card       12.5%: " in text and "the card holds" in text and "needs      " not in text


def test_a_capacity_the_device_cannot_hold_is_refused_with_what_fits(monkeypatch, shapes, capsys):
    s = shapes
    free = (
        int(
            (budget_for(10, s["layers"], s["slot"], s["non_expert"], s["working"]) + DEVICE_LIBRARY_NBYTES)
            / DEVICE_BUDGET_FRACTION
        )
        + 1
    )
    card(monkeypatch, free)
    assert od_moe.load(capacity=10).capacity == 10
    with pytest.raises(UserError, match="give --capacity 10 or less, or --device-memory"):
        od_moe.load(capacity=11)
    assert main(["generate", "--prompt", "x", "--capacity", "100%"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "64 experts per layer need a device budget of" in err[0]


def test_where_nothing_fits_it_says_what_would(monkeypatch, shapes):
    card(monkeypatch, 5 * MB)
    with pytest.raises(
        UserError, match=r"the device budget 4.50 MB .* is too small for this model: it needs at least"
    ):
        od_moe.load(two_tier=False)


def test_device_memory_is_refused_where_the_device_computes_in_host_memory(capsys):
    assert backend.device_memory() is None  # this CPU
    with pytest.raises(UserError, match="give memory_budget"):
        od_moe.load(device_memory="1GB")
    assert main(["generate", "--prompt", "x", "--device-memory", "1GB"]) == 2
    assert "--memory-budget" in capsys.readouterr().err


def test_memory_is_reported_as_the_driver_and_the_os_count_it(monkeypatch, capsys):
    engine = od_moe.load(capacity=8)
    memory = engine.stats()["memory"]
    assert memory["device_bytes"] is None  # no device of its own here
    assert (
        memory["host_bytes"] > memory["non_expert_bytes"]
        and memory["host_peak_bytes"] >= memory["host_bytes"]
    )
    from od_moe.accounting.report import memory_line

    assert memory_line(memory).startswith("memory: host ")
    shown = memory_line(dict(memory, device_bytes=6_300_000_000))
    assert shown.startswith(
        "memory: device 6.30 GB (the card's use since load, as the driver counts it), host "
    )
    assert "MLX's peak" in shown and "mapped host memory included" in shown


def test_on_cuda_the_memory_budget_is_the_hosts_and_decides_two_tiers(monkeypatch, capsys):
    import mlx.core as mx

    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    on, why = backend.two_tier_choice("auto", 16 * 10**9, host_bytes=8 * 10**9)
    assert not on and "host memory cannot hold the experts" in why and "host memory budget 8.00 GB" in why
    assert backend.two_tier_choice("auto", 4 * 10**9, host_bytes=8 * 10**9)[0]
    monkeypatch.undo()
    # the flags go together (on CUDA); where one budget covers the engine, together they are one line
    assert main(["generate", "--prompt", "x", "--capacity", "8", "--memory-budget", "1GB"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        len(err) == 1
        and "not both (on a GPU with memory of its own the memory budget is the host's" in err[0]
    )


@pytest.mark.parametrize(
    "family", ["qwen3_moe", "deepseek_v2", "deepseek_v3", "qwen3_next", "gpt_oss", "jamba"]
)
def test_the_kv_cache_a_token_takes_is_what_mlx_lms_caches_hold(family, tmp_path):
    """`kv_nbytes_per_token`, measured on a lazy run, is what mlx-lm's caches grow by per token of a
    real (evaluated) prefill: multi-head latent attention, sliding windows and recurrent layers included.
    An engine keeps the figure it measured before changing the model, and does not run a changed one."""
    from mlx.utils import tree_flatten
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load_model

    from od_moe.memory.capacity import kv_nbytes_per_token
    from tiny_models import FAMILIES, write_mlx_model

    path = write_mlx_model(tmp_path / family, FAMILIES[family])
    lazy, _ = load_model(path, lazy=True)
    per_token = kv_nbytes_per_token(lazy)
    model, _ = load_model(path)

    def held(tokens):
        caches = make_prompt_cache(model)
        mx.eval(model(mx.arange(1, tokens + 1)[None], cache=caches))
        return sum(v.nbytes for c in caches for _, v in tree_flatten(c.state) if isinstance(v, mx.array))

    assert per_token > 0 and held(512) - held(256) == per_token * 256  # mlx-lm grows caches 256 at a time
    engine = od_moe.load(str(path), capacity=0.5, dtype="model")
    assert engine.kv_nbytes_per_token == per_token
    with pytest.raises(ValueError, match="pass the KV figure measured before"):
        kv_nbytes_per_token(engine.model)  # never a guess from the projections, silently


def test_a_kv_cache_that_cannot_be_measured_is_said_to_be_a_guess(monkeypatch, capsys):
    from od_moe.memory import capacity

    def fails(model, tokens):
        raise TypeError("this family wants more than token ids")

    lazy, _ = mlx_lm.load(str(od_moe.DEFAULT_MODEL), lazy=True)
    measured = capacity.kv_nbytes_per_token(lazy)
    monkeypatch.setattr(capacity, "_cache_nbytes", fails)
    assert capacity.kv_nbytes_per_token(lazy) == measured  # full attention: the projections' outputs
    err = capsys.readouterr().err
    assert "KV cache could not be measured (TypeError: this family wants" in err and "a guess" in err


def test_working_memory_counts_the_kv_cache_twice_as_mlx_lm_grows_it(shapes):
    """mlx-lm grows a KV cache by copying it into a larger buffer; the old one waits in MLX's cache of freed
    buffers (until mlx-lm clears it, every 256 decoded tokens), so budgets count the context's KV twice."""
    from mlx_lm.models.cache import KVCache

    from od_moe.memory.capacity import activation_nbytes_per_token

    mx.clear_cache()
    cache, k = KVCache(), mx.zeros((1, 4, 256, 64))
    cache.update_and_fetch(k, k)
    mx.eval(cache.keys, cache.values, k)
    before = mx.get_cache_memory()
    one = k[:, :, :1]
    cache.update_and_fetch(one, one)
    mx.eval(cache.keys, cache.values)
    assert (
        cache.keys.shape[2] == 512 and mx.get_cache_memory() - before >= 2 * k.nbytes
    )  # old keys and values
    engine = od_moe.load(capacity=1)
    kv, s = engine.kv_nbytes_per_token, shapes

    def working(tokens):
        return working_nbytes(engine.model, s["layers"], s["experts"], 0, Context(tokens, 1, 1), kv)

    activations = activation_nbytes_per_token(engine.model, 512) - activation_nbytes_per_token(
        engine.model, 256
    )
    assert working(512) - working(256) == 2 * kv * 256 + activations
