"""The per-layer path: each MoE layer learns its routing on the host, and what it misses is read from
the model's files into its slots before it computes.

A layer with a missing expert costs a host round trip: the host reads the routing, reads the missing
experts (`reader.py`, `loader.py`) and installs them in the layer's slots; prefetch policies read ahead
of need, from the routers of later layers or the shadow predictor (`policies.py`), as much as pays
(`governor.py`). It runs on every backend, and it is the path wherever host memory cannot hold the
experts, and on Metal, whose GPU shares the host's memory.

- `switch.py`: `OffloadedSwitch`, what replaces each MoE block's `switch_mlp`: the expert math over the
  slots `route` returns;
- `runtime.py`: `OffloadRuntime`, what happens at every MoE layer between routing and the expert math;
  `passes.py`, where generation stands (the clock the runtime and its reads share);
- `loader.py`: demand reads and installs, prefetches queued and installed;
- `reader.py`, `mlx_rows.py`: the read queue and its threads; on CUDA, the rows of MLX memory reads
  land in;
- `policies.py`, `governor.py`: what to prefetch, and how much;
- `optimistic.py`: decode passes with one host sync instead of one per partly resident layer.

Not here: the slots' bookkeeping and arrays, which both paths use (`od_moe/cache.py`, `slot_arrays.py`),
the model's files and reading bytes from them (`store.py`), mlx-lm's switch over other arrays
(`od_moe/switch.py`), the two-tier path (`od_moe/two_tier/`), the split over ranks (`od_moe/distributed/`).
"""
