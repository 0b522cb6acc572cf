"""Warm start: a snapshot restores the same resident set, and only for the key it was saved with."""

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
    assert (tmp_path / "snap" / "experts.safetensors").exists() == weights

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
