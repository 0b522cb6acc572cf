"""Replaying recorded routing through a cache of C slots per layer under an eviction rule, on demand reads
only: how many experts each rule would read for the same tokens.

Rules: `lru` (od-moe's default), `lfu` (use counts halving every `cache.LFU_HALF_LIFE` passes, as the
cache keeps them), and Belady's `min` (evict the resident expert whose next use is farthest away), which
reads the fewest experts any policy can, prefetching or not, for that routing and capacity. With a
`horizon` of n passes, MIN knows only the next n passes: experts not used within them go first, oldest
use first. `next-use` evicts as MIN would by estimated distances (`distances[t]`: passes until each
expert is needed again, as estimated right after pass t's routing: the predictor's next-use head). A pass
needing more distinct experts than there are slots reads all it misses and keeps the ones needed again
soonest (MIN) or the last ones (others); only prefill passes do that.

Used by the bench (MIN's count beside each row's) and by `od-moe eval-predictor` (the rules on held-out
text). Not here: the live cache (`caching/layer_cache.py`) or what it counts (`accounting/ledger.py`).
"""

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from ..storage.layout import ExpertIds
from .layer_cache import LFU_HALF_LIFE

RULES = ("lru", "lfu", "min", "next-use")


@dataclass
class Tally:
    """Demand figures over the passes that count: experts read, routed lookups, hits among them."""

    reads: int = 0
    lookups: int = 0
    hits: int = 0
    passes: int = 0

    def __add__(self, other: "Tally") -> "Tally":
        return Tally(*(a + b for a, b in zip(vars(self).values(), vars(other).values())))

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None

    @property
    def reads_per_pass(self) -> float | None:
        return self.reads / self.passes if self.passes else None


def replay_layer(
    steps: list[np.ndarray],
    capacity: int,
    rule: str,
    horizon: int | None = None,
    counted: list[bool] | None = None,
    resident: np.ndarray | None = None,
    distances: np.ndarray | None = None,
    observe=None,
) -> Tally:
    """One layer: `steps[t]` the expert ids routed at pass t (any shape); `counted[t]`: whether pass t
    counts (default: all); `resident`: experts in the cache before the first pass (default: none);
    `distances` (passes, E): the estimates rule `next-use` evicts by; `observe(t, misses, held)`, if
    given, sees each pass's misses and the experts held before it (a set)."""
    if rule not in RULES:
        raise ValueError(f"unknown eviction rule {rule!r}: one of {', '.join(RULES)}")
    if (rule == "next-use") != (distances is not None):
        raise ValueError("rule 'next-use', and only it, needs distances")
    routed = [np.asarray(s, dtype=np.int64).ravel() for s in steps]
    num_experts = 1 + max(
        [int(r.max()) for r in routed if r.size] + [-1 if resident is None else max(resident, default=-1)]
    )
    uses = [_uses(r) for r in routed]
    next_use = first_uses([u[0] for u in uses], num_experts) if rule == "min" else None
    if distances is not None:  # estimated passes ahead, as the oracle's table gives true ones
        next_use = np.asarray(distances)[:, :num_experts] + np.arange(len(uses))[:, None]
        next_use = np.concatenate([np.zeros((1, num_experts)), next_use])
    # plain Python lists from here: a pass touches a handful of experts, where numpy's per-call cost
    # dominated (docs/BENCHMARKS.md, "The prefetch grid and the roofline")
    held = [False] * num_experts
    for e in [] if resident is None else np.asarray(resident, dtype=np.int64).tolist():
        held[e] = True
    held_count = sum(held)
    last_use = [-1.0] * num_experts
    frequency = [0.0] * num_experts
    reads = lookups = hits = passes = 0
    for t, (ids, counts) in enumerate(uses):
        misses = [e for e in ids if not held[e]]
        if observe is not None:
            observe(t, misses, {e for e, h in enumerate(held) if h})
        if counted is None or counted[t]:
            reads += len(misses)
            lookups += routed[t].size
            hits += sum(c for e, c in zip(ids, counts) if held[e])
            passes += 1
        if len(ids) > capacity:  # more than fit: keep those wanted soonest (MIN) or the last ones
            order = _evictable_first(rule, ids, t, last_use, frequency, next_use, horizon)
            held = [False] * num_experts
            for e in (ids if rule in ("lru", "lfu") else order)[-capacity:]:
                held[e] = True
            held_count = capacity
        else:
            over = len(misses) - (capacity - held_count)
            if over > 0:
                routed_now = set(ids)
                candidates = [e for e in range(num_experts) if held[e] and e not in routed_now]
                for e in _evictable_first(rule, candidates, t, last_use, frequency, next_use, horizon)[:over]:
                    held[e] = False
                held_count -= over
            for e in misses:
                held[e] = True
            held_count += len(misses)
        for e, c in zip(ids, counts):
            age = t - (t if last_use[e] < 0 else last_use[e])
            frequency[e] = frequency[e] * 0.5 ** (age / LFU_HALF_LIFE) + c
            last_use[e] = t
    return Tally(reads, lookups, hits, passes)


def _uses(routed: np.ndarray) -> tuple[list[int], list[int]]:
    """The distinct experts of a pass, ascending, and how many times each was routed."""
    ids = routed.tolist()
    if len(set(ids)) == len(ids):  # one token: its k experts are distinct
        return sorted(ids), [1] * len(ids)
    counts = Counter(ids)
    ids = sorted(counts)
    return ids, [counts[e] for e in ids]


def first_uses(needed: Sequence[ExpertIds], num_experts: int) -> np.ndarray:
    """(passes + 1, E): row r holds the first pass >= r that uses each expert (inf: none), so the next
    use after pass t is row t + 1. `needed[t]`: the experts pass t uses. Also the oracle's future."""
    table = np.full((len(needed) + 1, num_experts), np.inf)
    for t in range(len(needed) - 1, -1, -1):
        table[t] = table[t + 1]
        table[t, needed[t]] = t
    return table


def _evictable_first(rule, candidates, t, last_use, frequency, next_use, horizon) -> list[int]:
    """`candidates` (expert ids, ascending) ordered most evictable first under `rule`, ties broken by
    older use, then by id."""
    if rule == "lru":
        return sorted(candidates, key=lambda e: last_use[e])
    if rule == "lfu":

        def score(e):
            age = t - (t if last_use[e] < 0 else last_use[e])
            return frequency[e] * 0.5 ** (age / LFU_HALF_LIFE), last_use[e]

        return sorted(candidates, key=score)
    ahead = next_use[t + 1].tolist()
    limit = math.inf if horizon is None else horizon

    def key(e):
        # not needed as far as MIN sees (never again, or beyond its horizon): first, oldest use first;
        # then farthest next use first
        distance = ahead[e] - t
        unseen = distance >= limit if horizon is None else distance > limit
        return (0, last_use[e]) if unseen else (1, -distance)

    return sorted(candidates, key=key)


def replay_layers(
    layers: list[list[np.ndarray]],
    capacity: int,
    rule: str,
    horizon: int | None = None,
    counted: list[bool] | None = None,
    distances: list[np.ndarray] | None = None,
) -> Tally:
    """`replay_layer` on each layer's steps (same passes, each layer's cache apart; `distances`: each
    layer's, for rule `next-use`), summed; `passes` counts each pass once, so `reads_per_pass` is experts
    read per token over all layers."""
    total = Tally()
    for n, steps in enumerate(layers):
        d = None if distances is None else distances[n]
        total = total + replay_layer(steps, capacity, rule, horizon, counted, distances=d)
    return replace(total, passes=total.passes // max(len(layers), 1))


def replay_recording(
    recording: list[dict[int, np.ndarray]], capacity: int, rule: str, horizon: int | None = None
) -> Tally:
    """An engine's recording (`PerLayerRuntime.stop_recording`: per pass, {layer: ids (tokens, k)}) from
    empty caches, counting decode passes (one token) only, summed over layers."""
    layers = sorted({layer for p in recording for layer in p})
    decode = [next(iter(p.values())).shape[0] == 1 if p else False for p in recording]
    steps = [[p.get(layer, np.empty((0,), np.int64)) for p in recording] for layer in layers]
    return replay_layers(steps, capacity, rule, horizon, counted=decode)
