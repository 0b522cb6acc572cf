"""The module that replaces an MoE block's `switch_mlp`: routes expert ids through the resident cache.

mlx-lm's own `SwitchGLU`/`SwitchMLP` instance (`inner`) still does the math; its projections hold C
stacked slots instead of E experts, and this wrapper remaps global expert ids to slots first. Per miss
policy:
- "load" (exact): the layer's ids are evaluated, missing experts are read before use, then the stock
  computation runs on slots. When more distinct experts are needed than fit (a long prefill chunk at small
  capacity) the layer is computed in rounds, each over the experts that fit, and the per-expert outputs are
  merged before mlx-lm's weighted sum, so the result is the same. If every expert is resident, no sync.
- "skip" (approximate): no sync; a missing expert's output is zeroed and the others' rescaled so the
  routing weights of the resident experts sum to what all k summed to. Bookkeeping and loading the missed
  experts happen between tokens (see `runtime.py`).
Not here: reading bytes and choosing victims (`runtime.py`, `cache.py`).
"""

from typing import Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cache import LayerCache, Origin


class GateTap(nn.Module):
    """Passes the router through unchanged and keeps its last output for the switch (skip mode)."""

    def __init__(self, gate: nn.Module, switch: "OffloadedSwitch"):
        super().__init__()
        self.gate = gate
        self._switch = switch  # not a child: a plain attribute

    def __call__(self, x):
        out = self.gate(x)
        object.__setattr__(self._switch, "last_gate_output", out)  # a plain attribute, not a parameter
        return out


class OffloadedSwitch(nn.Module):
    """Drop-in `switch_mlp` over a bounded cache of resident experts."""

    def __init__(self, inner: nn.Module, cache: LayerCache, runtime, index: int):
        super().__init__()
        self.inner = inner
        self.cache = cache
        self.runtime = runtime
        self.index = index  # position among the model's MoE blocks
        self.last_gate_output = None
        self.prev_logprobs = None

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        phase = "prefill" if x.ndim >= 2 and x.shape[-2] > 1 else "decode"
        if self.index == 0:
            self.runtime.begin_forward(int(np.prod(indices.shape[:-1])), phase)
        if self.runtime.miss_policy == "skip":
            return self._call_skip(x, indices, phase)
        if self.cache.is_full():
            self.runtime.defer(self, indices, phase)
            return self.inner(x, self.cache.lookup_table()[indices])
        return self._call_load(x, indices, phase)

    # -- exact ---------------------------------------------------------------------------------
    def _call_load(self, x, indices, phase):
        cache, runtime, prefetcher = self.cache, self.runtime, self.runtime.prefetcher
        if prefetcher is not None and prefetcher.idle:
            prefetcher = None  # paused with nothing in flight: on-demand loading, at its cost
        predictions = runtime.predict(self, x, phase)
        runtime.evaluate(indices, predictions)  # the one sync point of this layer
        ids = np.array(indices).astype(np.int64)
        runtime.observe(self.index, ids, phase)
        self._keep_router_output(prefetcher is not None)
        uniq, counts = np.unique(ids, return_counts=True)
        if prefetcher is not None:  # between layers: the cooperative install point
            prefetcher.drop_stale(self.index)
            prefetcher.install_ready({self.index: uniq}, runtime.clock)
        resident = cache.slot_of[uniq] >= 0
        cache.record_lookups(phase, ids.size, counts[resident].sum())
        cache.touch(uniq[resident], counts[resident], runtime.clock)
        missing = uniq[~resident]
        if missing.size and prefetcher is not None:  # late prefetches: wait for them, do not read twice
            still = prefetcher.claim(self.index, missing, uniq, runtime.clock)
            arrived = np.setdiff1d(missing, still)
            cache.touch(arrived, counts[np.searchsorted(uniq, arrived)], runtime.clock)
            missing = still
        try:
            if missing.size == 0:
                return self.inner(x, cache.slots_for(ids))
            if missing.size <= cache.room(protect=uniq):
                runtime.load(cache, missing, Origin.DEMAND, protect=uniq)
                cache.touch(missing, counts[np.searchsorted(uniq, missing)], runtime.clock)
                return self.inner(x, cache.slots_for(ids))
            return self._call_in_rounds(x, ids, uniq, counts)
        finally:
            for layer, experts, scores in predictions:  # read while this layer computes
                prefetcher.submit(layer, np.asarray(experts), np.asarray(scores))

    def _keep_router_output(self, predicting: bool):
        """The last token's router log-probabilities: the next token's predictor reads them."""
        out = self.last_gate_output
        if not predicting:
            object.__setattr__(self, "prev_logprobs", None)
        elif isinstance(out, mx.array) and self.runtime.policy is not None:
            object.__setattr__(self, "prev_logprobs",  # a plain attribute, not a parameter
                               nn.log_softmax(out.reshape(-1, out.shape[-1])[-1].astype(mx.float32)))

    def _call_in_rounds(self, x, ids, uniq, counts):
        cache, runtime = self.cache, self.runtime
        remaining, merged = uniq, None
        while remaining.size:
            resident = remaining[cache.slot_of[remaining] >= 0]
            missing = remaining[cache.slot_of[remaining] < 0]
            to_load = missing[: cache.room(protect=resident)]
            if to_load.size:
                runtime.load(cache, to_load, Origin.DEMAND, protect=resident)
            group = np.concatenate([resident, to_load])
            cache.touch(group, counts[np.searchsorted(uniq, group)], runtime.clock)
            y = self.inner(x, cache.slots_for(ids))
            if merged is None:
                merged = y
            else:
                in_group = mx.array(np.isin(ids, group))
                merged = mx.where(in_group[..., None], y, merged)
            mx.eval(merged)  # the next round overwrites slots this one read
            remaining = np.setdiff1d(remaining, group)
        return merged

    # -- approximate ---------------------------------------------------------------------------
    def _call_skip(self, x, indices, phase):
        cache = self.cache
        self.runtime.defer(self, indices, phase)
        y = self.inner(x, cache.lookup_table()[indices])
        if cache.is_full():
            return y
        present = cache.resident_mask()[indices].astype(mx.float32)
        weights = self._routing_weights(indices)
        kept = (weights * present).sum(axis=-1, keepdims=True)
        scale = mx.where(kept > 0, weights.sum(axis=-1, keepdims=True) / mx.maximum(kept, 1e-30), 0.0)
        return y * (present * scale)[..., None].astype(y.dtype)

    def _routing_weights(self, indices) -> mx.array:
        """Unnormalised routing weight of each chosen expert, from the tapped router output.

        Routers that return (indices, scores) give scores directly; plain linear routers give logits,
        whose softmax is proportional to the weights of softmax-routed families (Qwen, Mixtral, OLMoE).
        """
        out: Optional[object] = self.last_gate_output
        if isinstance(out, (tuple, list)) and len(out) == 2 and out[1].shape == indices.shape:
            return out[1].astype(mx.float32)
        if isinstance(out, mx.array) and out.shape[:-1] == indices.shape[:-1]:
            probs = mx.softmax(out.astype(mx.float32), axis=-1)
            return mx.take_along_axis(probs, indices, axis=-1)
        return mx.ones(indices.shape, dtype=mx.float32)
