"""The module that replaces an MoE block's `switch_mlp`: the forward math over the resident slots.

mlx-lm's own `SwitchGLU`/`SwitchMLP` instance (`inner`) still does the math; its projections hold C
stacked slots instead of E experts. Once per layer the switch asks the runtime for the slots of the
routed experts (`OffloadRuntime.route`) and computes on them. The runtime answers with one `Route`, or, when
a layer needs more distinct experts than it has slots (a long prefill chunk at a small capacity), one
per round: each round computes the experts that fit and the outputs are merged per routed expert before
mlx-lm's weighted sum, so the result is the same. After a layer whose routing the host waited for, its
computation is started at once (`mx.async_eval`), so the device works while the next layer is built
(`benchmarks/sync_path.py --switch launch_early`). In skip mode a route carries a per-expert scale that
zeroes missing experts and renormalises the others.
Not here: lookups, reads, installs or prefetch (`runtime.py`).
"""

import mlx.core as mx
import mlx.nn as nn


class OffloadedSwitch(nn.Module):
    """Drop-in `switch_mlp` over a bounded cache of resident experts."""

    def __init__(self, inner: nn.Module, runtime, layer: int):
        super().__init__()
        self.inner = inner
        self.layer = layer  # position among the model's MoE blocks
        object.__setattr__(self, "runtime", runtime)  # a plain attribute, not a child module

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        out = None
        for route in self.runtime.route(self.layer, x, indices):
            y = self.inner(x, route.slots)
            if route.scale is not None:
                y = y * route.scale[..., None].astype(y.dtype)
            if route.members is None:
                out = y
            else:
                out = y if out is None else mx.where(route.members[..., None], y, out)
                mx.eval(out)  # the next round overwrites slots this one read
        if route.launch:  # the device idled while the host synced: it computes while the next layer is built
            mx.async_eval(out)
        return out
