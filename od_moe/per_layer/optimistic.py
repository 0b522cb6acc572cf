"""Decode passes with one host sync instead of one per partly resident layer.

In exact mode a layer whose experts are not all resident learns its routing before it computes: one host
round trip per layer, which a fast GPU pays in full (its next kernels are launched only after the sync).
When recent tokens rarely missed, `OptimisticModel` runs a decode pass without those syncs:
1. Every partly resident layer computes on its lookup table (an absent expert computes on slot 0: a wrong
   but finite result) and leaves a lazy flag saying whether any routed expert was absent
   (`PerLayerRuntime.route`, while `runtime.speculative` collects them).
2. The flags are read once, with the logits (`_first_miss`). None set: the pass stands,
   and its lookups are booked (and recorded, where the routing is being recorded) as exact mode books
   them.
3. Otherwise the pass is taken back (every KV cache trimmed by its tokens) and run again: the layers
   before the first that missed compute as they did, with no sync (their inputs, so their routing, are
   the same) and no booking (done in step 2); from that layer on, the exact path loads what is missing.
   The tokens, and with the on-demand policy every count, are those of exact mode.
Used for single-token passes with trimmable KV caches, while no prefetch runs (prefetching from such passes
waited for reads with the device idle, lost to a sync per layer, and was removed: docs/GPU.md, "Optimistic
passes with prefetch (removed)"), when `PerLayerRuntime.optimistic` is set (by default where a sync stalls the
device, a GPU: on the CPU backend a sync costs little and the second runs cost more than the syncs saved;
docs/BENCHMARKS.md, "Investigations"); the runtime then decides from how often recent decode tokens missed
(`may_run`).
Not here: the per-layer path (`per_layer_runtime.py`).
"""

import mlx.core as mx

# decode passes run optimistically while the share of recent decode tokens that missed somewhere (the
# runtime's `token_miss_rate`) is below this: a pass that misses costs a second pass from its first missing
# layer, one that does not saves a sync per partly resident layer
OPTIMISTIC_BELOW = 0.5


def may_run(runtime) -> bool:
    """Whether the per-layer runtime's next decode pass may run optimistically: exact mode, no prefetch, a
    policy that allows it, and recent decode tokens missed rarely. A recording learns the pass's routing
    with its flags."""
    return (
        runtime.optimistic
        and runtime.miss_policy == "load"
        and runtime.policy.optimistic_passes
        and runtime.governor is None
        and runtime.token_miss_rate < OPTIMISTIC_BELOW
        and not all(c.is_full() for c in runtime.caches)  # then no layer syncs anyway
    )


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
            or not may_run(runtime)
            or not all(hasattr(c, "trim") and c.is_trimmable() for c in cache)
        ):
            return self.model(inputs, cache=cache, **kwargs)
        runtime.speculative = []
        try:
            logits = self.model(inputs, cache=cache, **kwargs)
        except BaseException:
            runtime.speculative = None
            raise
        first_miss = _first_miss(runtime, logits)
        if first_miss is None:
            return logits
        for c in cache:
            c.trim(tokens)
        runtime.resume_from = first_miss
        try:
            return self.model(inputs, cache=cache, **kwargs)
        finally:
            runtime.resume_from = None


def _first_miss(runtime, logits: mx.array) -> int | None:
    """Read the optimistic pass's flags with its logits (its one sync); book the layers before the first
    that missed as exact mode would have; that layer, or None if none missed."""
    speculative, runtime.speculative = runtime.speculative, None
    if not speculative:  # every layer was fully resident: nothing to check, and no sync
        return None
    mx.eval(logits, [s[1] for s in speculative], [s[3] for s in speculative])
    runtime.host_syncs += 1
    runtime.loader.synced()
    first_miss = next((s[0] for s in speculative if s[3].item()), None)
    for layer, indices, phase, _ in speculative:
        if first_miss is not None and layer >= first_miss:
            break
        runtime.book_routing(layer, indices, phase)  # all resident: nothing absent
    runtime.pass_missed = first_miss is not None
    runtime.optimistic_passes += 1
    runtime.optimistic_misses += runtime.pass_missed
    return first_miss
