"""Warm start: save and restore the resident set of an engine's expert caches.

A snapshot is a folder with `snapshot.json` (its key, and per layer the expert in every slot and the pinned
slots) and, optionally, an experts file with the packed slot arrays for the fastest start. The key is
the model identity (config + safetensors headers), the capacity, the in-memory dtypes and the predictor;
a snapshot is never used for an engine with another key. Without weights, restoring reads the experts from
the model's own files.

Both files are written atomically and linked by content: the experts file is named after, and the json
records, the SHA-256 of its bytes, checked at load. The json is replaced last, so a save that fails or is
killed halfway leaves the previous snapshot whole; an experts file copied from another snapshot, or
truncated, is refused with a clear error instead of giving wrong tokens.
"""

import hashlib
import json
import os
from pathlib import Path
from typing import cast

import mlx.core as mx
import numpy as np

from ..errors import UserError
from ..progress import byte_progress

FORMAT = 2
META = "snapshot.json"


def snapshot_key(engine) -> dict:
    predictor = getattr(engine.predictor, "identity", None) if engine.predictor is not None else None
    dtypes = sorted({str(t) for c in engine.caches for t in c.targets.values()})
    key = {
        "format": FORMAT,
        "model": engine.identity,
        "capacity": engine.capacity,
        "num_experts": engine.num_experts,
        "moe_layers": len(engine.caches),
        "dtypes": dtypes,
        "predictor": predictor,
    }
    stage = getattr(engine, "stage", None)
    if stage is not None:  # one rank's layers (`distributed/rank_split.py`): never another rank's
        key["decoder_layers"] = [stage.start, stage.end]
    return key


def file_sha256(path: Path, bar=None) -> str:
    """The file's SHA-256 (hex); `bar`, a `Progress`, is moved by the bytes hashed."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(2**22):
            digest.update(block)
            if bar is not None:
                bar.update(len(block))
    return digest.hexdigest()


def _fsync(path: Path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_snapshot(engine, path, weights: bool = False):
    """Write the snapshot atomically (a UserError if the folder cannot be written; the previous snapshot,
    if any, is then left as it was)."""
    engine.runtime.settle()
    path = Path(path).expanduser()
    body = {
        "key": snapshot_key(engine),
        "layers": [
            {"slots": c.expert_in_slot.tolist(), "pinned": np.flatnonzero(c.pinned).tolist()}
            for c in engine.caches
        ],
        "weights": bool(weights),
    }
    tmp = path / f".experts-{os.getpid()}.tmp.safetensors"
    meta_tmp = path / f".{META}.{os.getpid()}.tmp"
    try:
        path.mkdir(parents=True, exist_ok=True)
        previous = _experts_file(path)
        if weights:
            arrays = {
                f"layer{i}.{name}": a
                for i, c in enumerate(engine.caches)
                for name, a in engine.runtime.slot_arrays(c).items()
            }
            nbytes = sum(a.nbytes for a in arrays.values())
            with byte_progress("saving snapshot", 2 * nbytes) as bar:  # writing, then hashing
                mx.save_safetensors(str(tmp), arrays)
                _fsync(tmp)
                bar.update(nbytes)
                body["experts_sha256"] = digest = file_sha256(tmp, bar)
            body["experts_file"] = experts_file = f"experts-{digest[:16]}.safetensors"
            tmp.replace(path / experts_file)
        meta_tmp.write_text(json.dumps(body))
        _fsync(meta_tmp)
        meta_tmp.replace(path / META)  # the commit point: before it, the previous snapshot is intact
    except (OSError, RuntimeError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise UserError(f"cannot save a snapshot to {path} ({reason}): choose a writable folder with space")
    finally:
        for leftover in (tmp, meta_tmp):
            leftover.unlink(missing_ok=True)
    if previous is not None and previous != body.get("experts_file"):
        (path / previous).unlink(missing_ok=True)  # nothing refers to it any more


def _experts_file(path: Path) -> str | None:
    """The experts file the snapshot at `path` refers to now, if any."""
    try:
        return json.loads((path / META).read_text()).get("experts_file")
    except (OSError, ValueError, AttributeError):
        return None


def _load_experts(path: Path, body: dict, bar=None) -> dict[str, mx.array]:
    """The packed slot arrays of a snapshot, after checking the file is the one its json was saved with."""
    name, expected = body.get("experts_file"), body.get("experts_sha256")
    if not isinstance(name, str) or not isinstance(expected, str) or Path(name).name != name:
        raise UserError(f"snapshot {path} names no valid experts file: delete it and save a new one")
    file = path / name
    if not file.is_file():
        raise UserError(f"snapshot {path} is missing its experts file {name}: save a new snapshot")
    if file_sha256(file, bar) != expected:
        raise UserError(
            f"snapshot {path}: {name} is not the file this snapshot was saved with (its content hash "
            "differs: truncated, or copied from another snapshot); save a new snapshot"
        )
    try:
        # a .safetensors file, no metadata asked for: mx.load returns its arrays by name (its annotation is
        # the union over every format)
        return cast(dict[str, mx.array], mx.load(str(file)))
    except (RuntimeError, ValueError) as e:
        raise UserError(f"snapshot {path}: {name} cannot be read ({e}): save a new snapshot")


def load_snapshot(engine, path):
    path = Path(path).expanduser()
    meta_file = path / META
    if not meta_file.is_file():
        raise UserError(
            f"{path} is not an od-moe snapshot (no snapshot.json): save one with `od-moe generate "
            "--save-snapshot DIR` (Engine.save_snapshot in Python)"
        )
    try:
        body = json.loads(meta_file.read_text())
        key, layers = body["key"], body["layers"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError):
        raise UserError(f"{meta_file} is unreadable: delete the snapshot and save a new one")
    expected = snapshot_key(engine)
    if key != expected:
        diff = ", ".join(
            f"{k}: snapshot {key.get(k)!r} vs engine {expected.get(k)!r}"
            for k in sorted(set(expected) | set(key))
            if key.get(k) != expected.get(k)
        )
        raise UserError(
            f"snapshot {path} was saved for another configuration ({diff}): save a new snapshot for this one"
        )
    if len(layers) != len(engine.caches):
        raise UserError(
            f"snapshot {path} has {len(layers)} layers, the model {len(engine.caches)}: save a new snapshot"
        )
    packed_file = path / str(body.get("experts_file"))
    packed_bytes = packed_file.stat().st_size if body.get("weights") and packed_file.is_file() else 0
    fill_bytes = sum(
        (c.slot_nbytes if packed_bytes else c.layout.expert_nbytes) * c.capacity for c in engine.caches
    )
    with byte_progress("loading snapshot", packed_bytes + fill_bytes) as bar:  # hashing, then filling
        packed = _load_experts(path, body, bar) if body.get("weights") else None
        _fill(engine, path, layers, packed, bar)


def _fill(engine, path: Path, layers: list, packed: dict | None, bar):
    """Put the saved experts into every layer's slots (`Runtime.place`), with their bytes where saved."""
    for i, (cache, saved) in enumerate(zip(engine.caches, layers)):
        slots = np.asarray(saved["slots"], dtype=np.int64)
        if slots.shape != (cache.capacity,) or np.any(slots >= cache.num_experts):
            raise UserError(f"snapshot {path} layer {i} does not fit this cache: save a new snapshot")
        ids = slots[slots >= 0]
        if len(set(ids.tolist())) != len(ids):
            raise UserError(f"snapshot {path} layer {i} lists an expert twice: delete it and save a new one")
        arrays = None
        if packed is not None:
            arrays = {name: packed.get(f"layer{i}.{name}") for name in engine.runtime.slot_arrays(cache)}
        try:
            engine.runtime.place(cache, slots, arrays)
        except ValueError:
            if arrays is None:
                raise
            raise UserError(f"snapshot {path} has no matching weights for layer {i}: save a new snapshot")
        if saved.get("pinned"):
            cache.pin(slots[np.asarray(saved["pinned"], dtype=np.int64)])
        bar.update((cache.slot_nbytes if packed is not None else cache.layout.expert_nbytes) * cache.capacity)
