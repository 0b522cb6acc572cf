"""What to prefetch: the prediction policies compared by `od-moe bench`, and the static profile.

Each policy answers, at a source MoE layer during decode, "which experts will layers ahead need?" as a
list of (target layer, expert ids, scores). Lazy MLX arrays are returned so the caller evaluates them
together with the layer's own routing (one sync per layer). Policies:
- `none`: nothing (on-demand loading with the cache's eviction).
- `profile`: no per-layer prediction; after the prompt's prefill (router discovery: the routing of the
  prompt itself) the most used experts of every layer are loaded and the hottest pinned; LRU after that.
- `next-gate`: the next layer's router applied to the current MoE input (Mixtral-offloading, HOBBIT).
- `predictor`: the shadow predictor, several layers ahead; at the last MoE layer, `NextTokenLens` names
  the first MoE layer's experts of the next token (a forward pass cannot see across tokens otherwise).
- `oracle`: the true routing, from a recorded run of the same prompt (upper bound); its lookahead runs on
  into the next forward pass.
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


class NextTokenLens:
    """The first MoE layer's experts for the next token, guessed at the last MoE layer.

    The first MoE layer's routing is nearly a function of the token itself (its router on the token's
    embedding alone recalls 0.98 of the true top-8 in 16 guesses on the bundled model's held-out traces),
    and the last MoE layer's input already points at the next token: read through the model's own final
    norm and output head (the "logit lens"), its top tokens, each weighted by its probability, vote with
    the first router's probabilities. Parameter-free; None where the model's parts are not found.
    """

    def __init__(self, post_norm_last, final_norm, head, embed, post_norm_first, router, tokens: int = 32):
        self.post_norm_last, self.final_norm, self.head = post_norm_last, final_norm, head
        self.embed, self.post_norm_first, self.router, self.tokens = embed, post_norm_first, router, tokens

    @classmethod
    def of(cls, model, moe_blocks) -> Optional["NextTokenLens"]:
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        embed, final_norm = getattr(inner, "embed_tokens", None), getattr(inner, "norm", None)
        if layers is None or embed is None or final_norm is None or not moe_blocks:
            return None
        head = getattr(model, "lm_head", None) or getattr(embed, "as_linear", None)

        def owner(block):
            return next((l for l in layers if any(c is block for c in l.children().values())), None)

        first, last = owner(moe_blocks[0]), owner(moe_blocks[-1])
        norms = [getattr(l, "post_attention_layernorm", None) for l in (first, last)]
        router = moe_blocks[0].get("gate") if hasattr(moe_blocks[0], "get") else None
        router = getattr(router, "gate", router)  # unwrap od-moe's GateTap
        if head is None or None in norms or router is None or not isinstance(getattr(norms[1], "weight", None), mx.array):
            return None
        return cls(norms[1], final_norm, head, embed, norms[0], router)

    def predict(self, x: mx.array, k: int):
        """Lazy (ids, probabilities) of the k likeliest first-layer experts for the next token."""
        x = x.reshape(-1, x.shape[-1])[-1:]
        h = x / self.post_norm_last.weight  # undo the norm's gain; the final norm rescales anyway
        logits = self.head(self.final_norm(h)).astype(mx.float32)[0]
        probs = mx.softmax(logits)
        top = mx.argpartition(-logits, kth=self.tokens - 1)[: self.tokens]
        scores = self.router(self.post_norm_first(self.embed(top)))
        if not isinstance(scores, mx.array):
            return None
        votes = probs[top][None] @ mx.softmax(scores.astype(mx.float32), axis=-1)
        ids = mx.argsort(-votes[0])[:k]
        return ids, votes[0][ids]


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


def experts_at_distance(k: int, d: int) -> int:
    """How many experts to prefetch for a layer d ahead when tokens use k: k + k/4 one layer ahead, then
    halving with distance. On 8,000 of the bundled model's held-out trace tokens (predictor top-m per
    distance, union over sources, target layers 4-7), 10/4/2/1 for k=8 recalls 0.911 of the true experts
    with 10.1 reads per layer, where 8/8/8/8 recalls 0.903 with 10.7: the nearest source is the most
    accurate, farther ones add noise."""
    return k + k // 4 if d == 1 else k >> (d - 1)


class PredictorPolicy:
    name = "predictor"

    def __init__(self, predictor, per_layer: int, lens: Optional[NextTokenLens] = None):
        self.predictor = predictor
        self.per_layer = per_layer
        self.lens = lens
        self.counts = [experts_at_distance(per_layer, d) for d in range(1, predictor.config.lookahead + 1)]

    def predict(self, source: int, x: mx.array, gate_output, switches) -> List[tuple]:
        c = self.predictor.config
        if source == c.num_layers - 1 and self.lens is not None:
            guess = self.lens.predict(x, self.counts[0])
            return [(0, *guess)] if guess is not None else []
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
        ids, probs = _softmax_topk(scores, max(self.counts))
        discount = mx.array([DISTANCE_DISCOUNT ** n for n in range(len(targets))])[:, None]
        probs = probs * discount
        return [(j, ids[n, :self.counts[j - source - 1]], probs[n, :self.counts[j - source - 1]])
                for n, j in enumerate(targets) if self.counts[j - source - 1]]


class OraclePolicy:
    """Replays the routing recorded from a run of the same prompt: forward f, layer j -> expert ids."""

    name = "oracle"

    def __init__(self, trace: List[Dict[int, np.ndarray]], lookahead: int, num_layers: int):
        self.trace = trace
        self.lookahead = lookahead
        self.num_layers = num_layers
        self.forward = 0  # set by the runtime at every forward pass of a generation

    def predict(self, source: int, x, gate_output, switches) -> List[tuple]:
        out = []
        for d in range(1, self.lookahead + 1):
            forward, layer = divmod(source + d, self.num_layers)  # past the last layer: the next pass
            if self.forward + forward >= len(self.trace):
                break
            ids = self.trace[self.forward + forward].get(layer)
            if ids is not None:
                uniq = np.unique(ids)
                out.append((layer, uniq, np.full(len(uniq), DISTANCE_DISCOUNT ** (d - 1))))
        return out


def seed_from_profile(runtime, caches, counts: List[np.ndarray], top_k: int, pin_fraction: float = 0.25):
    """Load the most used experts of every layer (up to capacity) and pin the hottest `pin_fraction`, but
    never so many that a token's `top_k` experts cannot all be resident (that would split layers into
    rounds: at 12.5% of a 64-expert top-8 model, 8 slots, nothing is pinned)."""
    from .cache import Origin

    for cache, count in zip(caches, counts):
        order = np.argsort(-count, kind="stable")
        order = order[count[order] > 0][: cache.capacity]
        missing = np.sort(order[cache.slot_of[order] < 0])[: cache.room(protect=order)]
        if missing.size:
            runtime.load(cache, missing, Origin.PROFILE, protect=order)
        hot = order[: max(0, min(int(cache.capacity * pin_fraction), cache.capacity - top_k))]
        hot = hot[cache.slot_of[hot] >= 0]
        cache.unpin_all()
        if hot.size and hot.size < cache.capacity:
            cache.pin(hot)
