"""The per-layer path: each MoE layer learns its routing on the host, and what it misses is read from
the model's files into its slots before it computes.

A layer with a missing expert costs a host round trip: the host reads the routing, reads the missing
experts (`reader.py`, `loader.py`) and installs them in the layer's slots; prefetch policies read ahead
of need, from the routers of later layers or the shadow predictor (`prefetch/policies.py`), as much as pays
(`prefetch/governor.py`). It runs on every backend, and it is the path wherever host memory cannot hold the
experts, and on Metal, whose GPU shares the host's memory.

- `settings.py`: `PerLayerSettings`, how the path runs (miss policy, read threads, optimistic passes, split
  rounds, installs), given to `build` once: nothing writes into the runtime afterwards;
- `offloaded_switch.py`: `OffloadedSwitch`, what replaces each MoE block's `switch_mlp`: the expert math over
  the slots `route` returns;
- `per_layer_runtime.py`: `PerLayerRuntime`, the path's `Runtime` (`od_moe/runtime.py`) and `build`; its
  `route`, read top to bottom, is what happens at every MoE layer between routing and the expert math;
  `passes.py`, where generation stands (the clock the runtime and its reads share);
- `loader.py`: demand reads and installs, prefetches queued and installed, the install rate measured;
- `reader.py`, `mlx_rows.py`: the read queue and its threads; on CUDA, the rows of MLX memory reads land in;
- `optimistic.py`: decode passes with one host sync instead of one per partly resident layer, run through
  the runtime's methods.

Not here: what to prefetch and how much (`od_moe/prefetch/`), the slots' bookkeeping and arrays, which both
paths use (`od_moe/caching/`), the model's files and reading bytes from them (`od_moe/storage/`), mlx-lm's
switch over other arrays (`od_moe/model_surgery/switch_over.py`), the two-tier path (`od_moe/two_tier/`),
the split over ranks (`od_moe/distributed/`).
"""

from .per_layer_runtime import build
from .settings import PerLayerSettings

__all__ = ["build", "PerLayerSettings"]
