"""Warm start: save and restore the resident set of an engine's expert caches.

A snapshot is a folder with `snapshot.json` (its key, and per layer the expert in every slot and the pinned
slots) and, optionally, `experts.safetensors` with the packed slot arrays for the fastest start. The key is
the model identity (config + safetensors headers), the capacity, the in-memory dtypes and the predictor;
a snapshot is never used for an engine with another key. Without weights, restoring reads the experts from
the model's own files.
"""

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from .errors import UserError

FORMAT = 1


def snapshot_key(engine) -> dict:
    predictor = getattr(engine.predictor, "identity", None) if engine.predictor is not None else None
    dtypes = sorted({str(t) for c in engine.caches for t in c.targets.values()})
    return {
        "format": FORMAT,
        "model": engine.identity,
        "capacity": engine.capacity,
        "num_experts": engine.num_experts,
        "moe_layers": len(engine.caches),
        "dtypes": dtypes,
        "predictor": predictor,
    }


def save_snapshot(engine, path, weights: bool = False):
    engine.runtime.settle()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    body = {
        "key": snapshot_key(engine),
        "layers": [
            {"slots": c.expert_in_slot.tolist(), "pinned": np.flatnonzero(c.pinned).tolist()}
            for c in engine.caches
        ],
        "weights": bool(weights),
    }
    if weights:
        arrays = {
            f"layer{i}.{name}": a
            for i, c in enumerate(engine.caches)
            for name, a in c.stacked_arrays().items()
        }
        mx.save_safetensors(str(path / "experts.safetensors"), arrays)
    tmp = path / "snapshot.json.tmp"
    tmp.write_text(json.dumps(body))
    tmp.replace(path / "snapshot.json")


def load_snapshot(engine, path):
    path = Path(path)
    meta_file = path / "snapshot.json"
    if not meta_file.is_file():
        raise UserError(
            f"{path} is not an od-moe snapshot (no snapshot.json): save one with Engine.save_snapshot"
        )
    try:
        body = json.loads(meta_file.read_text())
        key, layers = body["key"], body["layers"]
    except (json.JSONDecodeError, KeyError, TypeError):
        raise UserError(f"{meta_file} is unreadable: delete the snapshot and save a new one")
    expected = snapshot_key(engine)
    if key != expected:
        diff = ", ".join(
            f"{k}: snapshot {key.get(k)!r} vs engine {v!r}" for k, v in expected.items() if key.get(k) != v
        )
        raise UserError(
            f"snapshot {path} was saved for another configuration ({diff}): save a new snapshot for this one"
        )
    if len(layers) != len(engine.caches):
        raise UserError(
            f"snapshot {path} has {len(layers)} layers, the model {len(engine.caches)}: save a new snapshot"
        )
    packed = mx.load(str(path / "experts.safetensors")) if body.get("weights") else None
    for i, (cache, saved) in enumerate(zip(engine.caches, layers)):
        slots = np.asarray(saved["slots"], dtype=np.int64)
        if slots.shape != (cache.capacity,) or np.any(slots >= cache.num_experts):
            raise UserError(f"snapshot {path} layer {i} does not fit this cache: save a new snapshot")
        ids = slots[slots >= 0]
        if len(set(ids.tolist())) != len(ids):
            raise UserError(f"snapshot {path} layer {i} lists an expert twice: delete it and save a new one")
        if packed is not None:
            arrays = {name: packed.get(f"layer{i}.{name}") for name in cache.stacked_arrays()}
            try:
                cache.restore(slots, arrays)
            except ValueError:
                raise UserError(f"snapshot {path} has no matching weights for layer {i}: save a new snapshot")
        else:
            _read_into_slots(engine, cache, ids, slots)
        if saved.get("pinned"):
            cache.pin(slots[np.asarray(saved["pinned"], dtype=np.int64)])


def _read_into_slots(engine, cache, ids, saved_slots):
    """Read the saved experts from the model's files into the slots they had. A cleared cache fills
    slots 0..n-1 in order, which is what a saved cache filled the same way has; other orders are
    permuted so slot numbers match the snapshot."""
    cache.restore(np.full(cache.capacity, -1))
    engine.runtime.load(cache, ids)
    wanted = np.flatnonzero(saved_slots >= 0)
    current = cache.slot_of[ids]
    if np.array_equal(current, wanted):
        return
    permutation = np.arange(cache.capacity)
    permutation[wanted] = current
    cache.move(permutation, saved_slots)
