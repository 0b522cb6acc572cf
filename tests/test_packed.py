"""Packed experts (`od-moe pack`): the same bytes, one read request per expert, the same tokens as stock
mlx-lm; a packed file that does not fit the model is refused with what to do."""

import json
import os
import shutil
import struct

import numpy as np
import pytest

import od_moe
from conftest import NEW_TOKENS, PROMPTS, od_moe_tokens, slots_hold_their_experts
from od_moe.cli import main
from od_moe.errors import UserError
from od_moe.storage.layout import ExpertRows


@pytest.fixture(scope="module")
def packed_model(tmp_path_factory):
    """A copy of the bundled model folder with its experts packed where `load()` looks."""
    folder = tmp_path_factory.mktemp("packed") / "model"
    shutil.copytree(od_moe.DEFAULT_MODEL, folder)
    assert main(["pack", str(folder)]) == 0
    return folder


def test_packed_reads_give_the_checkpoints_bytes_in_one_request_per_run(packed_model, monkeypatch):
    packed = od_moe.load(str(packed_model), capacity=4)
    plain = od_moe.load(str(packed_model), capacity=4, packed=False)
    assert packed.stats()["packed_experts"] == str(packed_model / "od-moe-packed" / "experts.safetensors")
    assert plain.stats()["packed_experts"] is None
    calls, real = [], os.preadv

    def counted(fd, views, offset):
        calls.append(len(views))
        return real(fd, views, offset)

    monkeypatch.setattr(os, "preadv", counted)
    ids = [0, 1, 2, 9, 33, 63]  # runs: 0-2, 9, 33, 63
    for p_cache, u_cache in zip(packed.caches, plain.caches):
        p_layout, u_layout = p_cache.layout, u_cache.layout
        assert p_layout.packed is not None and u_layout.packed is None
        calls.clear()
        got = packed.runtime.store.read(p_layout, ids, ExpertRows(p_layout, 8))
        assert calls == [1, 1, 1, 1]  # one request per run of consecutive experts, into the staging rows
        want = plain.runtime.store.read(u_layout, ids, ExpertRows(u_layout, 8))
        assert np.array_equal(got.flat, want.flat)
        assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in got)


def test_generation_from_packed_experts_matches_mlx_lm(packed_model, bundled_reference):
    engine = od_moe.load(str(packed_model), capacity=0.25)
    assert engine.runtime.store.packed is not None
    assert od_moe_tokens(engine, PROMPTS, NEW_TOKENS) == bundled_reference
    assert engine.stats()["total"]["experts_loaded"] > 0
    slots_hold_their_experts(engine, packed_model)


def test_packed_experts_made_from_other_weights_are_refused(packed_model, tmp_path):
    packed_file = packed_model / "od-moe-packed" / "experts.safetensors"
    stale = tmp_path / "stale.safetensors"
    raw = packed_file.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    header["__metadata__"]["weights_digest"] = "0" * 64
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    stale.write_bytes(struct.pack("<Q", len(encoded)) + encoded + raw[8 + n :])
    with pytest.raises(UserError, match="not made from these weights.*od-moe pack"):
        od_moe.load(str(packed_model), capacity=4, packed=str(stale))
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(UserError, match="truncated"):
        od_moe.load(str(packed_model), capacity=4, packed=str(truncated))
    with pytest.raises(UserError, match="no packed experts at .*od-moe pack"):
        od_moe.load(str(packed_model), capacity=4, packed=str(tmp_path / "missing.safetensors"))
    with pytest.raises(UserError, match="no packed experts"):
        od_moe.load(capacity=4, packed=True)  # the embedded model ships none
    with pytest.raises(UserError, match="packed must be"):
        od_moe.load(capacity=4, packed=3)


def test_pack_command_writes_where_asked_and_says_what_to_do_on_bad_input(tmp_path, capsys):
    out = tmp_path / "elsewhere" / "experts.safetensors"
    assert main(["pack", "--out", str(out)]) == 0
    assert out.is_file() and not (out.parent / "experts.safetensors.partial").exists()
    engine = od_moe.load(capacity=4, packed=str(out))
    assert engine.runtime.store.packed == out
    capsys.readouterr()
    assert main(["pack", str(tmp_path / "no-model")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("od-moe: error:") and len(err.strip().splitlines()) == 1
    blocked = tmp_path / "file"
    blocked.write_text("x")
    assert main(["pack", "--out", str(blocked / "experts.safetensors")]) == 2  # a file where a folder goes
    assert "cannot write packed experts" in (err := capsys.readouterr().err) and "--packed FILE" in err


def test_commands_read_a_packed_file_made_elsewhere(tmp_path, capsys):
    """`pack --out FILE` elsewhere, then `--packed FILE` on generate and inspect (serve and bench take it
    too): the text is the checkpoint's, and a file that is missing or made from other weights is one line."""
    out = tmp_path / "experts.safetensors"
    assert main(["pack", "--out", str(out)]) == 0
    argv = ["generate", "--prompt", "def add(a, b):", "--max-tokens", "6", "--capacity", "8"]
    capsys.readouterr()
    assert main(argv) == 0
    plain = capsys.readouterr().out
    assert main([*argv, "--packed", str(out), "--stats"]) == 0
    packed = capsys.readouterr()
    assert packed.out == plain
    assert f"experts read from the packed copy {out}" in packed.err  # never silently another copy
    assert main(["inspect", "--packed", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["packed"] == str(out)
    for bad in (tmp_path / "missing.safetensors", od_moe.DEFAULT_MODEL / "model.safetensors"):
        for command in (argv, ["inspect"]):
            assert main([*command, "--packed", str(bad)]) == 2
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and err[0].startswith("od-moe: error: ") and str(bad) in err[0], err


def test_inspect_reports_packed_experts(packed_model):
    from od_moe.preflight import format_inspection, inspect_model

    report = inspect_model(str(packed_model))
    assert report["packed"] == str(packed_model / "od-moe-packed" / "experts.safetensors")
    assert f"packed     {report['packed']}" in format_inspection(report)
    assert inspect_model()["packed"] is None  # the embedded model ships none


def test_bench_pack_needs_the_prefetch_grids_widened_model(capsys):
    assert main(["bench", "--pack", "--foundation"]) == 2
    assert main(["bench", "--pack", "--widen", "0"]) == 2
    assert "--pack packs the prefetch grid's widened model" in capsys.readouterr().err


def test_a_pack_that_cannot_read_the_checkpoint_leaves_nothing_behind(tmp_path):
    from od_moe.engine import model_layouts
    from od_moe.errors import ExpertReadError
    from od_moe.storage.packed import pack

    folder = tmp_path / "model"
    shutil.copytree(od_moe.DEFAULT_MODEL, folder)
    store, layouts = model_layouts(str(folder))
    weights = next(folder.glob("*.safetensors"))
    os.truncate(weights, weights.stat().st_size // 2)  # the checkpoint shrank after it was indexed
    with pytest.raises(ExpertReadError, match="changed since od-moe loaded it"):
        pack(store, layouts, tmp_path / "out" / "experts.safetensors")
    assert not any((tmp_path / "out").iterdir())  # no packed file, no partial one


def test_packed_reads_through_direct_io_give_the_same_bytes(packed_model):
    """Direct I/O turned on before or after the packed file is taken: every file, the packed one too, is
    read past the page cache (where the file system allows it) and the bytes are the checkpoint's."""
    from od_moe.storage.packed import default_path, use_packed
    from od_moe.storage.store import ExpertStore

    plain = od_moe.load(str(packed_model), capacity=4, packed=False)
    parts = {p: ["weight", "scales", "biases"] for p in ("gate_proj", "up_proj", "down_proj")}
    module = plain.caches[2].layout.module_path
    want = plain.runtime.store.read(plain.caches[2].layout, [3, 4, 50], ExpertRows(plain.caches[2].layout, 3))
    for direct_first in (True, False):
        store = ExpertStore(packed_model)
        if direct_first:
            store.use_direct_io(True)
        assert use_packed(store, default_path(packed_model))
        direct = store.use_direct_io(True)
        assert direct == ExpertStore(packed_model).use_direct_io(True)  # as the file system allows
        assert store._direct is None or len(store._direct) == len(store.files)
        layout = store.block_layout(module, parts, 64)
        got = store.read(layout, [3, 4, 50], ExpertRows(layout, 3))
        assert layout.packed is not None and np.array_equal(got.flat, want.flat)


@pytest.mark.parametrize("packed", [False, True])
def test_an_experts_spans_read_its_bytes(packed_model, packed):
    """An expert read as several requests at once (`ExpertStore.spans`, as three tiers' reader threads
    read it) gives the bytes one read gives, packed or not, through the page cache and past it; the
    spans cut no block twice and none is longer than asked (but one block)."""
    from od_moe.storage.store import DIRECT_ALIGN

    engine = od_moe.load(str(packed_model), capacity=4, packed=packed)
    layout, store = engine.caches[5].layout, engine.runtime.store
    assert (layout.packed is not None) == packed
    want = store.read(layout, [7], ExpertRows(layout, 1))
    for direct in (False, True):
        store.use_direct_io(direct)
        staging = ExpertRows(layout, 1)
        spans = store.spans(layout, 7, staging, 3 * DIRECT_ALIGN)
        assert len(spans) > 1 and all(len(s.view) <= 4 * DIRECT_ALIGN for s in spans)
        for earlier, later in zip(spans, spans[1:]):
            if earlier.file_index == later.file_index and later.offset == earlier.offset + len(earlier.view):
                assert later.offset % DIRECT_ALIGN == 0  # a cut inside a run falls on a block
        for span in reversed(spans):  # any order: each lands in its own place
            store.read_span(layout, 7, span)
        assert np.array_equal(staging.flat[0], want.flat[0])
    engine.close()
