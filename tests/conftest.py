import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate as mlx_lm_stream_generate

import od_moe
from od_moe.memory import backend

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):"]
NEW_TOKENS = 64


def reference_tokens(path, prompts, max_tokens, dtype="auto"):
    """Greedy tokens from stock mlx-lm, with the same backend cast od-moe applies (float32 on CPU)."""
    model, tokenizer = mlx_lm_load(str(path))
    target = backend.compute_dtype(dtype)
    if target is not None:
        model.set_dtype(target)
    return [
        [r.token for r in mlx_lm_stream_generate(model, tokenizer, p, max_tokens=max_tokens)] for p in prompts
    ]


def od_moe_tokens(engine, prompts, max_tokens):
    return [[r.token for r in engine.stream_generate(p, max_tokens=max_tokens)] for p in prompts]


@pytest.fixture(scope="session")
def bundled_reference():
    return reference_tokens(od_moe.DEFAULT_MODEL, PROMPTS, NEW_TOKENS)


def consistent(cache):
    """A `LayerCache`'s tables agree: slot_of and expert_in_slot name each other; lookups are total."""
    resident = np.flatnonzero(cache.slot_of >= 0)
    assert np.array_equal(np.sort(cache.expert_in_slot[cache.expert_in_slot >= 0]), resident)
    assert all(cache.expert_in_slot[cache.slot_of[e]] == e for e in resident)
    table = np.array(cache.lookup_table())
    assert table.min() >= 0 and table.max() < cache.capacity


def slots_hold_their_experts(engine, model_dir=None):
    """Every slot that claims an expert holds that expert's bytes from the checkpoint."""
    weights = {}
    for f in sorted((model_dir or engine.model_path).glob("*.safetensors")):
        weights.update(mx.load(str(f)))
    for cache in engine.caches:
        consistent(cache)
        resident = np.flatnonzero(cache.slot_of >= 0)
        slots = engine.runtime.slot_arrays(cache)
        for part in cache.layout.parts:
            held = slots[f"{part.proj}.{part.name}"][mx.array(cache.slot_of[resident])]
            expected = weights[f"{cache.layout.module_path}.{part.proj}.{part.name}"][mx.array(resident)]
            assert mx.array_equal(held, expected.astype(held.dtype)), (cache.layer, part.proj, part.name)


def invariants(stats):
    """The prefetch and lookup counts add up."""
    p = stats["prefetch"]
    assert p["issued"] == p["useful"] + p["wasted"] + p["in_flight"], p
    if p["useful"] + p["wasted"]:
        assert p["precision"] == pytest.approx(p["useful"] / (p["useful"] + p["wasted"]))
    t = stats["total"]
    assert t["hits"] + t["misses"] == t["lookups"]


@pytest.fixture(scope="session")
def deterministic_grid(tmp_path_factory):
    """One `od-moe bench --deterministic` grid on the bundled model, drawn with --plot: (rows, plot path,
    stderr). Shared by the bench and plot tests (a grid takes most of a minute)."""
    import contextlib
    import io
    import json

    from od_moe.cli import main

    plot = tmp_path_factory.mktemp("grid") / "plots" / "bench.svg"
    out, err = io.StringIO(), io.StringIO()
    args = ["bench", "--deterministic", "--json", "--widen", "0", "--max-tokens", "6", "--plot", str(plot)]
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert main(args) == 0
    return json.loads(out.getvalue())["rows"], plot, err.getvalue()
