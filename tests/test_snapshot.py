"""Warm start: a snapshot restores the same resident set, and only for the key it was saved with."""

import json
import os

import numpy as np
import pytest

import od_moe
from od_moe.errors import UserError


@pytest.mark.parametrize("weights", [False, True])
def test_snapshot_round_trip(tmp_path, bundled_reference, weights):
    from conftest import PROMPTS, od_moe_tokens

    engine = od_moe.load(capacity=16)
    engine.generate("def fibonacci(n):", max_tokens=24)
    engine.caches[1].pin(engine.caches[1].resident_ids()[:2])
    engine.save_snapshot(tmp_path / "snap", weights=weights)
    assert bool(list((tmp_path / "snap").glob("experts-*.safetensors"))) == weights

    warm = od_moe.load(capacity=16, snapshot=tmp_path / "snap")
    for a, b in zip(engine.caches, warm.caches):
        assert np.array_equal(a.expert_in_slot, b.expert_in_slot)
        assert np.array_equal(a.pinned, b.pinned)
        for name, array in a.stacked_arrays().items():
            occupied = np.flatnonzero(a.expert_in_slot >= 0)
            assert np.array_equal(np.array(array)[occupied], np.array(b.stacked_arrays()[name])[occupied])
    assert od_moe_tokens(warm, PROMPTS[:1], 64) == bundled_reference[:1]


def test_snapshot_is_never_used_for_another_key(tmp_path):
    engine = od_moe.load(capacity=16)
    engine.generate("x = 1", max_tokens=4)
    engine.save_snapshot(tmp_path / "snap")
    with pytest.raises(UserError, match="capacity"):
        od_moe.load(capacity=8, snapshot=tmp_path / "snap")
    with pytest.raises(UserError, match="not an od-moe snapshot"):
        od_moe.load(capacity=16, snapshot=tmp_path / "nothing")
    with pytest.raises(UserError, match="dtypes"):
        od_moe.load(capacity=16, snapshot=tmp_path / "snap", dtype="model")


@pytest.fixture(scope="module")
def two_snapshots(tmp_path_factory):
    """Two snapshots with weights of the same key and different resident sets."""
    root = tmp_path_factory.mktemp("snaps")
    engine = od_moe.load(capacity=16)
    engine.generate("def fibonacci(n):", max_tokens=8)
    engine.save_snapshot(root / "a", weights=True)
    engine.generate("class Stack:\n    def push(self, x):", max_tokens=24)
    engine.save_snapshot(root / "b", weights=True)
    return root


def _experts(folder):
    (file,) = folder.glob("experts-*.safetensors")
    return file


def test_experts_file_from_another_snapshot_is_refused(tmp_path, two_snapshots):
    """A snapshot.json beside another snapshot's experts file (same name, other content) used to load
    silently and give wrong tokens: the recorded content hash refuses it."""
    import shutil

    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(two_snapshots / "a", a)
    shutil.copytree(two_snapshots / "b", b)
    assert (
        json.loads((a / "snapshot.json").read_text())["experts_sha256"]
        != json.loads((b / "snapshot.json").read_text())["experts_sha256"]
    )
    _experts(b).replace(a / _experts(a).name)  # b's bytes under the name a's json names
    with pytest.raises(UserError, match="not the file this snapshot was saved with"):
        od_moe.load(capacity=16, snapshot=a)


@pytest.mark.parametrize("damage", ["truncated", "missing"])
def test_damaged_experts_file_is_refused(tmp_path, two_snapshots, damage):
    import shutil

    snap = tmp_path / "snap"
    shutil.copytree(two_snapshots / "a", snap)
    file = _experts(snap)
    if damage == "truncated":
        os.truncate(file, file.stat().st_size // 2)
        with pytest.raises(UserError, match="not the file this snapshot was saved with"):
            od_moe.load(capacity=16, snapshot=snap)
    else:
        file.unlink()
        with pytest.raises(UserError, match="missing its experts file"):
            od_moe.load(capacity=16, snapshot=snap)


def test_failed_save_leaves_the_previous_snapshot_intact(tmp_path, two_snapshots, monkeypatch):
    """A save killed while writing the experts (here: the write raises, as on a full disk) leaves the
    snapshot that was there loadable and unchanged, and no temporary file behind."""
    import shutil

    import mlx.core as mx

    snap = tmp_path / "snap"
    shutil.copytree(two_snapshots / "a", snap)
    before = {f.name: f.read_bytes() for f in snap.iterdir()}
    engine = od_moe.load(capacity=16, snapshot=snap)
    engine.generate("import os", max_tokens=8)

    def disk_full(path, arrays):
        with open(path, "wb") as f:
            f.write(b"\0" * 1000)  # a partial file, then the failure
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mx, "save_safetensors", disk_full)
    with pytest.raises(UserError, match="No space left on device"):
        engine.save_snapshot(snap, weights=True)
    assert {f.name: f.read_bytes() for f in snap.iterdir()} == before
    warm = od_moe.load(capacity=16, snapshot=snap)
    assert np.array_equal(
        warm.caches[0].expert_in_slot,
        od_moe.load(capacity=16, snapshot=two_snapshots / "a").caches[0].expert_in_slot,
    )


def test_a_new_save_replaces_the_old_experts_file(tmp_path, two_snapshots):
    import shutil

    snap = tmp_path / "snap"
    shutil.copytree(two_snapshots / "a", snap)
    engine = od_moe.load(capacity=16, snapshot=two_snapshots / "b")
    engine.save_snapshot(snap, weights=True)
    assert _experts(snap).read_bytes() == _experts(two_snapshots / "b").read_bytes()  # one file, b's
    engine.save_snapshot(snap)  # without weights: no experts file is left
    assert not list(snap.glob("experts-*")) and sorted(f.name for f in snap.iterdir()) == ["snapshot.json"]
