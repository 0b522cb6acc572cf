"""The two-tier path: where the GPU has memory of its own (CUDA) and the host holds every expert, misses
are read in place from host memory by the kernels that need them, hits computed on device slots, and no
pass waits for the host.

- `two_tier_runtime.py`: `TwoTierRuntime` (a `runtime.Runtime`) and `build`: the stacks, the tables, a
  layer's pass top to bottom (`layer_pass`) and what is booked of it; `settings.py`: how the path runs
  (`TwoTierSettings`, given to `build` once);
- `layer_step.py`: what the mode puts into the model, how a pass's lanes find their rows (`Lanes`), and a
  layer's pass of one position as one compiled call;
- `mapped.py`: every expert of a layer in host memory, as MLX arrays the GPU reads in place;
- `admission.py`, `tally.py`: which experts earn a slot, from routing counted on the device;
- `slot_fill.py`, `host_ring.py`: filling slots between passes, and the host-written tables and moves;
- `kept_rows.py`, `forecast.py`: rows kept by the device (least recently used, and experts forecast for
  a later layer copied ahead), and the forecasts from earlier layers;
- `staged_passes.py`: passes of several positions computed on a device copy of their experts;
- `bus_probe.py`: how fast experts cross the bus either way (`TwoTierRuntime.transfer_rates`);
- `kernels.py`: every CUDA kernel source of the path (slot fills, device-kept rows, staged passes).

On the CPU and Metal the same code runs on plain memory (the tests run it there). Not here: choosing the
path (`od_moe/assembly.py`), reading experts from the model's files (`storage/store.py`), the slots'
bookkeeping (`caching/layer_cache.py`), the per-layer path (`od_moe/per_layer/`).
"""

from .settings import AdmissionSettings, ForecastSettings, KeptRowsSettings, TwoTierSettings
from .two_tier_runtime import build

__all__ = ["build", "AdmissionSettings", "ForecastSettings", "KeptRowsSettings", "TwoTierSettings"]
