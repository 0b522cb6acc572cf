"""Install paths on this backend: how fast read expert bytes get into a layer's stacked slot arrays.

Each variant installs a batch of experts (bytes already in host memory, as the reader leaves them) into
C stacked slots shaped like a real layer's, checks the slots hold exactly those bytes, and reports
microseconds per expert (median over rounds) and GB/s:
- `rows`: per part, one MLX array from the stacked rows, then one slice update per slot (the path of
  `LayerCache` on CUDA before batching);
- `flat`: one flat host array for the whole batch (part-major), one MLX array, per part a view into it,
  one slice update per slot;
- `flat-scatter`: the same, one scatter per part for all slots;
- `premade-slices`: per expert and part an MLX array made beforehand (what a reader thread can do: only
  the device copies are timed), one slice update per slot;
- `premade-scatter`: the same arrays stacked per part, one scatter per part;
- `load`: the flat bytes through `mx.load` of an in-memory safetensors file (a host-to-device copy
  instead of managed memory on CUDA), then as `flat`;
- `engine`: `LayerCache.install` itself on the MLX path (what CUDA runs): one flat array per expert made
  beforehand (as the reader threads make them), stacked, per part a view of its columns and one scatter
  (a slice update for one expert), evaluated; `make us` is the reader's part, making those arrays from
  the read bytes (in buffers MLX recycles from the round before, as in a running engine);
- `engine-staged`: the same with the arrays `backend.stage_for_device` keeps in host memory mapped for
  the GPU (CUDA managed memory: neither the host's writes nor the GPU's read migrate pages). After
  `engine`, whose buffers it then advises once: the advice stays with the memory;
- `engine-host`: `LayerCache.install` writing from the read bytes with no MLX operation: numpy views of
  host memory (what the CPU and Metal run), or on CUDA the runtime's copies from pinned staging
  (`OffloadRuntime.copy_installs`, off by default there), the wait for them included.

    python benchmarks/installs.py [--model PATH] [--widen 128] [--batch 1,8] [--rounds 7]
"""

import argparse
import io
import json
import struct
import tempfile
import time

import mlx.core as mx
import numpy as np

import od_moe
from od_moe import backend
from od_moe.bench.widen import widen_model
from od_moe.layout import Staging, flat_rows
from od_moe.report import table
from od_moe.store import ExpertStore

MX_OF = {"U32": mx.uint32, "BF16": mx.bfloat16, "F16": mx.float16, "F32": mx.float32, "U8": mx.uint8}


def _parts(layout):
    return [(p.proj, p.name, p.dtype, tuple(p.shape), p.nbytes) for p in layout.parts]


def _flat(parts, raw, n):
    """Part-major flat bytes of n experts: part p's n rows are contiguous."""
    return np.concatenate(
        [raw[(proj, name)][:n].reshape(n, -1).view(np.uint8).reshape(-1) for proj, name, *_ in parts]
    )


def _views(parts, flat: mx.array, n):
    out, start = [], 0
    for _, _, dtype, shape, nbytes in parts:
        out.append(flat[start : start + n * nbytes].view(MX_OF[dtype]).reshape(n, *shape))
        start += n * nbytes
    return out


def _safetensors(flat: np.ndarray) -> io.BytesIO:
    header = json.dumps(
        {"flat": {"dtype": "U8", "shape": [flat.size], "data_offsets": [0, flat.size]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    return io.BytesIO(struct.pack("<Q", len(header)) + header + flat.tobytes())


def _premade(parts, raw, n):
    out = []
    for j in range(n):
        arrays = [mx.array(raw[(proj, name)][j]) for proj, name, *_ in parts]
        out.append([a.view(MX_OF[p[2]]) if p[2] == "BF16" else a for a, p in zip(arrays, parts)])
    return out


def _install(variant, stacked, parts, raw, slots, premade=None):
    n = len(slots)
    if variant.startswith("premade"):
        index = mx.array(np.asarray(slots, dtype=np.int32))
        for p, target in enumerate(stacked):
            if variant == "premade-scatter":
                target[index] = mx.stack([made[p] for made in premade])
            else:
                for j, s in enumerate(slots):
                    target[s] = premade[j][p]
    elif variant == "rows":
        for (proj, name, dtype, _, _), target in zip(parts, stacked):
            rows = mx.array(raw[(proj, name)][:n])
            rows = rows.view(MX_OF[dtype]) if dtype == "BF16" else rows
            for j, s in enumerate(slots):
                target[s] = rows[j]
    else:
        if variant == "load":
            flat = mx.load(_safetensors(_flat(parts, raw, n)), format="safetensors")["flat"]
        else:
            flat = mx.array(_flat(parts, raw, n))
        index = mx.array(np.asarray(slots, dtype=np.int32))
        for rows, target in zip(_views(parts, flat, n), stacked):
            if variant == "flat-scatter":
                target[index] = rows
            else:
                for j, s in enumerate(slots):
                    target[s] = rows[j]
    mx.eval(stacked)


def measure(path, batch: int, rounds: int) -> list[dict]:
    store = ExpertStore(path)
    engine = od_moe.load(str(path), capacity=1, prefetch="none")
    layout = engine.caches[0].layout
    engine.close()
    parts = _parts(layout)
    capacity = 4 * batch
    staging = Staging(layout, 2 * batch)
    raw = store.read(layout, np.arange(2 * batch), staging)
    # a pure-numpy cast of BF16 raw bits: the stacked arrays keep the checkpoint's dtypes
    stacked = [mx.zeros((capacity, *shape), dtype=MX_OF[dtype]) for _, _, dtype, shape, _ in parts]
    mx.eval(stacked)
    rows = []
    for variant in ("rows", "flat", "flat-scatter", "premade-slices", "premade-scatter", "load"):
        times = []
        for r in range(rounds + 1):
            slots = list(range((r % 4) * batch, (r % 4) * batch + batch))
            premade = _premade(parts, raw, batch) if variant.startswith("premade") else None
            t0 = time.perf_counter()
            _install(variant, stacked, parts, raw, slots, premade)
            if r:
                times.append(time.perf_counter() - t0)
        for (proj, name, dtype, _, _), target in zip(parts, stacked):
            got = np.array(
                target[mx.array(slots)].view(mx.uint8) if dtype != "U8" else target[mx.array(slots)]
            )
            want = raw[(proj, name)][:batch].view(np.uint8).reshape(got.shape)
            assert np.array_equal(got, want), f"{variant}: {proj}.{name} differs"
        rows.append(_row(variant, batch, times, layout.expert_nbytes))
    for mode in ("engine", "engine-staged", "engine-host"):
        rows.append(_engine_path(path, store, layout, batch, rounds, mode))
    store.close()
    return rows


def _engine_path(path, store, layout, batch: int, rounds: int, mode: str) -> dict:
    """The `engine` variants: two sets of `batch` experts installed in turn into a cache of `batch` slots."""
    engine = od_moe.load(str(path), capacity=batch, prefetch="none", dtype="model")  # the checkpoint's bytes
    engine.runtime.copy_installs = mode == "engine-host"
    cache = engine.caches[0]
    sets = [np.arange(batch) + batch * n for n in range(2)]
    raws = [store.read(layout, ids, Staging(layout, batch)) for ids in sets]
    times, make_times = [], []
    stage = backend.stage_for_device if mode == "engine-staged" else (lambda a: a)
    for r in range(rounds + 1):
        ids, raw = sets[r % 2], raws[r % 2]
        t0 = time.perf_counter()
        made = (
            None if mode == "engine-host" else [stage(mx.array(row)) for row in flat_rows(layout, raw, batch)]
        )
        mx.eval(made)
        t1 = time.perf_counter()
        slots = cache.install(ids, raw, clock=r, arrays=made).slots
        mx.eval(list(cache.stacked_arrays().values()))
        del made  # back to MLX's buffer cache, for the next round's arrays
        if r:
            make_times.append(t1 - t0)
            times.append(time.perf_counter() - t1)
        for part in layout.parts:
            got = np.array(cache.projections[part.proj][part.name][mx.array(slots)].view(mx.uint8))
            want = raw[(part.proj, part.name)].view(np.uint8).reshape(got.shape)
            assert np.array_equal(got, want), f"{mode}: {part.proj}.{part.name} differs"
    if mode == "engine-host" and not cache.host_writes:
        mode += " (fell back to MLX writes)"
    engine.close()
    return _row(
        mode, batch, times, layout.expert_nbytes, None if mode.startswith("engine-host") else make_times
    )


def _row(variant: str, batch: int, times: list[float], expert_nbytes: int, make_times=None) -> dict:
    """A table row: microseconds per expert (median over rounds) and GB/s; with the reader's part
    (`make_times`), also that and the GB/s of both together."""
    per = float(np.median(times)) / batch
    make = None if make_times is None else float(np.median(make_times)) / batch
    return {
        "variant": variant,
        "batch": batch,
        "us/expert": round(1e6 * per, 1),
        "GB/s": round(expert_nbytes / per / 1e9, 2),
        "make us": "-" if make is None else round(1e6 * make, 1),
        "GB/s with make": "-" if make is None else round(expert_nbytes / (per + make) / 1e9, 2),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(od_moe.DEFAULT_MODEL))
    parser.add_argument("--widen", type=int, default=128, help="also a widened copy (0: not)")
    parser.add_argument("--batch", default="1,8")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    print(f"mlx {mx.__version__} on {mx.default_device()}")
    models = [("bundled", args.model)]
    if args.widen:
        tmp = tempfile.mkdtemp()
        models.append((f"widened x{args.widen}", str(widen_model(args.model, f"{tmp}/w", args.widen))))
    out = []
    for label, path in models:
        for batch in (int(b) for b in args.batch.split(",")):
            out += [{"model": label, **row} for row in measure(path, batch, args.rounds)]
    print(table(list(out[0]), [list(r.values()) for r in out]))


if __name__ == "__main__":
    main()
