"""Expert store reads and the resident cache's invariants."""

import errno
import gc
import os
import shutil

import mlx.core as mx
import numpy as np
import pytest

import od_moe
from conftest import NEW_TOKENS, PROMPTS, od_moe_tokens
from conftest import consistent as _consistent
from od_moe.accounting.ledger import Ledger
from od_moe.accounting.report import format_stats
from od_moe.errors import UserError
from od_moe.memory.capacity import budget_for, parse_capacity, parse_size, resolve_capacity, working_nbytes
from od_moe.per_layer.reader import Reader
from od_moe.storage import store as store_module
from od_moe.storage.layout import ExpertRows, flat_rows
from od_moe.storage.store import ExpertStore


def test_store_reads_exactly_the_expert_rows():
    store = ExpertStore(od_moe.DEFAULT_MODEL)
    parts = {p: ["weight", "scales", "biases"] for p in ("gate_proj", "up_proj", "down_proj")}
    layout = store.block_layout("model.layers.2.mlp.switch_mlp", parts, 64)
    assert layout.layout == "mlx" and len(layout.parts) == 9
    full = mx.load(str(od_moe.DEFAULT_MODEL / "model.safetensors"))
    ids = [5, 6, 7, 40, 63]  # a run of neighbours (one preadv) and stragglers
    raw = store.read(layout, ids, ExpertRows(layout, 8))
    for part in layout.parts:
        expected = full[f"model.layers.2.mlp.switch_mlp.{part.proj}.{part.name}"][mx.array(ids)]
        got = mx.array(raw[(part.proj, part.name)])
        if part.dtype == "BF16":
            got = got.view(mx.bfloat16)
        assert mx.array_equal(got, expected)


def test_reads_cut_short_by_the_os_resume_where_they_stopped(monkeypatch):
    """`preadv` may return fewer bytes than asked (a signal, a network file system): the read goes on
    from where it stopped, across the run's rows, and the bytes are those of an uninterrupted read."""
    store = ExpertStore(od_moe.DEFAULT_MODEL)
    parts = {p: ["weight", "scales", "biases"] for p in ("gate_proj", "up_proj", "down_proj")}
    layout = store.block_layout("model.layers.3.mlp.switch_mlp", parts, 64)
    ids = [7, 8, 9, 31]  # a run of three rows and one alone
    whole = store.read(layout, ids, ExpertRows(layout, 4))
    expected = {key: np.array(rows) for key, rows in whole.items()}
    real, calls = store_module.os.preadv, []

    def short(fd, views, offset):  # at most 1000 bytes per call
        calls.append(offset)
        room, cut = 1000, []
        for view in views:
            cut.append(view[:room])
            room -= len(cut[-1])
            if not room:
                break
        return real(fd, cut, offset)

    monkeypatch.setattr(store_module.os, "preadv", short)
    got = store.read(layout, ids, ExpertRows(layout, 4))
    assert len(calls) > 2 * len(layout.parts)
    for key, rows in expected.items():
        assert np.array_equal(got[key], rows)


def test_staging_holds_each_expert_as_one_row_of_its_parts_back_to_back():
    """What a read leaves in staging is already the flat row a host-to-device copy carries: the same
    bytes `flat_rows` gathers part by part from per-expert rows, with no copy of its own."""
    store = ExpertStore(od_moe.DEFAULT_MODEL)
    parts = {p: ["weight", "scales", "biases"] for p in ("gate_proj", "up_proj", "down_proj")}
    layout = store.block_layout("model.layers.5.mlp.switch_mlp", parts, 64)
    staging = ExpertRows(layout, 8)
    raw = store.read(layout, [12, 13, 2], staging)
    gathered = flat_rows(layout, {k: [np.array(row) for row in v] for k, v in raw.items()}, 3)
    made = flat_rows(layout, raw, 3)
    assert np.shares_memory(made, staging.flat) and np.array_equal(made, gathered)
    one = raw.rows(2, 3)  # a reader's share of a batched read
    assert np.array_equal(flat_rows(layout, one, 1), gathered[2:])


@pytest.mark.parametrize("dtype", ["auto", "model"])
def test_both_install_paths_put_the_checkpoint_rows_in_the_slots(dtype):
    """Numpy writes into host memory (CPU, Metal) and MLX slice updates (CUDA) give the same slots."""
    full = mx.load(str(od_moe.DEFAULT_MODEL / "model.safetensors"))
    ids = np.array([9, 3, 60])
    for host in (True, False):
        engine = od_moe.load(capacity=8, dtype=dtype)
        cache = engine.caches[4]
        cache.use_host_writes(host)
        slots = cache.install(
            ids, engine.runtime.store.read(cache.layout, ids, ExpertRows(cache.layout, 4))
        ).slots
        assert cache.host_writes == host  # the CPU backend takes the numpy path whenever asked
        for part in cache.layout.parts:
            stacked = cache.projections[part.proj][part.name]
            expected = full[f"model.layers.4.mlp.switch_mlp.{part.proj}.{part.name}"][mx.array(ids)]
            assert mx.array_equal(stacked[mx.array(slots)], expected.astype(stacked.dtype)), (host, part.name)


@pytest.mark.parametrize("made", ["all", "some", "one"])
def test_mlx_installs_from_the_readers_flat_arrays(made):
    """The MLX install path (CUDA's) from flat arrays a reader made: all of them (stacked, one scatter per
    part), some (the host bytes are copied instead), or a single expert (slice updates); the slots hold
    the checkpoint's rows, in the cache's dtype, and experts resident before stay intact."""
    full = mx.load(str(od_moe.DEFAULT_MODEL / "model.safetensors"))
    engine = od_moe.load(capacity=8)
    cache = engine.caches[3]
    cache.use_host_writes(False)
    layout, store = cache.layout, engine.runtime.store
    first = np.array([1, 2])
    cache.install(first, store.read(layout, first, ExpertRows(layout, 4)))
    ids = np.array([60]) if made == "one" else np.array([9, 3, 40])
    raw = store.read(layout, ids, ExpertRows(layout, 4))
    arrays = [mx.array(row) for row in flat_rows(layout, raw, len(ids))]
    if made == "some":
        arrays[1] = None
    slots = cache.install(ids, raw, arrays=arrays).slots
    for group, where in ((ids, slots), (first, cache.slot_of[first])):
        for part in layout.parts:
            stacked = cache.projections[part.proj][part.name]
            expected = full[f"model.layers.3.mlp.switch_mlp.{part.proj}.{part.name}"][mx.array(group)]
            assert mx.array_equal(stacked[mx.array(where)], expected.astype(stacked.dtype)), part.name


def test_mlx_installs_are_left_to_the_computation_that_reads_the_slots(monkeypatch):
    """An MLX install starts nothing itself (no `mx.async_eval`, no `mx.eval`): the layer that reads the
    slots evaluates the writes with its own computation, and the bytes land exactly."""
    engine = od_moe.load(capacity=8)
    cache = engine.caches[2]
    cache.use_host_writes(False)
    started = []
    monkeypatch.setattr(mx, "async_eval", lambda *arrays: started.append(arrays))
    monkeypatch.setattr(mx, "eval", lambda *arrays: started.append(arrays))
    layout, store = cache.layout, engine.runtime.store
    for ids in (np.array([5, 7]), np.array([11]), np.array([20, 21])):
        cache.install(ids, store.read(layout, ids, ExpertRows(layout, 4)))
    assert started == []
    monkeypatch.undo()
    assert set(cache.resident_ids().tolist()) >= {5, 7, 11, 20, 21}


def test_truncated_file_is_a_clear_error(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(od_moe.DEFAULT_MODEL, model)
    data = model / "model.safetensors"
    data.chmod(0o644)
    with open(data, "r+b") as f:
        f.truncate(data.stat().st_size // 2)
    with pytest.raises(UserError, match="truncated"):
        od_moe.load(str(model), capacity=8)


def test_read_failure_leaves_the_cache_consistent():
    engine = od_moe.load(capacity=8)
    engine.generate("def f(x):", max_tokens=4)
    cache = engine.caches[0]
    before = (cache.slot_of.copy(), cache.expert_in_slot.copy())
    store = engine.runtime.store
    import os

    real = os.preadv
    os.preadv = lambda *a: 0  # the disk returns nothing
    try:
        missing = np.flatnonzero(cache.slot_of < 0)[:2]
        with pytest.raises(OSError, match="short read"):
            engine.runtime.load(cache, missing)
    finally:
        os.preadv = real
    assert np.array_equal(cache.slot_of, before[0]) and np.array_equal(cache.expert_in_slot, before[1])
    assert store is engine.runtime.store
    assert engine.generate("def f(x):", max_tokens=4)  # still serves


def test_lookup_table_is_total_and_consistent():
    engine = od_moe.load(capacity=8)
    engine.generate("import json\n", max_tokens=16)
    for cache in engine.caches:
        table = np.array(cache.lookup_table())
        assert table.shape == (64,) and table.min() >= 0 and table.max() < cache.capacity
        resident = cache.resident_ids()
        assert np.array_equal(cache.expert_in_slot[cache.slot_of[resident]], resident)
        assert np.array_equal(np.array(cache.resident_mask()), cache.slot_of >= 0)
        assert len(resident) == cache.resident_count <= cache.capacity


def test_pinned_experts_are_never_evicted():
    engine = od_moe.load(capacity=12)
    engine.generate("def f(x):", max_tokens=2)
    pins = []
    for cache in engine.caches:
        chosen = cache.resident_ids()[:3]
        cache.pin(chosen)
        pins.append(chosen)
    engine.generate("class A:\n    pass\n" * 4, max_tokens=48)
    for row, cache, chosen in zip(engine.stats()["layers"], engine.caches, pins):
        assert np.all(cache.slot_of[chosen] >= 0) and np.all(cache.pinned[cache.slot_of[chosen]])
        assert row["evictions"] > 0
    with pytest.raises(ValueError, match="leaves none"):
        engine.caches[0].pin(engine.caches[0].resident_ids())


def test_measuring_install_rates_leaves_the_slots_and_the_ledger_as_they_were(bundled_reference):
    """`transfer_rates` installs into the first MoE layer's slots to time it, then reads back what they
    held (gaps and pins included, byte for byte), booking nothing; the engine still gives stock tokens."""
    engine = od_moe.load(capacity="25%", prefetch="none")
    od_moe_tokens(engine, PROMPTS[:1], 4)
    cache = engine.caches[0]
    held = cache.expert_in_slot.copy()
    held[[1, 5]] = -1  # empty slots stay empty
    engine.runtime.place(cache, held)
    cache.pin(held[[2, 3]])
    kept = mx.array(np.flatnonzero(held >= 0).astype(np.int32))
    before = {name: array[kept].astype(mx.float32) for name, array in cache.stacked_arrays().items()}
    mx.eval(list(before.values()))  # copies: host writes change the slots' own memory
    ledger = engine.runtime.ledger.snapshot()
    rates = engine.runtime.transfer_rates(repeats=2)
    assert set(rates) == {"installed", "best"} and rates["best"] == rates["installed"] > 0
    assert np.array_equal(cache.expert_in_slot, held)
    assert np.array_equal(np.flatnonzero(cache.pinned), [2, 3])
    for name, array in cache.stacked_arrays().items():
        assert mx.array_equal(array[kept].astype(mx.float32), before[name]), name
    assert np.array_equal(engine.runtime.ledger.layers, ledger.layers)
    assert engine.runtime.ledger.reader == ledger.reader
    _consistent(cache)
    engine.runtime.reset_counts()
    assert od_moe_tokens(engine, PROMPTS[1:2], NEW_TOKENS) == bundled_reference[1:2]


def test_lru_evicts_the_least_recently_used():
    engine = od_moe.load(capacity=10)
    cache = engine.caches[0]
    engine.runtime.load(cache, np.arange(10))
    cache.touch(np.arange(10), np.ones(10), clock=5.0)
    cache.touch(np.array([3]), np.ones(1), clock=1.0)  # 3 is now the stalest
    cache.touch(np.array([7]), np.ones(1), clock=2.0)
    engine.runtime.load(cache, np.array([20, 21]))
    assert cache.slot_of[3] < 0 and cache.slot_of[7] < 0 and cache.slot_of[20] >= 0 and cache.slot_of[21] >= 0


def test_lfu_remembers_an_expert_that_comes_back():
    """An evicted expert keeps its use count: back in the cache, it outranks one used once since."""
    engine = od_moe.load(capacity=2, eviction="lfu")
    cache = engine.caches[0]
    engine.runtime.load(cache, np.array([0, 1]))
    for clock in range(1, 11):  # expert 0 is used ten times, expert 1 once
        cache.touch(np.array([0]), np.ones(1), clock=clock)
    cache.touch(np.array([1]), np.ones(1), clock=10)
    engine.runtime.load(cache, np.array([2, 3]))  # both slots: 0 and 1 go
    cache.touch(np.array([2, 3]), np.ones(2), clock=11)
    engine.runtime.load(cache, np.array([0]))  # 0 comes back
    engine.runtime.load(cache, np.array([4]))  # its ten uses outweigh the other's one
    assert cache.slot_of[0] >= 0 and cache.slot_of[4] >= 0 and cache.resident_count == 2


def test_known_future_evicts_the_expert_needed_farthest_ahead():
    """Given next uses (Belady's MIN), the victim is the one needed last, whatever the eviction rule says;
    unknown futures fall back to the rule."""
    engine = od_moe.load(capacity=4)
    cache = engine.caches[0]
    engine.runtime.load(cache, np.array([0, 1, 2, 3]))
    cache.touch(np.array([0, 1, 2, 3]), np.ones(4), clock=1.0)
    cache.touch(np.array([2]), np.ones(1), clock=2.0)  # LRU would evict 0, 1 or 3 before 2
    next_use = np.full(64, np.inf)
    next_use[[0, 1, 2, 3]] = [1, 2, 9, 3]
    assert cache.expert_in_slot[cache.evictable(3.0, next_use=next_use)].tolist() == [2, 3, 1, 0]
    assert cache.expert_in_slot[cache.evictable(3.0, protect=[2], next_use=next_use)][0] == 3
    assert cache.expert_in_slot[cache.evictable(3.0)][-1] == 2  # no future known: LRU keeps 2


def test_capacity_parsing_and_errors():
    assert parse_capacity("25%") == 0.25 and parse_capacity("16") == 16 and parse_capacity("0.5") == 0.5
    assert parse_size("512MiB") == 512 * 2**20 and parse_size("8GB") == 8 * 10**9
    kw = dict(num_experts=64, moe_layers=8, slot_nbytes=1000, non_expert_nbytes=10_000)
    assert resolve_capacity(0.125, None, **kw) == 8 and resolve_capacity(64, None, **kw) == 64
    assert resolve_capacity(None, 100_000, **kw) == int((90_000 - 10_000) // 8000)
    for bad in (0, 65, -1, 1.5, "abc", "0%"):
        with pytest.raises(UserError):
            resolve_capacity(bad, None, **kw)
    assert resolve_capacity("100%", None, **kw) == 64
    for over in ("150%", "200%", "300%", "100.5%"):  # a percentage over 100% is never a count of experts
        with pytest.raises(UserError, match=r"percentage in \(0%, 100%\]"):
            resolve_capacity(over, None, **kw)
    with pytest.raises(UserError, match="too small"):
        resolve_capacity(None, "10KB", **kw)
    with pytest.raises(UserError, match="either"):
        resolve_capacity(8, "1GB", **kw)


def test_memory_budget_bounds_the_cache_and_peak_memory():
    probe = od_moe.load(capacity=1)
    slot = probe.caches[0].slot_nbytes
    working = working_nbytes(
        probe.model, len(probe.caches), probe.num_experts, kv_per_token=probe.kv_nbytes_per_token
    )
    budget = budget_for(16, len(probe.caches), slot, probe.non_expert_nbytes, working)
    gc.collect()
    base = mx.get_active_memory()  # other engines of this test process
    engine = od_moe.load(memory_budget=budget)
    assert engine.capacity == 16
    engine.generate("def fibonacci(n):", max_tokens=32)
    all_experts = slot * 64 * len(engine.caches)
    stats = engine.stats()["memory"]
    assert stats["expert_cache_bytes"] == 16 * slot * len(engine.caches)
    # experts were never all resident: loading and generating both stayed well below the full set
    assert engine.load_peak_bytes - base < probe.non_expert_nbytes + all_experts / 2
    assert stats["peak_bytes"] - base < stats["non_expert_bytes"] + all_experts


def test_direct_reads_bypass_the_page_cache_and_read_the_same_bytes(bundled_reference, monkeypatch):
    buffered, direct = ExpertStore(od_moe.DEFAULT_MODEL), ExpertStore(od_moe.DEFAULT_MODEL)
    assert direct.use_direct_io(True) and direct.direct_io  # O_DIRECT on Linux, F_NOCACHE on macOS
    parts = {p: ["weight", "scales", "biases"] for p in ("gate_proj", "up_proj", "down_proj")}
    layout = buffered.block_layout("model.layers.6.mlp.switch_mlp", parts, 64)
    for ids in ([0], [63], [5, 6, 7, 40, 62], list(range(16))):  # unaligned starts, runs, the file's tail
        a, b = (
            buffered.read(layout, ids, ExpertRows(layout, 16)),
            direct.read(layout, ids, ExpertRows(layout, 16)),
        )
        assert all(np.array_equal(a[k], b[k]) for k in a)
    monkeypatch.setattr(store_module, "BOUNCE_BYTES", 2 * store_module.DIRECT_ALIGN)
    small = ExpertStore(od_moe.DEFAULT_MODEL)  # a run of experts spread over many bounce-buffer spans
    assert small.use_direct_io(True)
    ids = list(range(3, 19))
    a, b = buffered.read(layout, ids, ExpertRows(layout, 16)), small.read(layout, ids, ExpertRows(layout, 16))
    assert all(np.array_equal(a[k], b[k]) for k in a) and np.array_equal(a.flat, b.flat)
    engine = od_moe.load(capacity="25%", direct_io=True)
    assert (
        engine.stats()["direct_io"]
        and od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]
    )
    assert not od_moe.load(capacity="25%").stats()["direct_io"]  # "auto": the bundled model fits in memory
    with pytest.raises(UserError, match="direct_io"):
        od_moe.load(capacity=8, direct_io="yes")
    assert engine.stats()["direct_io_refused"] is None


@pytest.mark.skipif(
    not hasattr(os, "O_DIRECT"), reason="O_DIRECT is Linux's; macOS reads past the cache by fcntl"
)
def test_direct_io_refused_is_said_in_one_line_and_in_the_stats(monkeypatch, capsys, bundled_reference):
    """Where the file system refuses direct I/O (tmpfs, some overlays: EINVAL on O_DIRECT), reads go through
    the page cache, exactly, and `load` says so once on stderr, in the stats and in `--stats`' table."""
    real_open = os.open

    def refusing(path, flags, *args, **kwargs):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)
    engine = od_moe.load(capacity="25%", direct_io=True)
    monkeypatch.undo()
    said = [line for line in capsys.readouterr().err.splitlines() if "direct I/O" in line]
    assert len(said) == 1
    assert said[0].endswith("(Invalid argument): reads go through the page cache")
    stats = engine.stats()
    assert not stats["direct_io"] and "od-moe: " + stats["direct_io_refused"] == said[0]
    assert stats["direct_io_refused"] in format_stats(stats)
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]


def test_mlx_rows_are_read_into_again_only_after_two_decode_passes_and_a_sync():
    """Staging rows that are MLX memory (`per_layer/mlx_rows.py`, CUDA's read path): a row installed from is
    handed out again only after a host sync made once the second decode pass after it began (prefill
    passes do not count); one given back unused is free at once; past the bound, numpy staging."""
    from od_moe.per_layer.mlx_rows import GROW, MLXRows

    store = ExpertStore(od_moe.DEFAULT_MODEL)
    parts = {p: ["weight", "scales", "biases"] for p in ("gate_proj", "up_proj", "down_proj")}
    layout = store.block_layout("model.layers.1.mlp.switch_mlp", parts, 64)
    rows = MLXRows(max_bytes=2 * layout.expert_nbytes)
    assert rows.reserve(layout) is GROW
    row = rows.make(layout)
    raw = store.read(layout, [17], row.staging)  # read straight into the MLX array's memory
    assert np.array_equal(
        np.array(row.array), flat_rows(layout, {k: np.array(v) for k, v in raw.items()}, 1)[0]
    )
    assert rows.reserve(layout) is GROW and rows.reserve(layout) is None  # the bound: two rows
    rows.give_back(layout, row)
    for decode in (True, False, False, True):  # decode pass n + 1, two prefill passes, then n + 2
        rows.synced()
        assert rows.reserve(layout) is None, decode
        rows.begin_pass(decode)
    rows.synced()
    assert rows.reserve(layout) is row
    rows.give_back(layout, row, installed=False)
    assert rows.reserve(layout) is row


def test_mlx_rows_installed_into_the_computing_layer_are_free_after_a_later_layers_sync():
    """A demand read installed into the layer about to compute: the sync of a later layer's routing in the
    same pass depends on that layer's output, so the row is free after it, not after the layer's own sync
    or a sync with no layer; one no later layer's sync freed waits two decode passes like the others."""
    from od_moe.per_layer.mlx_rows import GROW, MLXRows

    store = ExpertStore(od_moe.DEFAULT_MODEL)
    parts = {p: ["weight", "scales", "biases"] for p in ("gate_proj", "up_proj", "down_proj")}
    layout = store.block_layout("model.layers.1.mlp.switch_mlp", parts, 64)
    rows = MLXRows(max_bytes=layout.expert_nbytes)
    rows.begin_pass(decode=False)
    assert rows.reserve(layout) is GROW
    row = rows.make(layout)
    rows.give_back(layout, row, layer=3)
    rows.synced(3)
    rows.synced()
    assert rows.reserve(layout) is None
    rows.synced(4)
    assert rows.reserve(layout) is row
    rows.give_back(layout, row, layer=7)  # the last MoE layer: no later sync in this pass
    rows.begin_pass(decode=True)
    rows.synced(0)
    assert rows.reserve(layout) is None  # another pass's layer 0 depends on none of it
    rows.begin_pass(decode=True)
    rows.synced(0)
    assert rows.reserve(layout) is row  # a sync once the second decode pass after it began


def test_mlx_rows_take_back_their_memory_hints_when_the_reader_closes_or_they_are_collected(monkeypatch):
    """Rows are MLX arrays advised host-preferred on CUDA (`backend.stage_for_device`); MLX recycles their
    buffers once they go, so the advice is taken back first: when the reader closes, or when rows nobody
    closed are collected. After `release` no row is handed out."""
    from od_moe.memory import backend
    from od_moe.per_layer.mlx_rows import GROW, MLXRows

    gc.collect()  # rows other tests left are released before the count starts
    unstaged = []
    monkeypatch.setattr(backend, "unstage", lambda array: unstaged.append(id(array)))
    store = ExpertStore(od_moe.DEFAULT_MODEL)
    parts = {p: ["weight", "scales", "biases"] for p in ("gate_proj", "up_proj", "down_proj")}
    layout = store.block_layout("model.layers.1.mlp.switch_mlp", parts, 64)
    reader = Reader(store, [layout], Ledger(1), threads=1, make_arrays=True)
    rows = reader.rows
    made = []
    for _ in range(2):
        assert rows.reserve(layout) is GROW
        made.append(rows.make(layout))
    rows.give_back(layout, made[0], installed=False)
    reader.close()
    assert sorted(unstaged) == sorted(id(r.array) for r in made)
    assert rows.reserve(layout) is None  # released: numpy staging from here
    reader.close()
    assert len(unstaged) == 2  # once

    unstaged.clear()
    rows = MLXRows()
    assert rows.reserve(layout) is GROW
    array_id = id(rows.make(layout).array)
    del rows
    gc.collect()
    assert unstaged == [array_id]


def test_staging_starts_mid_page_so_installs_do_not_copy_onto_aliasing_addresses():
    """Copies whose destination sits a few bytes past the source modulo 4 KiB ran at a tenth of the speed
    on this CPU, and numpy's large arrays (16 bytes into a page) against MLX's (24) are just that: staging
    rows start `STAGING_PAGE_OFFSET` bytes into a page, and read into them gives the same bytes."""
    from od_moe.storage.layout import STAGING_PAGE_OFFSET, host_rows

    store = ExpertStore(od_moe.DEFAULT_MODEL)
    parts = {p: ["weight", "scales", "biases"] for p in ("gate_proj", "up_proj", "down_proj")}
    layout = store.block_layout("model.layers.1.mlp.switch_mlp", parts, 64)
    staging = ExpertRows(layout, 3)
    assert staging.flat.ctypes.data % 4096 == STAGING_PAGE_OFFSET
    assert staging.flat.shape == (3, layout.expert_nbytes) and staging.flat.flags.c_contiguous
    raw = store.read(layout, [5, 6, 40], staging)
    gathered = flat_rows(layout, {k: np.array(v) for k, v in raw.items()}, 3)
    assert np.array_equal(staging.flat, gathered)
    rows = host_rows(2, 100)
    assert rows.shape == (2, 100) and rows.ctypes.data % 4096 == STAGING_PAGE_OFFSET
