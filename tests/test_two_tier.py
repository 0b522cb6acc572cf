"""Two-tier mode on the CPU backend: the mapped stack is plain host memory there, so the same code path and
selects run as on CUDA. Exact tokens at every capacity and in other families, admission that moves experts
between passes, the ledger, and no host sync inside a pass."""

import functools
import io

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.cache import make_prompt_cache

import od_moe
from conftest import NEW_TOKENS, PROMPTS, od_moe_tokens, reference_tokens, slots_hold_their_experts
from od_moe.accounting import ledger as stats
from od_moe.errors import UserError
from od_moe.model_surgery import switch_over as switch
from od_moe.runtime import TwoTierMode
from od_moe.two_tier import slot_fill, staged_passes, tally
from od_moe.two_tier import two_tier_runtime as two_tier
from od_moe.two_tier.admission import Admission
from od_moe.two_tier.layer_step import (
    CompiledBlock,
    CompileVerdict,
    Lanes,
    LanesSwitch,
    LayerSteps,
    TwoTierSwitch,
)
from od_moe.two_tier.settings import AdmissionSettings, TwoTierSettings
from tiny_models import FAMILIES, write_hf_per_expert, write_mlx_model


@pytest.mark.parametrize("fraction", [0.125, 0.25, 0.5])
def test_two_tier_matches_mlx_lm(bundled_reference, fraction):
    engine = od_moe.load(capacity=fraction, two_tier=True)
    assert engine.mode.path == "two-tier" and isinstance(engine.runtime, two_tier.TwoTierRuntime)
    assert od_moe_tokens(engine, PROMPTS, NEW_TOKENS) == bundled_reference
    stats = engine.stats()
    total, tokens = stats["total"], stats["positions"]["prefill"] + stats["positions"]["decode"]
    assert (
        total["lookups"] == tokens * stats["moe_layers"] * stats["top_k"] == total["hits"] + total["misses"]
    )
    assert 0 < total["hits"] < total["lookups"]  # both tiers computed
    assert total["bytes_read"] == 0  # nothing read from disk after load
    assert 0 < total["experts_loaded"] and total["resident"] == engine.capacity * stats["moe_layers"]
    slots_hold_their_experts(engine)


def test_stacks_are_read_into_mlx_memory_or_copied_and_checked(bundled_reference, monkeypatch):
    """The experts' bytes go straight into the stacks' own memory (a writable view of MLX's arrays, as
    this CPU gives); where MLX gives no such view they are copied in once and checked, with the same
    tokens."""
    from od_moe.two_tier import mapped

    found = mapped._writable(mx.zeros((3, 2), dtype=mx.uint16, stream=mx.cpu))
    assert found[1] is not None and found[1].flags.writeable  # the view: no copy on this CPU
    engine = od_moe.load(capacity=0.25, two_tier=True)
    direct = [stack[("gate_proj", "weight")] for stack in engine.runtime.stacks]
    monkeypatch.setattr(mapped, "_writable", lambda array: (array, None))
    copied = od_moe.load(capacity=0.25, two_tier=True)
    for a, b in zip(direct, (stack[("gate_proj", "weight")] for stack in copied.runtime.stacks)):
        E = engine.num_experts
        assert mx.array_equal(a[:E], b[:E])
    assert od_moe_tokens(copied, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]


def test_the_stacks_are_made_under_a_memory_limit_raised_for_them(monkeypatch):
    """Where the device has memory of its own, MLX counts the host stacks against its limit once each is
    advised (`backend.map_for_device`); made all at once before that, they are covered by a limit raised
    for their bytes while they are made and read, and after the load the limit is the budget plus what
    the advice holds, as before."""
    from od_moe.memory import backend
    from od_moe.two_tier import mapped

    monkeypatch.setattr(backend, "arrays_in_host_memory", lambda: False)  # as CUDA's arrays
    kept, seen, make = mx.get_memory_limit(), [], mapped._host_stacks
    try:
        mx.set_memory_limit(10**9)
        held = sum(backend._held_in_host.values())
        monkeypatch.setattr(
            mapped, "_host_stacks", lambda layers: (seen.append(mx.get_memory_limit()), make(layers))[1]
        )
        engine = od_moe.load(capacity=0.25, two_tier=True, dtype="model")
        E, C = engine.num_experts, engine.capacity
        host = sum(a.nbytes // (E + C) * E for stack in engine.runtime.stacks for a in stack.values())
        assert seen == [10**9 + held + host]
        assert mx.get_memory_limit() == 10**9 + sum(backend._held_in_host.values())  # the raise taken back
        engine.close()
    finally:
        mx.set_memory_limit(kept)


def test_a_two_tier_load_makes_the_slots_once(monkeypatch):
    """Two tiers hold the slots in their stacks' last rows: the caches made before the stacks make no slot
    rows of their own (made, they held the slots' bytes a second time until the load gave them back: the
    load's peak, past a host budget on the unified memory of a Mac or this CPU)."""
    from od_moe.two_tier import mapped

    seen, make = [], mapped._host_stacks
    monkeypatch.setattr(
        mapped, "_host_stacks", lambda layers: (seen.append(mx.get_active_memory()), make(layers))[1]
    )
    engine = od_moe.load(capacity=0.25, two_tier=True)
    slots = sum(cache.slot_nbytes * cache.capacity for cache in engine.caches)
    assert len(seen) == 1 and seen[0] < slots  # MLX's memory as the stacks are made: no slot rows yet
    engine.close()
    per_layer = od_moe.load(capacity=0.25, two_tier=False)  # the per-layer path's slots are the caches'
    assert all(c.stacked_arrays()["gate_proj.weight"].shape[0] == c.capacity for c in per_layer.caches)
    per_layer.close()


def test_a_load_that_fails_reading_the_stacks_takes_back_what_it_advised(monkeypatch):
    """A read that fails half-way through the stacks (the disk, a file changed) fails the load, and the
    layers already advised for the device are taken back: MLX's limit is not left raised by arrays nobody
    holds (`backend._hold_in_host`)."""
    from od_moe.memory import backend
    from od_moe.storage.store import ExpertStore

    monkeypatch.setattr(backend, "arrays_in_host_memory", lambda: False)  # as CUDA's arrays
    kept, held = mx.get_memory_limit(), dict(backend._held_in_host)
    calls, read = [], ExpertStore.read

    def failing(self, layout, *args, **kwargs):
        calls.append(layout.module_path)
        if len(set(calls)) > 4:  # four layers read whole and advised by then (cast to float32: staged)
            raise OSError(5, "Input/output error")
        return read(self, layout, *args, **kwargs)

    monkeypatch.setattr(ExpertStore, "read", failing)
    try:
        mx.set_memory_limit(10**9)
        with pytest.raises(Exception, match="Input/output error"):
            od_moe.load(capacity=0.25, two_tier=True)
        assert len(set(calls)) > 4
        assert backend._held_in_host == held and mx.get_memory_limit() == 10**9
    finally:
        mx.set_memory_limit(kept)


def test_stacks_read_in_place_hold_what_staging_reads(monkeypatch):
    """Where the disk's bytes are the arrays' (the checkpoint's dtypes, as on CUDA and Metal), every layer's
    experts are read by threads straight into its stack's rows, with no staging; the stacks hold the bits
    a read through staging and a cast gives."""
    from od_moe.memory import cuda
    from od_moe.two_tier import mapped

    staged, read_staged = [], mapped._read_staged
    monkeypatch.setattr(mapped, "_read_staged", lambda *args: (staged.append(args[1]), read_staged(*args)))
    in_place = od_moe.load(capacity=0.25, two_tier=True, dtype="model")
    assert staged == []
    monkeypatch.setattr(mapped, "_in_place", lambda *args: False)
    through = od_moe.load(capacity=0.25, two_tier=True, dtype="model")
    assert len(staged) == len(through.runtime.stacks) > 0
    E = in_place.num_experts
    for a, b in zip(in_place.runtime.stacks, through.runtime.stacks):
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype
            assert np.array_equal(cuda.numpy_view(a[key])[:E], cuda.numpy_view(b[key])[:E]), key


@pytest.mark.parametrize("fraction", [0, 1.0])
def test_every_expert_mapped_or_every_expert_in_slots(bundled_reference, fraction):
    """0%: every lane reads the mapped stack; 100%: every lane a slot."""
    engine = od_moe.load(capacity=fraction, two_tier=True)
    assert engine.capacity == round(64 * fraction)
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]
    total = engine.stats()["total"]
    assert total["hit_rate"] == fraction and total["experts_loaded"] == 0
    assert engine.runtime._full.all() == (fraction == 1.0)
    # every expert in a slot, in expert order: mlx-lm's switch over the slot rows alone, with no table
    direct, E = engine.runtime._direct, engine.num_experts
    assert [d is not None for d in direct] == [fraction == 1.0] * len(direct)
    for d, stack in zip(direct if fraction == 1.0 else [], engine.runtime.stacks):
        for view, rows in zip(d, stack.values()):
            assert view.shape[0] == E and mx.array_equal(view, rows[E:])


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "nemotron_h"])
def test_other_families_match_mlx_lm(tmp_path, name):
    """Mixtral's block_sparse_moe, DeepSeek-V3's shared experts and grouped routing, Nemotron-H's
    SwitchMLP: stock tokens at 25% and 50%."""
    path = write_mlx_model(tmp_path / name, FAMILIES[name])
    prompts = [[1, 17, 300, 42, 9, 88], [5, 600, 23, 23, 7]]
    reference = reference_tokens(path, prompts, 12)
    for fraction in (0.25, 0.5):
        engine = od_moe.load(str(path), capacity=fraction, two_tier=True)
        assert od_moe_tokens(engine, prompts, 12) == reference, (name, fraction)
        assert 0 < engine.stats()["total"]["hit_rate"] < 1


def test_experts_not_quantized_match_mlx_lm(tmp_path):
    """Experts kept in floating point take mlx-lm's `gather_mm` (not `gather_qmm`), traced with their batch
    indices given as the quantized ones are (`switch.switch_on`'s rows_given): stock tokens at 25%."""
    path = write_mlx_model(tmp_path / "float", FAMILIES["qwen3_moe"], quantize=False)
    prompts = [[1, 17, 300, 42, 9, 88], [5, 600, 23, 23, 7]]
    engine = od_moe.load(str(path), capacity=0.25, two_tier=True)
    assert od_moe_tokens(engine, prompts, 12) == reference_tokens(path, prompts, 12)
    assert any(layer.mlp._compiled for layer in engine.model.model.layers)


def test_hugging_face_per_expert_checkpoint(tmp_path):
    """The stack is read through the store: per-expert tensors in several shards work as stacked ones."""
    path = write_hf_per_expert(tmp_path / "olmoe", FAMILIES["olmoe"], shards=2)
    prompts = [[1, 17, 300, 42, 9, 88]]
    engine = od_moe.load(str(path), capacity=0.25, two_tier=True)
    assert engine.caches[0].layout.layout == "hf"
    assert od_moe_tokens(engine, prompts, 12) == reference_tokens(path, prompts, 12)


def test_admission_moves_experts_and_stays_exact(bundled_reference, tmp_path):
    engine = od_moe.load(capacity=0.25, two_tier=True)
    assert all(c.resident_count == 0 for c in engine.caches)  # nothing known before the first prompt
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]
    first = [c.expert_in_slot.copy() for c in engine.caches]
    assert all((f >= 0).all() for f in first)  # the prompt's routing filled every slot
    assert od_moe_tokens(engine, PROMPTS[1:], NEW_TOKENS) == bundled_reference[1:]
    moved = sum(len(set(f) - set(c.expert_in_slot)) for f, c in zip(first, engine.caches))
    assert moved > 0
    slots_hold_their_experts(engine)
    # frozen slots (a warm-up's, admission off) compute the same tokens, and hit less than admission did on
    # the same prompts
    engine.reset_stats()
    od_moe_tokens(engine, PROMPTS, NEW_TOKENS)
    learned = engine.stats()["total"]["decode"]["hit_rate"]
    warm = od_moe.load(capacity=0.25, two_tier=True)
    od_moe_tokens(warm, PROMPTS[:1], 8)
    warm.save_snapshot(tmp_path / "warm")
    off = TwoTierSettings(admission=AdmissionSettings(enabled=False))
    frozen = od_moe.load(capacity=0.25, two_tier=True, snapshot=tmp_path / "warm", path_settings=off)
    held = [c.expert_in_slot.copy() for c in frozen.caches]
    assert all(np.array_equal(h, c.expert_in_slot) for h, c in zip(held, warm.caches))
    assert od_moe_tokens(frozen, PROMPTS, NEW_TOKENS) == bundled_reference
    assert all(np.array_equal(h, c.expert_in_slot) for h, c in zip(held, frozen.caches))
    assert frozen.stats()["total"]["decode"]["hit_rate"] < learned


def test_swaps_need_a_margin_and_fill_free_slots_first():
    admission = Admission(1, 8, AdmissionSettings(half_life=1e9, margin=2.0, max_swaps=1))
    admission.add(np.array([[5, 0, 4, 9, 1, 0, 3, 0]]))
    ids, slots = admission.swaps(0, np.array([1, -1, 5]))  # experts 1 and 5 resident, slot 1 free
    assert ids.tolist() == [3, 0] and slots.tolist() == [1, 0]  # the best into the free slot; 0 over 1
    admission.add(
        np.array([[0, 2, 0, 0, 0, 0, 0, 0]])
    )  # expert 1 now has 2 uses: 0 (5) does not beat it by 2
    ids, slots = admission.swaps(0, np.array([1, 3, 5]))
    assert ids.tolist() == [0] and slots.tolist() == [2]  # only over expert 5 (0 uses)
    ids, _ = admission.swaps(0, np.array([0, 3, 2]))
    assert ids.size == 0


def test_a_pass_never_waits_for_the_device(monkeypatch):
    """A decode pass evaluates or synchronizes only where it fills slots (once per admission, before its
    first layer), launches no evaluation of its counts (its token's computes them), and the host reads
    only counts of passes at least `LAG` passes back (done, in mlx-lm's pipelined loop); the stacks are
    written in place; tokens stay exact."""
    every_4 = TwoTierSettings(admission=AdmissionSettings(every=4))
    engine = od_moe.load(capacity=0.25, two_tier=True, path_settings=every_4)
    list(engine.stream_generate(PROMPTS[0], max_tokens=16))  # slots filled, admission running
    runtime = engine.runtime
    calls, ages, fills, launches = [], [], [], []
    fill = runtime._fill
    monkeypatch.setattr(runtime, "_fill", lambda *a: (fills.append(runtime.clock), fill(*a)))

    class CountingMx:
        def __init__(self, launched: list | None = None):
            self.launched = launched

        def __getattr__(self, name):
            if name in ("eval", "synchronize"):
                calls.append((name, runtime.clock))
            if name == "async_eval" and self.launched is not None:
                self.launched.append(runtime.clock)
            return getattr(mx, name)

    class CountingNp:
        def __getattr__(self, name):
            return getattr(np, name)

        def array(self, value, *args, **kwargs):
            if isinstance(value, mx.array):
                clock = next(c for c, *arrays in runtime.tally._launched if any(a is value for a in arrays))
                ages.append(runtime.clock - clock)
            return np.array(value, *args, **kwargs)

    monkeypatch.setattr(two_tier, "mx", CountingMx())
    monkeypatch.setattr(slot_fill, "mx", CountingMx())  # fills after a wait (`write_after_wait`)
    monkeypatch.setattr(tally, "mx", CountingMx(launches))
    monkeypatch.setattr(tally, "np", CountingNp())
    tokens = engine.tokenizer.encode(PROMPTS[1])
    cache = make_prompt_cache(engine.model)
    logits = engine.model(mx.array(tokens)[None], cache=cache)
    prompt_clock = runtime.clock
    mx.eval(logits)
    y = mx.argmax(logits[:, -1], axis=-1)
    out = []
    for step in range(24):  # mlx-lm's pattern: the next pass is built while the last one computes
        logits = engine.model(y[None], cache=cache)
        following = mx.argmax(logits[:, -1], axis=-1)
        mx.async_eval(following)
        out.append(y.item())
        y = following
        if step == 0:  # the first decode pass read the prompt's counts (the prompt was waited for)
            del ages[:]
    assert 1 <= len(fills) <= 24 // 4 + 1
    assert {clock for _, clock in calls} <= set(fills)
    # a decode pass's counts are computed with its token (`DeviceTally.tie`): the prompt's alone are
    # evaluated on their own, when the first decode pass starts
    assert launches == [prompt_clock]
    # each fill waits (once per layer it writes, so that no kernel holds the stack it writes), none else
    assert {clock for name, clock in calls if name == "synchronize"} == set(fills)
    assert runtime.stack_moves == 0
    assert len(ages) >= 2 and min(ages) >= two_tier.LAG
    assert out == reference_tokens(od_moe.DEFAULT_MODEL, PROMPTS[1:2], 25)[0][:24]
    assert engine.stats()["total"]["hits"] > 0


def test_each_moe_block_of_a_decode_pass_is_one_compiled_call(bundled_reference, monkeypatch):
    """A decode pass of one position runs each MoE block as one compiled call: traced once per lanes' kind,
    then replayed with none of the block's Python (no switch call), with stock's tokens and the same hits as
    the blocks run operation by operation. A block that cannot be traced (it waits for an array) runs as it
    is."""
    engine = od_moe.load(capacity=0.25, two_tier=True)
    layers = engine.model.model.layers
    assert all(isinstance(layer.mlp, CompiledBlock) for layer in layers)
    calls, entered, traced = [], TwoTierSwitch.__call__, LanesSwitch.__call__

    def counted(call, kind):
        return lambda self, x, indices: (calls.append((x.size == x.shape[-1], kind)), call(self, x, indices))[
            1
        ]

    monkeypatch.setattr(TwoTierSwitch, "__call__", counted(entered, "switch"))
    monkeypatch.setattr(LanesSwitch, "__call__", counted(traced, "traced"))
    assert od_moe_tokens(engine, PROMPTS, NEW_TOKENS) == bundled_reference
    decode_passes = engine.stats()["positions"]["decode"]
    in_decode = [kind for one, kind in calls if one]
    # a layer's switch is called by its exactness check (traced, then op by op) and by each lanes' trace
    assert set(in_decode) == {"traced"}
    assert 0 < len(in_decode) <= 4 * len(layers) < decode_passes * len(layers) // 4
    hits = engine.stats()["total"]["decode"]["hits"]

    class Waits(nn.Module):  # a block whose code reads an array on the host
        def __init__(self, block):
            super().__init__()
            self.block = block

        def __call__(self, x):
            float(x.sum())
            return self.block(x)

    eager = od_moe.load(capacity=0.25, two_tier=True)
    for layer in eager.model.model.layers:
        monkeypatch.setattr(layer.mlp, "inner", Waits(layer.mlp.inner))
    assert od_moe_tokens(eager, PROMPTS, NEW_TOKENS) == bundled_reference
    assert not any(layer.mlp.traceable for layer in eager.model.model.layers)
    assert eager.stats()["total"]["decode"]["hits"] == hits > 0


def _operations(*outputs) -> str:
    """The primitives of the graph that computes `outputs`, as MLX writes it (`export_to_dot`)."""
    text = io.StringIO()
    mx.export_to_dot(text, *outputs)
    return text.getvalue()


def test_a_compiled_pass_makes_no_batch_indices_of_its_own(bundled_reference):
    """Traced, the switch's products get their batch indices as constants of the compiled call
    (`switch.switch_on`'s rows_given), where MLX's default is an `arange` operation per product at every pass
    (a kernel each on the GPU); the tokens stay stock's."""
    engine = od_moe.load(capacity=0.25, two_tier=True)
    assert od_moe_tokens(engine, PROMPTS, NEW_TOKENS) == bundled_reference
    block, runtime = engine.model.model.layers[1].mlp, engine.runtime
    x = engine.model.model.embed_tokens(mx.array([[1]]))  # a decode pass's input, in the model's dtype
    lanes = runtime._lanes(1, positions=1)  # as the last pass, a decoded token's, found them
    graph = _operations(block._compiled[lanes.key](x, lanes.inputs)[0])
    assert "GatherQMM" in graph and "Arange" not in graph


def test_batch_indices_given_gives_what_mlx_makes():
    """The products of mlx-lm's projections copied with `rows_given` (`switch.switch_on`), given
    `batch_rows` for indices, equal mlx-lm's own, compiled or not, with no operation to make the indices
    (`arange`) nor to broadcast them to the lanes' shape (which CUDA copies); a sorted call is left to
    mlx-lm; the projections copied from, and mlx's functions, are untouched."""
    from mlx_lm.models.switch_layers import SwitchGLU

    qmm, mm = mx.gather_qmm, mx.gather_mm
    glu = SwitchGLU(128, 64, 4, bias=True)
    glu.update(tree_map(lambda a: mx.random.normal(a.shape, key=mx.random.key(a.size)), glu.parameters()))
    quantized = SwitchGLU(128, 64, 4)
    nn.quantize(quantized, group_size=64, bits=4)
    x = mx.random.normal((2, 1, 128), key=mx.random.key(1))
    ids = mx.array([[[3, 1]], [[0, 2]]], mx.uint32)
    assert switch.batch_rows((2, 1, 1), (2, 1, 2)).tolist() == [[[0, 0]], [[1, 1]]]
    for original in (glu, quantized):
        mx.eval(original.parameters(), x)
        keys = [(p, n) for p in ("gate_proj", "up_proj", "down_proj") for n, _ in tree_flatten(original[p])]
        arrays = {key: original[key[0]][key[1]] for key in keys}
        classes = [type(original[p]) for p, _ in keys]
        given = switch.switch_on(original, arrays, rows_given=True)
        own = original(x, ids)
        assert mx.array_equal(given(x, ids), own) and mx.array_equal(mx.compile(given)(x, ids), own)
        assert "Arange" in _operations(mx.compile(original)(x + x, ids))
        graph = _operations(mx.compile(given)(x + x, ids))
        assert "Arange" not in graph and "Broadcast" not in graph
        many = mx.random.randint(0, 4, (40, 1, 2), key=mx.random.key(2)).astype(mx.uint32)  # sorted: 80 lanes
        xs = mx.random.normal((40, 1, 128), key=mx.random.key(3))
        assert mx.array_equal(given(xs, many), original(xs, many))
        assert "Arange" in _operations(given(xs, many))
        assert [type(original[p]) for p, _ in keys] == classes
    assert (mx.gather_qmm, mx.gather_mm) == (qmm, mm)


def test_blocks_that_compile_otherwise_run_op_by_op(bundled_reference, monkeypatch):
    """A block is compiled whole only where that gives the bits it gives op by op (on this CPU it does;
    Qwen3-Next's did not on CUDA): asked of each block until one says no. Where one does not, every block
    runs op by op, its switch compiled, with stock's tokens and the hits of the compiled blocks."""
    engine = od_moe.load(capacity=0.25, two_tier=True)
    assert od_moe_tokens(engine, PROMPTS, NEW_TOKENS) == bundled_reference
    blocks = [layer.mlp for layer in engine.model.model.layers]
    assert all(b.verdict is blocks[0].verdict for b in blocks) and blocks[0].verdict.exact is True
    assert all(b._compiled for b in blocks)
    hits = engine.stats()["total"]["decode"]["hits"]

    asked = []
    monkeypatch.setattr(CompiledBlock, "compiles_exactly", lambda self, x: asked.append(self.layer) or False)
    otherwise = od_moe.load(capacity=0.25, two_tier=True)
    assert od_moe_tokens(otherwise, PROMPTS, NEW_TOKENS) == bundled_reference
    assert asked == [0] and not any(layer.mlp._compiled for layer in otherwise.model.model.layers)
    assert all(otherwise.runtime.steps[i]._compiled for i in range(len(blocks)))  # the switches are
    assert otherwise.stats()["total"]["decode"]["hits"] == hits > 0
    # the same where the settings ask for blocks op by op: no block asked, none compiled
    eager = od_moe.load(capacity=0.25, two_tier=True, path_settings=TwoTierSettings(compile_blocks=False))
    assert od_moe_tokens(eager, PROMPTS, NEW_TOKENS) == bundled_reference
    assert asked == [0] and not any(layer.mlp._compiled for layer in eager.model.model.layers)
    assert all(eager.runtime.steps[i]._compiled for i in range(len(blocks)))
    assert eager.stats()["total"]["decode"]["hits"] == hits


class _TracedOtherwise(nn.Module):
    """A MoE block whose compiled trace adds 1 to its output and whose op-by-op run does not: a block that
    compiles inexactly, as Qwen3-Next's did on CUDA."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __call__(self, x):
        y = self.inner(x)
        try:
            mx.eval(x)
        except ValueError:  # MLX refuses to evaluate while it traces
            return y + 1
        return y


def test_each_block_is_asked_and_one_that_compiles_otherwise_never_runs_compiled(
    bundled_reference, monkeypatch
):
    """Every block answers `compiles_exactly` on its own first pass of one position, not the first for all:
    a last layer whose compiled trace differs from its op-by-op run is asked, never runs compiled, and the
    tokens stay stock's (asked of the first block alone, its verdict compiled the last one, adding 1)."""
    asked, check = [], CompiledBlock.compiles_exactly
    monkeypatch.setattr(
        CompiledBlock, "compiles_exactly", lambda self, x: asked.append(self.layer) or check(self, x)
    )
    engine = od_moe.load(capacity=0.25, two_tier=True)
    blocks = [layer.mlp for layer in engine.model.model.layers]
    last = blocks[-1]
    monkeypatch.setattr(last, "inner", _TracedOtherwise(last.inner))
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]
    assert asked == list(range(len(blocks))) and last.verdict.exact is False and not last._compiled


class _Weights(nn.Module):
    def __init__(self, rows: mx.array):
        super().__init__()
        self.weight = rows


class _RowsSwitch(nn.Module):
    """A switch whose output is each lane's row (plus its input), noting in `seen` the rows it was given."""

    def __init__(self, rows: mx.array, seen: list):
        super().__init__()
        self.p = _Weights(rows)
        object.__setattr__(self, "seen", seen)

    def __call__(self, x, indices):
        self.seen.append(self.p.weight)
        return self.p.weight[indices] + x


def test_compiles_exactly_compares_the_bits():
    """The check itself: a block whose compiled trace differs from its op-by-op run is caught; the block's
    own switch is left where it was (the check computes on a copy)."""
    rows = mx.random.normal((4, 8))
    steps = LayerSteps(_RowsSwitch(rows, []), [("p", "weight")])

    class Counts(nn.Module):  # each call adds its count: a trace freezes the count it saw
        calls = 0

        def __init__(self):
            super().__init__()
            self.switch_mlp = TwoTierSwitch(None, None, 0)

        def __call__(self, x):
            Counts.calls += 1
            return self.switch_mlp(x, mx.array([[3]], mx.uint32)) * 2 + Counts.calls

    class Pure(Counts):
        def __call__(self, x):
            y = self.switch_mlp(x, mx.array([[3]], mx.uint32))
            return mx.sigmoid(y) * y + y

    x = mx.random.normal((1, 1, 8))
    for inner, exact in ((Counts(), False), (Pure(), True)):
        switch = inner.switch_mlp
        block = CompiledBlock(inner, None, 0, steps, (rows,), CompileVerdict())
        assert block.compiles_exactly(x) is exact and inner.switch_mlp is switch


@pytest.mark.parametrize("stage_positions", [1, 10**9])
def test_staged_passes_match_mlx_lm(bundled_reference, stage_positions):
    """Every layer pass staged (decode's too) or none: stock's tokens. A staged pass books its distinct
    experts and those in device rows from the device; with one sequence a decode pass's 8 lanes are 8
    distinct experts, so those counts equal the lanes' lookups and hits."""
    staged = TwoTierSettings(stage_positions=stage_positions)
    engine = od_moe.load(capacity=0.25, two_tier=True, path_settings=staged)
    assert od_moe_tokens(engine, PROMPTS, NEW_TOKENS) == bundled_reference
    led, layers = engine.runtime.ledger, engine.stats()["moe_layers"]
    prefill, decode = stats.per_pass(led, "prefill"), stats.per_pass(led, "decode")
    if stage_positions > 1:
        assert prefill["routings_read"] == decode["routings_read"] == 0
        return
    assert prefill["routings_read"] == prefill["passes"] * layers
    assert decode["routings_read"] == decode["passes"] * layers
    assert 8 < prefill["experts_per_layer_pass"] < prefill["lookups_per_layer_pass"]
    assert decode["experts"] == led.total("lookups", "decode")
    assert decode["expert_hits"] == led.total("hits", "decode") > 0
    assert led.total("staged_misses") == led.total("lookups") - led.total("hits")  # every lane was staged
    slots_hold_their_experts(engine)


def test_with_no_slots_large_experts_are_staged_at_every_pass(monkeypatch, bundled_reference):
    """Experts of `STAGE_DECODE_NBYTES` or more, no expert in a device row: decode passes are staged too
    (each lane's expert copied to the device, then computed there), with stock's tokens, and `inspect`
    says so; with slots, or with small experts, a decode pass is read in place."""
    from od_moe import preflight
    from od_moe.memory import backend

    assert od_moe.load(capacity=0, two_tier=True).runtime.stage_positions == staged_passes.STAGE_POSITIONS
    # the bundled model's 20 KB experts count large
    monkeypatch.setattr(staged_passes, "STAGE_DECODE_NBYTES", 1)
    assert od_moe.load(capacity=0.25, two_tier=True).runtime.stage_positions == staged_passes.STAGE_POSITIONS
    engine = od_moe.load(capacity=0, two_tier=True)
    assert engine.runtime.stage_positions == 1
    assert od_moe_tokens(engine, PROMPTS, NEW_TOKENS) == bundled_reference
    decode = stats.per_pass(engine.runtime.ledger, "decode")
    assert decode["routings_read"] == decode["passes"] * engine.stats()["moe_layers"] > 0  # every one staged
    assert engine.stats()["total"]["decode"]["hits"] == 0
    monkeypatch.setattr(
        backend, "two_tier_choice", lambda asked, nbytes, host=None: (asked is not False, "on")
    )
    assert "each pass copies its experts" in preflight.inspect_model(capacity=0)["two_tier"]["reason"]


def test_a_staged_copy_holds_each_routed_expert_once_in_expert_order():
    """`staged_passes.union`'s copy: min(E, lanes) rows, the routed experts' rows (from their slot where the
    table says so) in expert order, the rest copies of the device row; each lane reads its expert's row;
    the counts are the union's; the switch keeps no copy after the call. One position's pass (compiled):
    lane i's expert in row i, and which lanes were hits."""
    E, C = 8, 2
    rows = mx.arange((E + C) * 3, dtype=mx.float32).reshape(E + C, 3)
    table = mx.array([0, 1, E + 1, 3, 4, 5, E, 7], dtype=mx.uint32)  # experts 2 and 6 in slots
    host, seen = np.array(rows), []
    steps = LayerSteps(_RowsSwitch(rows, seen), [("p", "weight")])
    indices = mx.array([[6, 1], [1, 3], [6, 6]], dtype=mx.uint32)  # 3 positions, top-2: 6 lanes
    x = mx.zeros((1,))
    copies, places, outputs = staged_passes.union(indices, table, rows)
    y = steps.compute(copies, x, places)
    copy = np.array(seen[0])
    assert copy.shape == (6, 3)  # min(E, lanes)
    assert np.array_equal(copy[:3], host[[1, 3, E]])  # experts 1, 3, 6 (6 from its slot)
    assert np.array_equal(copy[3:], host[[E] * 3])  # the device row
    assert np.array_equal(np.array(y), host[np.array(table)[np.array(indices)]])  # each lane its expert's
    assert np.array(outputs["staged"]).tolist() == [3, 1, 1, 3]  # lanes of 1, 3, 1: in no device row
    assert steps.switch["p"]["weight"] is None  # the copy is not kept alive by the switch
    # one position (a decode pass): lane i's expert in row i, no union to find
    read = functools.partial(staged_passes.one_position, False, True)
    lanes = Lanes(("staged",), read, (table, rows))
    for _ in range(2):  # traced, then replayed
        y, outputs = steps.on_lanes(lanes, x, indices[:1, None])
        assert np.array_equal(np.array(y), host[[[[E, 1]]]])  # 6 from its slot, then 1
        assert np.array(outputs["staged"]).tolist() == [2, 1, 1, 1]
        assert np.array(outputs["hit"]).tolist() == [[[True, False]]]
    assert len(seen) == 2 and steps.switch["p"]["weight"] is None  # traced once


def test_admission_decays_by_every_pass_once(monkeypatch):
    """The tally's reads give admission the passes they cover (its counts decay by them): through a batch
    whose passes are staged while two sequences decode and not once one is left, they add up to the
    passes run."""
    every_8 = TwoTierSettings(admission=AdmissionSettings(every=8))  # a read every 8 passes (`ADMIT_PASSES`)
    engine = od_moe.load(capacity=0.25, two_tier=True, path_settings=every_8)
    runtime, covered = engine.runtime, []
    add = runtime.admission.add
    monkeypatch.setattr(
        runtime.admission, "add", lambda counts, passes: (covered.append(passes), add(counts, passes))
    )
    engine.batch_generate(PROMPTS[:2], max_tokens=[6, 40])
    runtime.settle()
    decode = stats.per_pass(runtime.ledger, "decode")
    assert 0 < decode["routings_read"] < decode["passes"] * engine.stats()["moe_layers"]  # some staged
    assert len(covered) > 2 and sum(covered) == runtime.clock


def test_a_long_prompt_is_staged_and_exact():
    """A prompt is staged by default, at 0% (no slot: one device row is there to
    stand in for experts not routed) and 25% (its slots found in device rows), and gives stock's tokens."""
    prompt = "\n".join(f"def f{i}(x):\n    return x * {i} + {i % 7}" for i in range(12))
    reference = reference_tokens(od_moe.DEFAULT_MODEL, [prompt], 16)
    for fraction in (0, 0.25):
        engine = od_moe.load(capacity=fraction, two_tier=True)
        assert od_moe_tokens(engine, [prompt], 16) == reference, fraction
        engine.reset_stats()  # the second time, the slots hold what the first admitted
        assert od_moe_tokens(engine, [prompt], 16) == reference, fraction
        prefill = stats.per_pass(engine.runtime.ledger, "prefill")
        assert prefill["routings_read"] == prefill["passes"] * engine.stats()["moe_layers"] > 0
        assert prefill["experts_per_layer_pass"] <= 64 < prefill["lookups_per_layer_pass"]
        assert (prefill["expert_hits"] > 0) == (fraction > 0)


def test_auto_keeps_the_slots_of_large_experts_on_the_device(monkeypatch, bundled_reference):
    """Where "auto" turns two-tier mode on (CUDA, the host holds the experts), experts of 1 MB or more get
    slots kept by the device (`lru`) where some but not all have slots, smaller ones slots admitted by
    counts; predictive prefetch still keeps the per-layer path; `od-moe inspect` says which."""
    from od_moe import assembly, preflight
    from od_moe.memory import backend

    monkeypatch.setattr(
        backend, "two_tier_choice", lambda asked, nbytes, host=None: (asked is not False, "on")
    )
    mode, tiers = assembly.two_tier_mode, assembly.auto_tiers
    ON, OFF, LRU = TwoTierMode.ON, TwoTierMode.OFF, TwoTierMode.LRU
    assert mode("auto", 1 << 30, "load", None, None)[0] is ON
    assert mode("auto", 1 << 30, "load", "next-gate", None)[0] is OFF
    assert mode("lru", 1 << 30, "load", None, None)[0] is LRU
    assert tiers("auto", ON, "on", 2_650_000, 0.25)[0] is LRU
    assert "least recently used" in tiers("auto", ON, "on", 2_650_000, 0.25)[1]
    assert tiers("auto", ON, "on", 2_650_000, 0.5)[0] is LRU
    assert tiers("auto", ON, "on", 2_650_000, 0.0)[0] is ON  # no slots: every miss read in place
    assert tiers("auto", ON, "on", 2_650_000, 1.0)[0] is ON  # every expert in a slot
    assert tiers(True, ON, "on", 2_650_000, 0.25)[0] is ON  # forced on: slots admitted by counts
    assert tiers("auto", ON, "on", 20_000, 0.25)[0] is ON
    assert tiers("auto", OFF, "off", 2_650_000, 0.25)[0] is OFF
    assert [m.argument for m in (OFF, ON, LRU)] == [False, True, "lru"]  # as `load` takes them
    report = preflight.inspect_model(capacity=0.25)["two_tier"]  # the bundled model: 20 KB experts
    assert report["auto"] is True and report["slots"] == "admitted by routing counts"
    monkeypatch.setattr(assembly, "LRU_EXPERT_NBYTES", 1)
    report = preflight.inspect_model(capacity=0.25)["two_tier"]
    assert (
        report["slots"] == "device-kept (least recently used)" and "least recently used" in report["reason"]
    )
    assert preflight.inspect_model(capacity=1.0)["two_tier"]["slots"] == "admitted by routing counts"
    empty = preflight.inspect_model(capacity=0)  # no slots, as `load` takes in two-tier mode
    assert empty["capacity"]["capacity"] == 0 and empty["two_tier"]["slots"] == "admitted by routing counts"
    engine = od_moe.load(capacity=0.25)  # "auto", as `od-moe serve` loads
    assert engine.mode.path == "two-tier" and engine.runtime.device_lru
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]


def test_modes_are_chosen_and_said():
    assert od_moe.load(capacity=0.25).mode.path == "per-layer"  # auto: the CPU's memory is host memory
    assert "not a CUDA device" in od_moe.load(capacity=0.25).mode_reason
    with pytest.raises(UserError, match="no predictive prefetch"):
        od_moe.load(capacity=0.25, two_tier=True, prefetch="next-gate")
    with pytest.raises(UserError, match="two_tier must be"):
        od_moe.load(capacity=0.25, two_tier="yes")
    with pytest.raises(UserError, match="capacity must be between 1"):
        od_moe.load(capacity=0)  # 0 slots only where misses are read in place


def test_recording_gives_the_routing_of_every_pass(bundled_reference):
    engine = od_moe.load(capacity=0.25, two_tier=True)
    trace = engine.record_routing(PROMPTS[0], max_tokens=8)
    per_layer = engine.stats()["layers"][0]
    assert len(trace) >= 8 and all(set(p) == set(range(len(engine.caches))) for p in trace)
    assert sum(p[0].size for p in trace) == per_layer["lookups"]
    assert all(p[0].shape[1] == engine.top_k for p in trace)


def test_a_cast_numpy_cannot_make_stays_exact():
    """bfloat16 scales cast to float16 (no numpy path): the stack is cast with MLX, tokens equal stock's."""
    reference = reference_tokens(od_moe.DEFAULT_MODEL, PROMPTS[:1], 12, dtype="float16")
    engine = od_moe.load(capacity=0.25, two_tier=True, dtype="float16")
    assert engine.runtime.stacks[0][("gate_proj", "scales")].dtype == mx.float16
    assert od_moe_tokens(engine, PROMPTS[:1], 12) == reference


@pytest.mark.parametrize("weights", [False, True])
def test_snapshot_round_trip(tmp_path, bundled_reference, weights):
    """A snapshot saved in two-tier mode puts the same experts in the same slots (the slot rows of the
    stacks), pinned as they were, from the mapped stack; tokens stay exact."""
    engine = od_moe.load(capacity=0.25, two_tier=True)
    od_moe_tokens(engine, PROMPTS[:1], 12)
    engine.caches[1].pin(engine.caches[1].resident_ids()[:2])
    engine.save_snapshot(tmp_path / "snap", weights=weights)
    warm = od_moe.load(capacity=0.25, two_tier=True, snapshot=tmp_path / "snap")
    for a, b in zip(engine.caches, warm.caches):
        assert np.array_equal(a.expert_in_slot, b.expert_in_slot) and np.array_equal(a.pinned, b.pinned)
    slots_hold_their_experts(warm)
    assert od_moe_tokens(warm, PROMPTS[1:2], NEW_TOKENS) == bundled_reference[1:2]


def test_a_stack_copied_instead_of_written_in_place_is_found():
    """While something else holds a stack (as a pass in flight would), MLX copies it to write a slot: the
    runtime notices (on CUDA the copy must be advised again) and the slots still hold their experts."""
    engine = od_moe.load(capacity=0.25, two_tier=True)
    runtime = engine.runtime
    held = runtime.stacks[0][("gate_proj", "weight")][:]  # shares the stack's memory
    mx.eval(held)
    runtime.load(engine.caches[0], [3, 5])
    assert runtime.stack_moves == 1
    del held
    runtime.load(engine.caches[1], [3, 5])
    assert runtime.stack_moves == 1
    slots_hold_their_experts(engine)


def test_fills_as_kernels_are_booked_and_ordered_before_the_pass_that_reads_them(
    bundled_reference, monkeypatch
):
    """The CUDA route (`two_tier/slot_fill.py`) copies in kernels and makes the tables depend on them. Here a
    stand-in copies with MLX and records what it was asked: every admission's fills go that way, after the
    last pass's last MoE output, and tokens stay exact."""
    asked = []

    def fill(self, stack, moves, count, after):  # the kernels' copies as MLX writes (no CUDA here)
        asked.append((count, after.shape))
        sources, rows = mx.array(np.array(moves)[: 2 * count].reshape(count, 2).T)
        for array in stack.values():
            array[rows] = array[sources]
        return mx.array(count, dtype=mx.uint32)

    monkeypatch.setattr(slot_fill.KernelFills, "fill", fill)
    by_kernels = TwoTierSettings(admission=AdmissionSettings(every=4, by_kernel=True))
    engine = od_moe.load(capacity=0.25, two_tier=True, path_settings=by_kernels)
    assert od_moe_tokens(engine, PROMPTS, NEW_TOKENS) == bundled_reference
    loaded = engine.stats()["total"]["experts_loaded"]
    assert asked and sum(n for n, _ in asked) == loaded  # every fill went this way
    assert all(shape[-1] == engine.model.args.hidden_size for _, shape in asked)
    slots_hold_their_experts(engine)
