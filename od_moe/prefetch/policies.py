"""Prefetch policies: small objects with the same three hooks, chosen by name with `make_policy`.

Hooks, called by the runtime on the generation thread:
- `prompt_start(prompt)`: a new prompt (its token ids) is about to be processed.
- `before_layer(step)`: an MoE layer is about to run (every layer, every pass). Returns predictions,
  `Prediction(layer ahead, expert ids, scores)` (scores: the probability that the expert is routed,
  discounted with distance by the predictor), as lazy MLX arrays where computed, so the runtime
  evaluates them with the layer's own routing (one sync); only when `step.predict` is set (exact mode,
  decode, prefetch on) are they wanted.
- `after_routing(step, ids)`: the layer's routed expert ids (numpy, (tokens, k)) are known.
- `pending()`: lazy arrays the policy computed at the running layer, evaluated with its routing.
- `next_uses(forward, layer)`: passes until each expert of the layer is needed again, where the policy
  knows or estimates it (else None); the runtime evicts the farthest first and reads or installs a
  prefetch only when it is needed sooner than what it would evict.
`optimistic_passes`: whether decode passes may run optimistically with the policy (`optimistic.py`): its
`after_routing` may learn a pass's routing once the pass has computed (they run only while nothing is
prefetched).
Policies:
- `none`: on-demand loading with the cache's eviction.
- `profile`: router discovery; the prompt's own routing, counted during prefill, seeds every layer's
  cache with its most used experts before the first decode pass, and pins the hottest.
- `next-gate`: the next layer's router on the current MoE input (Mixtral-offloading, HOBBIT).
- `predictor`: the shadow predictor, several layers ahead; at the last MoE layer `NextTokenLens` names
  the first layer's experts of the next token. With a next-use head it estimates each expert's next use
  (`next_uses`): the head's estimate, brought forward for experts predicted for the running pass.
- `oracle`: the true routing recorded from a run of the same prompt (`record_routing`); an upper bound.
  It also tells the runtime when each expert is needed next (`next_uses`), so it evicts as Belady's MIN.
Not here: reading, installing (`loader.py`, `reader.py`) or how much to read (`governor.py`).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..caching.replay import first_uses
from ..errors import UserError
from ..model_surgery.routing import next_gate
from ..predictor.next_use import AGE_CAP, features

POLICIES = ("none", "profile", "next-gate", "predictor", "oracle")
DISTANCE_DISCOUNT = 0.8  # a prediction d layers ahead ranks as its probability times 0.8^(d-1)
ORACLE_LOOKAHEAD = 4
PROFILE_PIN_FRACTION = 0.25


class Prediction(NamedTuple):
    layer: int
    experts: object  # ids (MLX or numpy), best first
    scores: object


@dataclass
class Step:
    """One MoE layer of one forward pass, as the policies see it."""

    forward: int  # forward passes since the prompt started (0: its first prefill chunk)
    layer: int
    phase: str  # "prefill" or "decode"
    hidden: mx.array | None  # the MoE block's input (its hidden state; None where booked after the pass)
    router: object  # the layer's router logits (None where not tapped or not one projection)
    predict: bool  # predictions are wanted now (exact mode, decode, prefetch on)
    prefetching: bool  # prefetch is engaged: on, or reads still in flight


def softmax_topk(scores: mx.array, k: int):
    """Top-k ids and probabilities of each row of `scores` (lazy)."""
    probs = mx.softmax(scores.astype(mx.float32), axis=-1)
    ids = mx.argsort(-probs, axis=-1)[..., :k]
    return ids, mx.take_along_axis(probs, ids, axis=-1)


def last_row(a: mx.array) -> mx.array:
    return a.reshape(-1, a.shape[-1])[-1:]


def _router_logprobs(router: mx.array) -> mx.array:
    """The last token's router log-probabilities (E,), lazy."""
    return nn.log_softmax(last_row(router)[0].astype(mx.float32))


def experts_at_distance(k: int, d: int) -> int:
    """How many experts to prefetch for a layer d ahead when tokens use k: k + k/4 one layer ahead, then
    halving with distance. On 8,000 of the bundled model's held-out trace tokens (predictor top-m per
    distance, union over sources, target layers 4-7), 10/4/2/1 for k=8 recalls 0.911 of the true experts
    with 10.1 reads per layer, where 8/8/8/8 recalls 0.903 with 10.7: the nearest source is the most
    accurate, farther ones add noise."""
    return k + k // 4 if d == 1 else k >> (d - 1)


class OnDemand:
    name = "none"
    reads_router_outputs = False  # the runtime taps every router for this policy (`RouterTap`)
    optimistic_passes = True

    def prompt_start(self, prompt):
        pass

    def before_layer(self, step: Step) -> list[Prediction]:
        return []

    def after_routing(self, step: Step, ids: np.ndarray):
        pass

    def pending(self) -> list[mx.array]:
        return []

    def next_uses(self, forward: int, layer: int) -> np.ndarray | None:
        """Passes after pass `forward` (the last whose routing at `layer` is known; -1 before the first)
        until each expert of `layer` is needed again (inf: not needed as far as the policy knows), or
        None where it knows nothing of the future: the cache's eviction rule then chooses alone."""
        return None


class ProfilePolicy(OnDemand):
    """Router discovery: count the prompt's routing, seed the caches with it after prefill."""

    name = "profile"
    optimistic_passes = False  # seeds the caches at the first decode pass

    def __init__(self, caches, top_k: int, load: Callable):
        self.caches, self.top_k, self.load = caches, top_k, load
        self.counts: list[np.ndarray] | None = None  # the prompt's routing, per layer
        self.seeded = True

    def prompt_start(self, prompt):
        self.counts = [np.zeros(c.num_experts, np.int64) for c in self.caches]
        self.seeded = False

    def after_routing(self, step: Step, ids: np.ndarray):
        if self.counts is not None and step.phase == "prefill":
            self.counts[step.layer] += np.bincount(ids.ravel(), minlength=len(self.counts[step.layer]))

    def before_layer(self, step: Step) -> list[Prediction]:
        if step.layer == 0 and step.phase == "decode" and not self.seeded:
            self.seed()
        return []

    def seed(self):
        """Load the most used experts of every layer (up to capacity) and pin the hottest quarter, but never
        so many that a token's top-k experts cannot all be resident (that would split layers into rounds:
        at 12.5% of a 64-expert top-8 model, 8 slots, nothing is pinned)."""
        for cache, count in zip(self.caches, self.counts):
            order = np.argsort(-count, kind="stable")
            order = order[count[order] > 0][: cache.capacity]
            missing = np.sort(order[cache.slot_of[order] < 0])[: cache.room(protect=order)]
            if missing.size:
                self.load(cache, missing, protect=order)
            hot = order[
                : max(0, min(int(cache.capacity * PROFILE_PIN_FRACTION), cache.capacity - self.top_k))
            ]
            hot = hot[cache.slot_of[hot] >= 0]
            cache.unpin_all()
            if hot.size and hot.size < cache.capacity:
                cache.pin(hot)
        self.seeded = True


class NextGatePolicy(OnDemand):
    name = "next-gate"
    optimistic_passes = False  # predicts with lazy arrays

    def __init__(self, routers, per_layer: int, top_k: int):
        self.weights, self.biases = mx.array(routers[0]), mx.array(routers[1])
        self.per_layer, self.top_k = per_layer, top_k

    def before_layer(self, step: Step) -> list[Prediction]:
        target = step.layer + 1
        if not step.predict or step.hidden is None or target >= self.weights.shape[0]:
            return []
        scores = next_gate(
            last_row(step.hidden), self.weights[target : target + 1], self.biases[target : target + 1]
        )
        ids, probs = softmax_topk(scores[:, 0], self.per_layer)
        return [Prediction(target, ids[0], mx.minimum(probs[0] * self.top_k, 1.0))]


class NextTokenLens:
    """The first MoE layer's experts for the next token, guessed at the last MoE layer.

    The first MoE layer's routing is nearly a function of the token itself (its router on the token's
    embedding alone recalls 0.98 of the true top-8 in 16 guesses on the bundled model's held-out traces),
    and the last MoE layer's input already points at the next token: read through the model's own final
    norm and output head (the "logit lens"), its top tokens, each weighted by its probability, vote with
    the first router's probabilities. Parameter-free; `of` gives None where the model's parts are not found.
    """

    def __init__(self, post_norm_last, final_norm, head, embed, post_norm_first, router, tokens: int = 32):
        self.post_norm_last, self.final_norm, self.head = post_norm_last, final_norm, head
        self.embed, self.post_norm_first, self.router, self.tokens = embed, post_norm_first, router, tokens

    @classmethod
    def of(cls, model, moe_blocks, first_router) -> Optional["NextTokenLens"]:
        inner = getattr(model, "model", None)
        layers = getattr(inner, "layers", None)
        embed, final_norm = getattr(inner, "embed_tokens", None), getattr(inner, "norm", None)
        if layers is None or embed is None or final_norm is None or not moe_blocks:
            return None
        head = getattr(model, "lm_head", None) or getattr(embed, "as_linear", None)

        def owner(block):
            return next((l for l in layers if any(c is block for c in l.children().values())), None)

        norms = [getattr(owner(b), "post_attention_layernorm", None) for b in (moe_blocks[0], moe_blocks[-1])]
        if (
            head is None
            or None in norms
            or first_router is None
            or not isinstance(getattr(norms[1], "weight", None), mx.array)
        ):
            return None
        return cls(norms[1], final_norm, head, embed, norms[0], first_router)

    def predict(self, x: mx.array, k: int):
        """Lazy (ids, probabilities) of the k likeliest first-layer experts for the next token."""
        h = last_row(x) / self.post_norm_last.weight  # undo the norm's gain; the final norm rescales anyway
        logits = self.head(self.final_norm(h)).astype(mx.float32)[0]
        probs = mx.softmax(logits)
        top = mx.argpartition(-logits, kth=self.tokens - 1)[: self.tokens]
        scores = self.router(self.post_norm_first(self.embed(top)))
        if not isinstance(scores, mx.array):
            return None
        votes = probs[top][None] @ mx.softmax(scores.astype(mx.float32), axis=-1)
        ids = mx.argsort(-votes[0])[:k]
        return ids, votes[0][ids]


class PredictorPolicy(OnDemand):
    """The shadow predictor; it also keeps each layer's router log-probabilities, which the next token's
    predictions read (the previous token's routing at the target layers). With `caches` and a predictor
    that has a next-use head, it also estimates when each expert is needed next (`next_uses`)."""

    name = "predictor"
    reads_router_outputs = True  # the shadow network reads the routers' outputs
    optimistic_passes = False  # predicts with lazy arrays

    def __init__(self, predictor, per_layer: int, lens: NextTokenLens | None = None, caches=None):
        self.predictor, self.per_layer, self.lens = predictor, per_layer, lens
        self.counts = [experts_at_distance(per_layer, d) for d in range(1, predictor.config.lookahead + 1)]
        self.prev_logprobs: dict[int, mx.array] = {}
        self.caches = caches
        self.head = predictor.next_use if caches is not None and predictor.config.next_use else None
        self._fresh: dict[int, tuple] = {}  # layer -> the head's lazy inputs at the running layer
        self._known: dict[int, tuple] = {}  # layer -> the same, evaluated, from its latest routing
        self._members: dict[int, tuple] = {}  # layer -> (ids, P(routed)) predicted for its next run
        self._base: dict[int, tuple] = {}  # layer -> (known, history version, the head's distances)
        self._estimates: dict[int, tuple] = {}  # layer -> (base distances, members, `next_uses`)

    def pending(self) -> list[mx.array]:
        """The lazy arrays the next-use estimates will read: evaluated with the layer's routing, so that
        reading them later costs no host sync of its own."""
        fresh = [a for inputs in self._fresh.values() for a in inputs if a is not None]
        return fresh + [a for members in self._members.values() for a in members if isinstance(a, mx.array)]

    def after_routing(self, step: Step, ids: np.ndarray):
        if self.head is not None:  # the history the head reads, kept through pauses too
            self.caches[step.layer].history.note(ids)
        fresh = self._fresh.pop(step.layer, None)
        if step.prefetching and isinstance(step.router, mx.array):
            logprobs = fresh[1] if fresh is not None else _router_logprobs(step.router)
            self.prev_logprobs[step.layer] = logprobs
        else:
            self.prev_logprobs.pop(step.layer, None)
        self._members.pop(step.layer, None)  # its predictions were for the run that just happened
        if fresh is not None:
            self._known[step.layer] = tuple(None if a is None else np.array(a) for a in fresh)
        else:
            self._known.pop(step.layer, None)

    def next_uses(self, forward: int, layer: int) -> np.ndarray | None:
        """The next-use head's expected passes until each expert is needed (as of the layer's latest
        routing); an expert predicted for the layer's next run with probability p is needed at the next
        pass with p, so its estimate becomes p + (1 - p) times the head's."""
        if self.head is None or layer not in self._known:
            return None
        # the runtime asks several times per layer (reads, installs, prefetch requests): the head's answer
        # changes only with the layer's routing and its experts' use history, once a pass, and the
        # predictions for the layer (up to one per source layer ahead of it) only adjust a few experts
        base = self._head_distances(self.head, layer)
        members = self._members.get(layer)
        kept = self._estimates.get(layer)
        if kept is not None and kept[0] is base and kept[1] is members:
            return kept[2]
        distance = base
        if members is not None:
            if isinstance(members[0], mx.array):  # evaluated with the layer that predicted them
                members = self._members[layer] = tuple(np.array(a) for a in members)
            ids, p = members
            distance = base.copy()
            distance[ids] = np.minimum(distance[ids], p + (1 - p) * distance[ids])
            distance.setflags(write=False)  # shared by every caller until the inputs change
        self._estimates[layer] = (base, members, distance)
        return distance

    def _head_distances(self, head, layer: int) -> np.ndarray:
        """The next-use `head`'s expected passes until each expert of `layer` is used again (read-only)."""
        cache, known = self.caches[layer], self._known[layer]
        kept = self._base.get(layer)
        if kept is not None and kept[0] is known and kept[1] == cache.history.version:
            return kept[2]
        x_term, logprobs = known
        age, uses = cache.history.ages_and_uses(never=AGE_CAP)
        logprobs = np.zeros(cache.num_experts, np.float32) if logprobs is None else logprobs
        distance = head.distances(layer, x_term, features(logprobs, age, uses))
        distance.setflags(write=False)
        self._base[layer] = (known, cache.history.version, distance)
        return distance

    def before_layer(self, step: Step) -> list[Prediction]:
        c, source = self.predictor.config, step.layer
        # the head's estimates serve while prefetch runs: where the governor paused it, demand reads cost
        # too little for either to pay, and eviction falls back to the cache's own rule
        if self.head is not None and step.hidden is not None and step.prefetching:
            logprobs = _router_logprobs(step.router) if isinstance(step.router, mx.array) else None
            self._fresh[source] = (self.head.x_term(source, last_row(step.hidden))[0], logprobs)
        if not step.predict or step.hidden is None:
            return []
        if source == c.num_layers - 1 and self.lens is not None:
            guess = self.lens.predict(step.hidden, self.counts[0])
            if guess is None:
                return []
            self._members[0] = (guess[0], mx.minimum(guess[1] * c.top_k, 1.0))
            return [Prediction(0, *self._members[0])]
        targets = c.targets(source) if source < c.num_layers - 1 else []
        if not targets or not isinstance(step.router, mx.array):
            return []
        prev = None
        if all(j in self.prev_logprobs for j in targets):
            prev = mx.stack([self.prev_logprobs[j] for j in targets], axis=0)[None]
        hidden, router = last_row(step.hidden), last_row(step.router)
        scores = self.predictor(source, hidden, router, prev=prev)[0]  # (D_i, E)
        ids, probs = softmax_topk(scores, max(self.counts))
        routed = mx.minimum(probs * c.top_k, 1.0)  # the softmax targets spread 1 over the k routed experts
        ranked = routed * mx.array([DISTANCE_DISCOUNT**n for n in range(len(targets))])[:, None]
        out = []
        for n, j in enumerate(targets):
            m = self.counts[j - source - 1]
            if m:
                out.append(Prediction(j, ids[n, :m], ranked[n, :m]))
                self._members[j] = (ids[n, :m], routed[n, :m])  # sources come in order: the nearest
        return out


class OraclePolicy(OnDemand):
    """Replays the routing recorded from a run of the same prompt (`record_routing`): forward f, layer j
    -> expert ids. Its lookahead runs on into the next forward pass."""

    name = "oracle"

    def __init__(
        self,
        trace: list[dict[int, np.ndarray]],
        num_layers: int,
        num_experts: int,
        lookahead: int = ORACLE_LOOKAHEAD,
    ):
        self.trace, self.num_layers, self.lookahead = trace, num_layers, lookahead
        self.num_experts = num_experts
        self._next: dict[int, np.ndarray] = {}  # layer -> `first_uses` table of the trace
        self._needed: dict[tuple[int, int], np.ndarray] = {}  # (forward, layer) -> its distinct experts

    def next_uses(self, forward: int, layer: int) -> np.ndarray | None:
        """From the trace: the oracle evicts as Belady's MIN does."""
        if not -1 <= forward < len(self.trace):
            return None
        if layer not in self._next:
            none = np.empty(0, np.int64)
            needed = [np.unique(p[layer]) if layer in p else none for p in self.trace]
            self._next[layer] = first_uses(needed, self.num_experts)
        return self._next[layer][forward + 1] - forward

    def before_layer(self, step: Step) -> list[Prediction]:
        if not step.predict:
            return []
        out = []
        for d in range(1, self.lookahead + 1):  # the next `lookahead` layers, the nearest first
            forward, layer = divmod(step.layer + d, self.num_layers)  # past the last layer: the next pass
            if step.forward + forward >= len(self.trace):
                break
            key = (step.forward + forward, layer)
            uniq = self._needed.get(key)
            if uniq is None and layer in self.trace[key[0]]:  # each is predicted from 4 layers: once
                uniq = self._needed[key] = np.unique(self.trace[key[0]][layer])
            if uniq is not None:
                out.append(Prediction(layer, uniq, np.full(len(uniq), DISTANCE_DISCOUNT ** (d - 1))))
        return out


def make_policy(name: str, engine, oracle_trace: Sequence | None = None, per_layer: int | None = None):
    """The policy called `name` for `engine` (see the module docstring); a UserError for a bad choice."""
    per_layer = per_layer or engine.top_k
    if name == "none":
        return OnDemand()
    if name == "profile":
        return ProfilePolicy(engine.caches, engine.top_k, engine.runtime.load)
    if name == "next-gate":
        return NextGatePolicy(engine.routers(), per_layer, engine.top_k)
    if name == "predictor":
        if engine.predictor is None:
            raise UserError(
                "prefetch policy 'predictor' needs a shadow predictor: give --predictor DIR ('bundled' for "
                "the embedded model's; load(predictor=DIR) in Python), trained with `od-moe train-predictor`"
            )
        # the lens reads the next token's first MoE layer off the last one: a pipeline rank holds one of them
        lens = (
            None
            if engine.stage is not None
            else NextTokenLens.of(engine.model, engine.moe_blocks, engine.router(0))
        )
        return PredictorPolicy(engine.predictor, per_layer, lens, engine.caches)
    if name == "oracle":
        if oracle_trace is None:
            raise UserError(
                "prefetch policy 'oracle' needs the routing recorded from the same prompt: "
                "engine.record_routing(prompt, max_tokens) on an engine with the same settings gives it"
            )
        return OraclePolicy(list(oracle_trace), len(engine.caches), engine.caches[0].num_experts)
    raise UserError(f"unknown prefetch policy {name!r}: use one of {', '.join(POLICIES)}")
