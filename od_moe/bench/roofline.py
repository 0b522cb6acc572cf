"""The machine's roofline for a benchmark row, from bandwidths the bench measures itself on this machine.

A decode step cannot beat max(resident step time, bytes read per token / read bandwidth, bytes installed
per token / install bandwidth) (../shared/DESIGN.md). Measured here:
- read bandwidth: the engine's own reader (`reader.Reader`, demand reads of whole experts, making their
  MLX arrays where the backend needs them, as in the engine) at queue depths 1, 2, 4 and 8, cold (page
  cache dropped, direct I/O) or warm (from the page cache); the best
  depth counts;
- the disk's rate (`disk_rate`, for rows past the host's memory): the same reads past the page cache,
  each count of reads in flight (1-16) sustained for its seconds (20 by default), the best the disk's;
- install bandwidth: the backend's install path (`LayerCache.install`: numpy writes into host memory on
  the CPU and Metal; on CUDA one MLX write per part from the flat arrays the reader threads made, as
  the engine's reads come, evaluated), from bytes already in memory.
A row's `x roofline` is the roofline step time over its measured step time (1.0: at the machine's limit).
Not here: running the rows (`prefetch.py`).
"""

import time

import numpy as np

from .. import load
from ..accounting.ledger import Ledger
from ..engine import model_layouts
from ..memory import backend
from ..per_layer.reader import Reader

DEPTHS = (1, 2, 4, 8)


def read_bandwidth(path, cold: bool, experts_per_depth: int = 32, seed: int = 0) -> dict:
    """Bytes per second of whole-expert reads by the engine's reader at each depth; and the best."""
    store, layouts = model_layouts(str(path), packed="auto")  # packed where the engine's reads are
    if cold:
        store.use_direct_io(True)
        store.drop_pages_after_read()
    rng = np.random.default_rng(seed)
    by_depth = {}
    for depth in DEPTHS:
        reader = Reader(
            store,
            layouts,
            Ledger(len(layouts)),
            threads=depth,
            make_arrays=not backend.arrays_in_host_memory(),
        )
        nbytes, seconds = 0, 0.0
        for _ in range(max(1, experts_per_depth // depth)):
            layer = int(rng.integers(len(layouts)))
            ids = rng.choice(layouts[layer].num_experts, size=depth, replace=False)
            if cold:
                store.drop_page_cache()
            t0 = time.perf_counter()
            reads, _ = reader.fetch(layer, ids)
            seconds += time.perf_counter() - t0
            nbytes += sum(r.nbytes for r in reads)
            reader.recycle(reads, installed=False)
        reader.close()
        by_depth[depth] = nbytes / seconds
    store.close()
    best = max(by_depth, key=by_depth.__getitem__)
    return {"bytes_per_s": by_depth[best], "depth": best, "by_depth": by_depth}


PROBE_THREADS = (1, 2, 4, 8, 16)


def disk_rate(
    path, seconds: float = 20.0, threads=PROBE_THREADS, seed: int = 0, clock=time.perf_counter
) -> dict:
    """The disk's rate for the engine's reads, past the page cache: random whole experts read by the
    engine's reader (`per_layer/reader.Reader`, one read an expert, `n` in flight) for `seconds` at each
    `n` of `threads` (as many as a layer has experts at most), the best of them the disk's. Where the file
    system refuses direct I/O the reads come from the page cache and `direct_io_refused` says why: such a
    rate is not the disk's. `clock`: seconds, for a test's own pace."""
    store, layouts = model_layouts(str(path), packed="auto")  # packed where the engine's reads are
    direct = store.use_direct_io(True)
    rng = np.random.default_rng(seed)
    by_threads: dict[int, float] = {}
    for n in threads:
        reader = Reader(store, layouts, Ledger(len(layouts)), threads=n, make_arrays=False)
        nbytes, start = 0, clock()
        while not nbytes or clock() - start < seconds:
            layer = int(rng.integers(len(layouts)))
            count = min(n, layouts[layer].num_experts)
            reads, _ = reader.fetch(layer, rng.choice(layouts[layer].num_experts, size=count, replace=False))
            nbytes += sum(r.nbytes for r in reads)
            reader.recycle(reads, installed=False)
        by_threads[n] = nbytes / (clock() - start)
        reader.close()
    refused = store.direct_io_refused
    store.close()
    best = max(by_threads, key=by_threads.__getitem__)
    return {
        "bytes_per_s": by_threads[best],
        "threads": best,
        "by_threads": by_threads,
        "seconds": seconds,
        "direct_io": direct,
        "direct_io_refused": refused,
    }


def install_bandwidth(path, experts: int = 8, repeats: int = 4) -> float:
    """Bytes per second the backend installs read experts into a layer's slots: the per-layer path's
    `transfer_rates` on an engine of `experts` slots a layer (`per_layer_runtime.PerLayerRuntime`)."""
    engine = load(str(path), capacity=experts, prefetch="none", two_tier=False)
    rate = engine.runtime.transfer_rates(repeats)["installed"]
    engine.close()
    return rate


def roofline_ms(
    resident_ms: float, read_bytes: float, read_bw: float, install_bytes: float, install_bw: float
):
    """The fastest a decode step can be, in ms, and which bound sets it."""
    bounds = {
        "compute": resident_ms,
        "read": 1e3 * read_bytes / read_bw,
        "install": 1e3 * install_bytes / install_bw,
    }
    bound = max(bounds, key=bounds.__getitem__)
    return bounds[bound], bound
