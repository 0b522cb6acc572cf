"""The module that replaces an MoE block's `switch_mlp`: the forward math over the resident slots.

mlx-lm's own `SwitchGLU`/`SwitchMLP` instance (`inner`) still does the math; its projections hold C stacked
slots instead of E experts. Once per layer the switch asks the runtime for the slots of the routed experts
(`PerLayerRuntime.route`) and computes on them. When a layer needs more distinct experts than it has slots (a
batch, or a long prefill chunk, at a small capacity), the route carries the stacks to compute on instead:
the slots followed by the experts that did not fit, in one computation. After a layer whose routing the host
waited for, its computation is started at once (`mx.async_eval`), so the device works while the next layer
is built (measured in docs/BENCHMARKS.md, "Investigations"). A decode token's layer that misses may come in
two rounds of positions (`Route.lanes`): its resident experts, started at once so that they compute while
the runtime reads the missing ones, then those; the outputs are put back in routing order. In skip mode a
route carries a per-expert scale that zeroes missing experts and renormalises the others.
Not here: lookups and prefetch (`per_layer_runtime.py`), reads and installs (`loader.py`).
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..model_surgery.switch_over import switch_on


class OffloadedSwitch(nn.Module):
    """Drop-in `switch_mlp` over a bounded cache of resident experts."""

    def __init__(self, inner: nn.Module, runtime, layer: int):
        super().__init__()
        self.inner = inner
        self.layer = layer  # position among the model's MoE blocks
        object.__setattr__(self, "runtime", runtime)  # a plain attribute, not a child module

    def __call__(self, hidden: mx.array, indices: mx.array) -> mx.array:
        whole, lanes = [], []  # a round of every routed expert; rounds of some of them, with their positions
        for route in self.runtime.route(self.layer, hidden, indices):
            switch = self.inner if route.stacks is None else switch_on(self.inner, route.stacks)
            y = switch(hidden, route.slots)
            if route.scale is not None:
                y = y * route.scale[..., None].astype(y.dtype)
            if route.lanes is not None:  # computes now, while the runtime reads the next round's experts
                mx.async_eval(y)
                lanes.append((route.lanes, y))
            else:
                whole.append(y)
        if lanes:  # each routed expert's output back at its position
            order = np.argsort(np.concatenate([at for at, _ in lanes]))
            out = mx.take(
                mx.concatenate([y for _, y in lanes], axis=-2), mx.array(order.astype(np.int32)), axis=-2
            )
        else:
            (out,) = whole
        if route.launch:  # the device idled while the host synced: it computes while the next layer is built
            mx.async_eval(out)
        return out
