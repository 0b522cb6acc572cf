"""Decode passes past the host's memory: one host sync a token where every routed expert was in memory, and
an exact second run where one was on disk.

Where some experts are on disk (`host_tier.py`), a layer cannot compute a lane whose expert is not in a
device slot or a host row, and learning its routing before it computes costs a host sync per layer, which
a GPU pays in full (docs/GPU.md, "The per-layer path on CUDA"). `DiskPasses` runs a decode pass as mlx-lm
calls the model, through the runtime's methods (`TwoTierRuntime`, "past the host's memory"):
1. `begin_flagged_pass`: no layer waits; a lane whose expert is on disk reads a wrong row (a finite, wrong
   result) and is counted on the device.
2. `first_missing_layer`: the counts are read once, with the logits (the sync mlx-lm makes for the token
   anyway). None: the pass stands.
3. Else (`Missed`) its KV caches are trimmed and it runs again (`resume`): the layers before the first that
   missed as they ran (same inputs, so the same routing and rows), from that layer on each learning its
   routing and reading what is on disk before it computes. Before the second run starts, the experts the
   first run routed to from its first miss on are read ahead on the reader threads (`disk_prefetch` "routed":
   exact at the first missing layer, a forecast past it, whose inputs were wrong), so the layers of the
   second run find them read or in flight; "none": each layer reads its own (demand). The second run is
   flagged too: where a layer it did not run exactly missed (it cannot), it runs again from there.
A pass of several positions (a prompt), or one whose caches cannot be trimmed, runs exactly from its first
layer. The tokens are stock mlx-lm's in every case: no lane computes on a wrong row in a pass that stands.
Not here: the tiers and the reads (`host_tier.py`), the layer passes (`two_tier_runtime.py`).
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np


@dataclass(frozen=True)
class Missed:
    """A flagged pass that met an expert on disk: the first layer that did, and the experts the pass routed
    to by layer from there on (flat ids; exact at `first`)."""

    first: int
    routed: dict[int, np.ndarray]


class DiskPasses:
    """The model as mlx-lm's generation loop calls it (`model(inputs, cache=...)`), its decode passes flagged
    and run again where they met an expert on disk; every other attribute is the model's."""

    def __init__(self, model, runtime, prefetch: str = "routed"):
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "runtime", runtime)
        object.__setattr__(self, "prefetch", prefetch)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        runtime, tokens = self.runtime, inputs.shape[-1]
        if cache is None or tokens != 1 or not all(hasattr(c, "trim") and c.is_trimmable() for c in cache):
            return self.model(inputs, cache=cache, **kwargs)  # every layer exact
        runtime.begin_flagged_pass()
        try:
            logits = self.model(inputs, cache=cache, **kwargs)
            missed = runtime.first_missing_layer(logits)
            while missed is not None:
                self._read_ahead(missed)
                for c in cache:
                    c.trim(tokens)
                runtime.resume(missed.first)
                logits = self.model(inputs, cache=cache, **kwargs)
                missed = runtime.first_missing_layer(logits)
        except BaseException:
            runtime.cancel_flagged_pass()
            raise
        return logits

    def _read_ahead(self, missed: Missed):
        """Start the reads the second run will want: the first missing layer's experts, then (`routed`)
        those the first run routed to past it."""
        if self.prefetch == "none":
            return
        for layer in sorted(missed.routed):
            self.runtime.fetch_ahead(layer, missed.routed[layer])
