"""What to prefetch: the prediction policies compared by `od-moe bench`, and the static profile.

Each policy answers, at a source MoE layer during decode, "which experts will layers ahead need?" as a
list of (target layer, expert ids, scores). Lazy MLX arrays are returned so the caller evaluates them
together with the layer's own routing (one sync per layer). Policies:
- `none`: nothing (on-demand loading with the cache's eviction).
- `profile`: no per-layer prediction; after the prompt's prefill (router discovery: the routing of the
  prompt itself) the most used experts of every layer are loaded and the hottest pinned; LRU after that.
- `next-gate`: the next layer's router applied to the current MoE input (Mixtral-offloading, HOBBIT).
- `predictor`: the shadow predictor, several layers ahead.
- `oracle`: the true routing of the same forward pass, from a recorded run of the same prompt (upper bound).
Not here: reading or installing (`prefetch.py`).
"""

from typing import Dict, List, Optional

import mlx.core as mx
import numpy as np

POLICIES = ("none", "profile", "next-gate", "predictor", "oracle")
DISTANCE_DISCOUNT = 0.8  # a prediction d layers ahead ranks as its probability times 0.8^(d-1)


def _softmax_topk(scores: mx.array, k: int):
    """Top-k ids and probabilities of each row of `scores` (lazy)."""
    probs = mx.softmax(scores.astype(mx.float32), axis=-1)
    ids = mx.argsort(-probs, axis=-1)[..., :k]
    return ids, mx.take_along_axis(probs, ids, axis=-1)


class NextGatePolicy:
    name = "next-gate"

    def __init__(self, routers, per_layer: int):
        self.weights = mx.array(routers[0])
        self.biases = mx.array(routers[1])
        self.per_layer = per_layer
        self.num_layers = self.weights.shape[0]

    def predict(self, source: int, x: mx.array, gate_output, switches) -> List[tuple]:
        if source + 1 >= self.num_layers:
            return []
        x = x.reshape(-1, x.shape[-1])[-1:].astype(mx.float32)
        scores = x @ self.weights[source + 1].T + self.biases[source + 1]
        ids, probs = _softmax_topk(scores, self.per_layer)
        return [(source + 1, ids[0], probs[0])]


class PredictorPolicy:
    name = "predictor"

    def __init__(self, predictor, per_layer: int):
        self.predictor = predictor
        self.per_layer = per_layer

    def predict(self, source: int, x: mx.array, gate_output, switches) -> List[tuple]:
        c = self.predictor.config
        targets = c.targets(source) if source < c.num_layers - 1 else []
        if not targets or not isinstance(gate_output, mx.array):
            return []
        x = x.reshape(-1, x.shape[-1])[-1:]
        logits = gate_output.reshape(-1, gate_output.shape[-1])[-1:]
        prev = None
        if c.use_prev_token:
            rows = [switches[j].prev_logprobs for j in targets]
            if all(r is not None for r in rows):
                prev = mx.stack(rows, axis=0)[None]
        scores = self.predictor(source, x, logits, prev=prev)[0]  # (D_i, E)
        ids, probs = _softmax_topk(scores, self.per_layer)
        discount = mx.array([DISTANCE_DISCOUNT ** n for n in range(len(targets))])[:, None]
        return [(j, ids[n], (probs * discount)[n]) for n, j in enumerate(targets)]


class OraclePolicy:
    """Replays the routing recorded from a run of the same prompt: forward f, layer j -> expert ids."""

    name = "oracle"

    def __init__(self, trace: List[Dict[int, np.ndarray]], lookahead: int):
        self.trace = trace
        self.lookahead = lookahead
        self.forward = 0  # set by the runtime at every forward pass of a generation

    def predict(self, source: int, x, gate_output, switches) -> List[tuple]:
        if self.forward >= len(self.trace):
            return []
        routing = self.trace[self.forward]
        out = []
        for d in range(1, self.lookahead + 1):
            ids = routing.get(source + d)
            if ids is not None:
                uniq = np.unique(ids)
                out.append((source + d, uniq, np.full(len(uniq), DISTANCE_DISCOUNT ** (d - 1))))
        return out


def seed_from_profile(runtime, caches, counts: List[np.ndarray], pin_fraction: float = 0.25):
    """Load the most used experts of every layer (up to capacity) and pin the hottest `pin_fraction`."""
    from .cache import Origin

    for cache, count in zip(caches, counts):
        order = np.argsort(-count, kind="stable")
        order = order[count[order] > 0][: cache.capacity]
        missing = np.sort(order[cache.slot_of[order] < 0])[: cache.room(protect=order)]
        if missing.size:
            runtime.load(cache, missing, Origin.PROFILE, protect=order)
        hot = order[: int(cache.capacity * pin_fraction)]
        hot = hot[cache.slot_of[hot] >= 0]
        cache.unpin_all()
        if hot.size and hot.size < cache.capacity:
            cache.pin(hot)
