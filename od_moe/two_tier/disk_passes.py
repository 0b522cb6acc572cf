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
3. Else (`Missed`) the experts its first missing layer routed to are read (its inputs were right, so its
   routing is known), and with `disk_prefetch` "routed" those it routed to past that layer (a forecast:
   their inputs were wrong), all at once on the reader threads. Its KV caches are trimmed and it runs
   again (`resume`): the layers before the first that missed as they ran (same inputs, so the same routing
   and rows); from that layer on, with `disk_rerun` "flagged", flagged again once the reads landed (a layer
   whose routing changed may miss again: it runs again from there, the `FLAGGED_RUNS`th time exactly), or
   with "exact" each layer learning its routing (a host sync) and reading what is on disk before it
   computes, finding the reads ahead landed or in flight.
A pass of several positions (a prompt), or one whose caches cannot be trimmed, runs exactly from its first
layer. The tokens are stock mlx-lm's in every case: no lane computes on a wrong row in a pass that stands.
Not here: the tiers and the reads (`host_tier.py`), the layer passes (`two_tier_runtime.py`).
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .settings import FLAGGED_RUNS


class StoppedAt(Exception):
    """A flagged pass stopped at its first layer with an absent lane (`TwoTierRuntime._watch_flags`)."""

    def __init__(self, layer: int):
        super().__init__(f"a flagged pass met an expert on disk at MoE layer {layer}")
        self.layer = layer


@dataclass(frozen=True)
class Missed:
    """A flagged pass that met an expert on disk: the first layer that did, and the experts the pass routed
    to by layer from there on (flat ids; exact at `first`)."""

    first: int
    routed: dict[int, np.ndarray]


class DiskPasses:
    """The model as mlx-lm's generation loop calls it (`model(inputs, cache=...)`), its decode passes flagged
    and run again where they met an expert on disk; every other attribute is the model's."""

    def __init__(self, model, runtime, prefetch: str = "routed", rerun: str = "flagged"):
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "runtime", runtime)
        object.__setattr__(self, "prefetch", prefetch)
        object.__setattr__(self, "rerun", rerun)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        runtime, tokens = self.runtime, inputs.shape[-1]
        if cache is None or tokens != 1 or not all(hasattr(c, "trim") and c.is_trimmable() for c in cache):
            return self.model(inputs, cache=cache, **kwargs)  # every layer exact
        offsets = [getattr(c, "offset", None) for c in cache]
        # a run may stop early where each cache says how far it was written (a batch's caches do not)
        runtime.begin_flagged_pass(stop_early=all(isinstance(o, int) for o in offsets))
        try:
            missed, runs = self._run(inputs, cache, kwargs), 1
            while not isinstance(missed, mx.array):
                exact = self.rerun == "exact" or runs >= FLAGGED_RUNS
                self._read_ahead(missed)
                if not exact:  # the run's tables hold what landed before it
                    runtime.wait_for_reads()
                _trim(cache, offsets, tokens)
                runtime.resume(missed.first, exact)
                missed, runs = self._run(inputs, cache, kwargs), runs + 1
        except BaseException:
            runtime.cancel_flagged_pass()
            raise
        return missed

    def _run(self, inputs: mx.array, cache, kwargs) -> "mx.array | Missed":
        """A flagged run of the model: its logits where it stands, else what it missed (where it stopped
        early, or where its flags said so with the logits)."""
        try:
            logits = self.model(inputs, cache=cache, **kwargs)
        except StoppedAt as stopped:
            return self.runtime.stopped_pass(stopped.layer)
        missed = self.runtime.first_missing_layer(logits)
        return logits if missed is None else missed

    def _read_ahead(self, missed: "Missed"):
        """Start the reads the next run will want: the first missing layer's experts (its routing, known),
        then (`routed`) those the run routed to past it (a forecast: their inputs were wrong)."""
        first, *later = sorted(missed.routed)
        self.runtime.fetch_ahead(first, missed.routed[first], ahead=False)
        if self.prefetch == "routed":
            for layer in later:
                self.runtime.fetch_ahead(layer, missed.routed[layer])


def _trim(cache, offsets: list, tokens: int):
    """Take back what a run wrote into the KV caches: back to `offsets` (a run that stopped early wrote
    only the layers it reached), or `tokens` from each where a cache's offset is not a count (a batch's
    runs do not stop early)."""
    for c, offset in zip(cache, offsets):
        written = c.offset - offset if isinstance(offset, int) else tokens
        if written:
            c.trim(written)
