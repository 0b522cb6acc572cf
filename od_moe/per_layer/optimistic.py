"""Decode passes with one host sync instead of one per partly resident layer.

In exact mode a layer whose experts are not all resident learns its routing before it computes: one host
round trip per layer, which a fast GPU pays in full (its next kernels are launched only after the sync).
When recent tokens rarely missed, `OptimisticModel` runs a decode pass without those syncs, through the
runtime's methods (`PerLayerRuntime`, "optimistic decode passes"):
1. `begin_optimistic_pass`: every partly resident layer computes on its lookup table (an absent expert
   computes on slot 0: a wrong but finite result) and leaves a lazy flag saying whether any routed expert
   was absent.
2. `first_missing_layer`: the flags are read once, with the logits. None set: the pass stands, and its
   lookups are booked (and recorded, where the routing is being recorded) as exact mode books them.
3. Otherwise the pass is taken back (every KV cache trimmed by its tokens) and run again
   (`resumed_pass`): the layers before the first that missed compute as they did, with no sync (their
   inputs, so their routing, are the same) and no booking (done in step 2); from that layer on, the exact
   path loads what is missing. The tokens, and with the on-demand policy every count, are those of exact
   mode.
Used for single-token passes with trimmable KV caches, while no prefetch runs (prefetching from such passes
waited for reads with the device idle, lost to a sync per layer, and was removed: docs/GPU.md, "Optimistic
passes with prefetch (removed)"), where `PerLayerSettings.optimistic` is on (by default where a sync stalls
the device, a GPU: on the CPU backend a sync costs little and the second runs cost more than the syncs saved;
docs/BENCHMARKS.md, "Investigations"); the runtime then decides from how often recent decode tokens missed
(`may_pass_optimistically`).
Not here: the per-layer path (`per_layer_runtime.py`).
"""

import mlx.core as mx

# decode passes run optimistically while the share of recent decode tokens that missed somewhere (the
# runtime's token miss rate) is below this: a pass that misses costs a second pass from its first missing
# layer, one that does not saves a sync per partly resident layer
OPTIMISTIC_BELOW = 0.5


class OptimisticModel:
    """The model as mlx-lm's generation loop calls it (`model(inputs, cache=...)`), with optimistic decode
    passes where the runtime allows them; every other attribute is the model's."""

    def __init__(self, model, runtime):
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "runtime", runtime)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        runtime, tokens = self.runtime, inputs.shape[-1]
        if (
            cache is None
            or tokens != 1
            or not runtime.may_pass_optimistically()
            or not all(hasattr(c, "trim") and c.is_trimmable() for c in cache)
        ):
            return self.model(inputs, cache=cache, **kwargs)
        runtime.begin_optimistic_pass()
        try:
            logits = self.model(inputs, cache=cache, **kwargs)
        except BaseException:
            runtime.cancel_optimistic_pass()
            raise
        first_miss = runtime.first_missing_layer(logits)
        if first_miss is None:
            return logits
        for c in cache:
            c.trim(tokens)
        with runtime.resumed_pass(first_miss):
            return self.model(inputs, cache=cache, **kwargs)
