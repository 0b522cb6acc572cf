"""Lab: where two-tier mode's load goes on this CPU (not product code): a layer's stack read as the
two-tier load once read it (`read_stack`, here), timed part by part (allocation, reads, dtype conversion,
writes into the host rows, the MLX array made from them, the byte-for-byte check) over every layer of the
model as a per-layer engine lays it out; then one `od_moe.load(M, capacity=0.25, two_tier=True)`, timed
whole (its reads are `two_tier/mapped.read_stacks` now).

  python3 lab/cold_start/read_stack_parts.py [MODEL]   (default /tmp/rs/q30-8: Qwen3-30B-A3B, 8 layers)
"""

import collections
import sys
import time

import mlx.core as mx
import numpy as np

import od_moe
from od_moe.memory import backend, cuda
from od_moe.storage.layout import ExpertRows
from od_moe.two_tier.mapped import READ_BATCH_BYTES, _target_bytes, _uint

T = collections.Counter()


def read_stack(store, layout, targets, slots, progress=None):
    t = time.perf_counter()
    E = layout.num_experts
    host = {
        (p.proj, p.name): np.zeros((E + slots, *p.shape), dtype=_uint(targets[(p.proj, p.name)].size))
        for p in layout.parts
    }
    batch = max(1, min(E, READ_BATCH_BYTES // max(1, layout.expert_nbytes)))
    staging = ExpertRows(layout, batch)
    T["alloc"] += time.perf_counter() - t
    for start in range(0, E, batch):
        ids = np.arange(start, min(E, start + batch))
        t = time.perf_counter()
        raw = store.read(layout, ids, staging)
        T["read"] += time.perf_counter() - t
        for p in layout.parts:
            key = (p.proj, p.name)
            t = time.perf_counter()
            b = _target_bytes(raw[key], p.dtype, targets[key])
            T["target"] += time.perf_counter() - t
            t = time.perf_counter()
            host[key][start : start + len(ids)] = b
            T["setitem"] += time.perf_counter() - t
        if progress is not None:
            t = time.perf_counter()
            progress.update(len(ids) * layout.expert_nbytes)
            T["progress"] += time.perf_counter() - t
    stacks = {}
    for key, rows in host.items():
        t = time.perf_counter()
        array = mx.array(rows)
        mx.eval(array)
        T["mx.array"] += time.perf_counter() - t
        t = time.perf_counter()
        seen = cuda.numpy_view(array)
        assert np.array_equal(seen, rows)
        T["equal"] += time.perf_counter() - t
        backend.map_for_device(array, array.nbytes // (E + slots) * slots)
        target = targets[key]
        stacks[key] = array if array.dtype == target else array.view(target)
    t = time.perf_counter()
    mx.eval(list(stacks.values()))
    T["eval"] += time.perf_counter() - t
    return stacks


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else "/tmp/rs/q30-8"
    plain = od_moe.load(model, capacity=0.25, prefetch="none", two_tier=False)  # its layers' layouts
    store = plain.runtime.store
    t = time.perf_counter()
    for cache in plain.caches:
        for array in read_stack(store, cache.layout, cache.targets, cache.capacity).values():
            backend.unmap(array)
    print("read_stack", time.perf_counter() - t, {k: round(v, 2) for k, v in T.items()})
    plain.close()
    t = time.perf_counter()
    od_moe.load(model, capacity=0.25, two_tier=True)
    print("load", time.perf_counter() - t)


if __name__ == "__main__":
    main()
