"""od_moe/memory/cuda.py, the CUDA runtime calls od-moe makes, through recording fakes on this CPU: copies
into an array's rows (the CPU backend's arrays are host memory, so a fake copying with `memmove` writes where
a real one writes device memory), pinned staging, the check that the device sees the copies, and the memory
advice of the fallback path; then the engine with its installs done by those copies."""

import ctypes
import os

import mlx.core as mx
import numpy as np
import pytest

import od_moe
from conftest import NEW_TOKENS, PROMPTS, od_moe_tokens
from od_moe.memory import backend, cuda
from od_moe.per_layer import PerLayerSettings
from od_moe.storage.layout import ExpertRows


class _Call:
    """A runtime function as a recording fake (its `argtypes` set by the code under test)."""

    def __init__(self, act=None, fail_at=None):
        self.argtypes, self.calls, self.act, self.fail_at = None, [], act, fail_at

    def __call__(self, *args):
        self.calls.append(args)
        if len(self.calls) == self.fail_at:
            return 700  # cudaErrorIllegalAddress
        if self.act is not None:
            self.act(*args)
        return 0


class _CopyRuntime:
    """The runtime calls `DeviceCopies` makes; `seen=False`: copies go nowhere (memory the device does
    not compute on)."""

    def __init__(self, seen=True, fail_at=None):
        copy = (lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n)) if seen else None
        self.cudaMemcpyAsync = _Call(copy, fail_at)
        self.cudaStreamSynchronize = _Call()
        self.cudaHostRegister = _Call()
        self.cudaHostUnregister = _Call()
        self.cleared = 0

    def cudaGetLastError(self):
        self.cleared += 1
        return 0


def test_row_writer_queues_rows_and_flush_copies_them_with_one_wait():
    runtime = _CopyRuntime()
    copies = cuda.DeviceCopies(runtime)
    array = mx.zeros((4, 3, 8), dtype=mx.bfloat16)
    writer = copies.writer(array)
    rows = np.arange(2 * 24, dtype=np.uint16).reshape(2, 3, 8)
    writer[2], writer[0] = rows[0], rows[1]
    assert not np.array(array.view(mx.uint16)).any() and runtime.cudaStreamSynchronize.calls == []
    copies.flush()
    copies.flush()  # nothing new to issue or wait for
    assert len(runtime.cudaStreamSynchronize.calls) == 1 and len(runtime.cudaMemcpyAsync.calls) == 2
    got = np.array(array.view(mx.uint16))
    assert np.array_equal(got[2], rows[0]) and np.array_equal(got[0], rows[1]) and not got[[1, 3]].any()
    with pytest.raises(ValueError):
        writer[1] = rows[0][:2]  # a row of the wrong size
    with pytest.raises(IndexError):
        writer[4] = rows[0]


def test_a_failed_copy_turns_copies_off_and_clears_the_error():
    runtime = _CopyRuntime(fail_at=2)
    copies = cuda.DeviceCopies(runtime)
    writer = copies.writer(mx.zeros((2, 4), dtype=mx.uint32))
    writer[0], writer[1] = np.ones(4, np.uint32), np.ones(4, np.uint32)
    with pytest.raises(cuda.CopyError):
        copies.flush()
    assert copies.on is False and runtime.cleared == 1 and copies.queued == []
    assert runtime.cudaStreamSynchronize.calls  # the copies issued before landed before any fallback
    with pytest.raises(cuda.CopyError):
        writer[1] = np.ones(4, np.uint32)
    assert len(runtime.cudaMemcpyAsync.calls) == 2


def test_staging_is_pinned_once_on_first_copy_and_unpinned_when_freed():
    runtime = _CopyRuntime()
    copies = cuda.DeviceCopies(runtime)
    writer = copies.writer(mx.zeros((4, 256), dtype=mx.uint8))
    buffer = np.empty(1 << 16, np.uint8)
    rows = buffer[1000 : 1000 + 4 * 256].reshape(4, 256)  # a view, as staging's rows are
    for slot in range(4):
        writer[slot] = rows[slot]
    copies.flush()
    writer[0] = rows[1]
    copies.flush()
    assert runtime.cudaHostRegister.calls == [(buffer.ctypes.data, buffer.nbytes, 0)]
    address = buffer.ctypes.data
    del buffer, rows
    assert runtime.cudaHostUnregister.calls == [(address,)] and not copies.pinned


@pytest.fixture
def cuda_copies(monkeypatch):
    """The CUDA install path on this CPU: arrays count as device memory, copies by a fake runtime."""

    def use(runtime):
        monkeypatch.setattr(backend, "arrays_in_host_memory", lambda: False)
        monkeypatch.setattr(backend, "_copies", cuda.DeviceCopies(runtime))
        return runtime

    return use


def test_engine_installs_through_cuda_copies_give_exact_tokens(cuda_copies, bundled_reference):
    """Reads land in pinned numpy staging and installs are runtime copies into the slots (no MLX write, no
    arrays made by the reader threads); the tokens are stock mlx-lm's."""
    runtime = cuda_copies(_CopyRuntime())
    assert not od_moe.load(capacity="25%", prefetch="none").runtime.loader.copy_installs  # off on CUDA
    copying = PerLayerSettings(copy_installs=True)
    engine = od_moe.load(capacity="25%", prefetch="none", read_threads=4, path_settings=copying)
    engine.configure_prefetch("next-gate")
    assert not engine.runtime.reader.make_arrays
    assert od_moe_tokens(engine, PROMPTS[:2], NEW_TOKENS) == bundled_reference[:2]
    assert all(cache.host_writes for cache in engine.caches)
    installed = engine.stats()["total"]["experts_loaded"]
    parts = len(engine.caches[0].layout.parts)
    assert installed > 0 and len(runtime.cudaMemcpyAsync.calls) == installed * parts
    assert runtime.cudaHostRegister.calls  # the staging reads land in, pinned
    assert backend._copies.trusted is True  # read back once through MLX


def test_copies_the_device_does_not_see_fall_back_to_mlx_writes(cuda_copies, bundled_reference):
    """Where the first copy is not seen through MLX, copies turn off for good: that install is written
    again through MLX, later ones go through MLX, and the tokens stay stock mlx-lm's."""
    cuda_copies(_CopyRuntime(seen=False))
    copying = PerLayerSettings(copy_installs=True)
    engine = od_moe.load(capacity="25%", prefetch="none", path_settings=copying)
    full = mx.load(str(od_moe.DEFAULT_MODEL / "model.safetensors"))
    cache, ids = engine.caches[2], np.array([9, 3, 60])
    slots = cache.install(
        ids, engine.runtime.store.read(cache.layout, ids, ExpertRows(cache.layout, 4))
    ).slots
    assert backend._copies.trusted is False and not backend.copies_into_arrays() and not cache.host_writes
    for part in cache.layout.parts:
        stacked = cache.projections[part.proj][part.name]
        expected = full[f"model.layers.2.mlp.switch_mlp.{part.proj}.{part.name}"][mx.array(ids)]
        assert mx.array_equal(stacked[mx.array(slots)], expected.astype(stacked.dtype)), part.name
    engine = od_moe.load(capacity="25%", prefetch="none", path_settings=copying)
    assert engine.runtime.reader.make_arrays
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == bundled_reference[:1]


class _Advise:
    """cudaMemAdvise as a recording fake: returns an error at call number `fail_at`."""

    def __init__(self, fail_at=None):
        self.argtypes, self.calls, self.fail_at = None, [], fail_at

    def __call__(self, address, nbytes, advice, where):
        where = where if isinstance(where, int) else (where.type, where.id)
        self.calls.append((address, nbytes, advice, where))
        return 1 if len(self.calls) == self.fail_at else 0


class _Runtime:
    def __init__(self, fail_at=None):
        self.cudaMemAdvise, self.cleared = _Advise(fail_at), 0

    def cudaGetLastError(self):
        self.cleared += 1
        return 0


def test_cuda_staging_hints_advise_each_large_buffer_once_and_stand_down_on_an_error():
    """`backend.stage_for_device`'s CUDA hints (host-preferred, device-mapped managed memory), through a
    recording runtime: one pair of advices per buffer, none for small arrays, the CUDA 12 signature where
    the runtime is older, and on an error no further calls, the runtime's last error cleared (MLX checks
    it after its launches) and the array returned as it was."""
    runtime = _Runtime()
    hints = cuda.HostPreferredHints(runtime)
    big, small = mx.array(np.zeros(hints.MIN_BYTES, np.uint8)), mx.array(np.zeros(1024, np.uint8))
    assert hints.apply(big) is big and hints.apply(big) is big and hints.apply(small) is small
    address = np.array(big, copy=False).__array_interface__["data"][0]
    assert runtime.cudaMemAdvise.calls == [(address, big.nbytes, 3, (2, 0)), (address, big.nbytes, 5, (1, 0))]
    old = _Runtime()
    cuda.HostPreferredHints(old, version=12080).apply(big)
    assert [c[2:] for c in old.cudaMemAdvise.calls] == [(3, -1), (5, 0)]  # cudaCpuDeviceId, device 0
    failing = _Runtime(fail_at=2)
    hints = cuda.HostPreferredHints(failing)
    other = mx.array(np.ones(hints.MIN_BYTES, np.uint8))
    assert hints.apply(big) is big and hints.apply(other) is other
    assert len(failing.cudaMemAdvise.calls) == 2 and failing.cleared == 1 and hints.on is False
    assert backend.stage_for_device(big) is big  # this CPU backend: host memory, nothing to advise


def test_cuda_staging_hints_are_taken_back_from_a_buffer_before_mlx_recycles_it():
    """`backend.unstage`: the advice stays with a buffer MLX recycles (for slots or activations of a later
    engine, where host-preferred memory slows the GPU), so each advised buffer is unset once, and only
    those advised."""
    runtime = _Runtime()
    hints = cuda.HostPreferredHints(runtime)
    big, other = mx.array(np.zeros(hints.MIN_BYTES, np.uint8)), mx.array(np.ones(hints.MIN_BYTES, np.uint8))
    address = np.array(big, copy=False).__array_interface__["data"][0]
    hints.apply(big)
    hints.release(big)
    hints.release(big)
    hints.release(other)  # never advised
    assert [c[2:] for c in runtime.cudaMemAdvise.calls] == [
        (3, (2, 0)),
        (5, (1, 0)),
        (4, (2, 0)),
        (6, (1, 0)),
    ]
    assert {c[:2] for c in runtime.cudaMemAdvise.calls} == {(address, big.nbytes)}
    hints.apply(big)  # advised again after a release
    assert len(runtime.cudaMemAdvise.calls) == 6


class _Mapping:
    def __init__(self):
        self.advised, self.released = [], []

    def apply(self, array, device_tail):
        self.advised.append(device_tail)
        return True

    def release_at(self, address):
        self.released.append(address)


def test_mapped_stacks_raise_mlx_memory_limit_by_their_host_bytes_until_let_go(monkeypatch):
    """MLX counts a mapped stack as active memory, and past its limit it waits for the GPU after every
    operation: `map_for_device` (as on CUDA, through a recording mapping) raises the limit by the bytes
    kept in host memory (not the device tail), once per array however often it is mapped, and `unmap` /
    `unmap_at` lower it back to what it was."""
    monkeypatch.setattr(backend, "arrays_in_host_memory", lambda: False)
    monkeypatch.setattr(backend, "_host_mapping", mapping := _Mapping())
    monkeypatch.setattr(backend, "_held_in_host", {})
    limit = mx.get_memory_limit()
    try:
        one, two = mx.array(np.zeros(1 << 20, np.uint8)), mx.array(np.zeros(1 << 19, np.uint8))
        assert backend.map_for_device(one, 1 << 18) and backend.map_for_device(two, 0)
        assert mx.get_memory_limit() == limit + (1 << 20) - (1 << 18) + (1 << 19)
        backend.map_for_device(one, 1 << 18)  # advised again: counted once
        assert mx.get_memory_limit() == limit + (1 << 20) - (1 << 18) + (1 << 19)
        backend.unmap(one)
        assert mx.get_memory_limit() == limit + (1 << 19)
        backend.unmap_at(cuda.address_of(two))
        backend.unmap_at(cuda.address_of(two))  # let go twice: lowered once
        assert mx.get_memory_limit() == limit and mapping.advised == [1 << 18, 0, 1 << 18]
        assert mapping.released == [cuda.address_of(one)] + [cuda.address_of(two)] * 2
    finally:
        mx.set_memory_limit(limit)


def test_a_host_ring_rewrites_an_array_only_after_what_was_made_from_it():
    """`HostRing` (two-tier tables, slot fills): each write lands in the next array of the ring, holds the
    values given, and waits for what the device made from that array last time before writing it."""
    from od_moe.two_tier.host_ring import HostRing

    ring = HostRing((2, 3), np.int32, depth=2)
    first = ring.write(np.array([[1, 2, 3], [4, 5, 6]]))
    made = first * 10  # lazy: reads `first` when computed
    ring.used_by(made)
    second = ring.write(np.full((2, 3), 7))
    assert second is not first and np.array(second).tolist() == [[7] * 3] * 2
    third = ring.write(np.zeros((2, 3)))  # `first` again: `made` is computed before it is overwritten
    assert third is first and np.array(made).tolist() == [[10, 20, 30], [40, 50, 60]]
    assert np.array(third).sum() == 0


def test_on_cuda_attention_runs_on_mlx_kernels_unless_the_environment_asks_for_cudnn(monkeypatch):
    """`backend.attention_choice` (run as od-moe is imported): on CUDA it sets MLX_CUDA_USE_CUDNN_SDPA=0,
    so a new prompt shape costs no cuDNN graph; a value the user set is kept; elsewhere nothing is set."""
    monkeypatch.delenv(backend.CUDNN_ATTENTION, raising=False)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    assert backend.attention_choice() is None and backend.CUDNN_ATTENTION not in os.environ
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    assert backend.attention_choice() == "0" and os.environ[backend.CUDNN_ATTENTION] == "0"
    monkeypatch.setenv(backend.CUDNN_ATTENTION, "1")
    assert backend.attention_choice() is None and os.environ[backend.CUDNN_ATTENTION] == "1"


def test_past_the_hosts_memory_a_stack_is_made_on_the_device(monkeypatch):
    """A stack is made (its zeros' first touch) on CPU streams where arrays are host memory or the host
    holds every expert; on CUDA past the host's memory on the device, so its slot rows never take host
    memory (an H100 run's load outgrew a 4.08 GB budget when every layer's slots were made on the host)."""
    stream = mx.new_stream(mx.cpu)
    assert backend.stack_zeros_on(True, stream) == stream  # this CPU: arrays are host memory
    monkeypatch.setattr(backend, "arrays_in_host_memory", lambda: False)
    assert backend.stack_zeros_on(False, stream) == stream
    assert backend.stack_zeros_on(True, stream) == mx.gpu
