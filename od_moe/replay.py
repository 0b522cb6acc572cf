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
text). Not here: the live cache (`cache.py`) or what it counts (`stats.py`).
"""

from dataclasses import dataclass

import numpy as np

from .cache import LFU_HALF_LIFE

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
) -> Tally:
    """One layer: `steps[t]` the expert ids routed at pass t (any shape); `counted[t]`: whether pass t
    counts (default: all); `resident`: experts in the cache before the first pass (default: none);
    `distances` (passes, E): the estimates rule `next-use` evicts by."""
    if rule not in RULES:
        raise ValueError(f"unknown eviction rule {rule!r}: one of {', '.join(RULES)}")
    if (rule == "next-use") != (distances is not None):
        raise ValueError("rule 'next-use', and only it, needs distances")
    routed = [np.asarray(s, dtype=np.int64).ravel() for s in steps]
    num_experts = 1 + max(
        [int(r.max()) for r in routed if r.size] + [-1 if resident is None else max(resident, default=-1)]
    )
    uses = [np.unique(r, return_counts=True) for r in routed]
    next_use = first_uses([u[0] for u in uses], num_experts) if rule == "min" else None
    if distances is not None:  # estimated passes ahead, as the oracle's table gives true ones
        next_use = np.asarray(distances)[:, :num_experts] + np.arange(len(uses))[:, None]
        next_use = np.concatenate([np.zeros((1, num_experts)), next_use])
    held = np.zeros(num_experts, bool)
    if resident is not None:
        held[np.asarray(resident, dtype=np.int64)] = True
    last_use = np.full(num_experts, -1.0)
    frequency = np.zeros(num_experts)
    tally = Tally()
    for t, (ids, counts) in enumerate(uses):
        misses = ids[~held[ids]]
        if counted is None or counted[t]:
            tally.reads += misses.size
            tally.lookups += routed[t].size
            tally.hits += int(held[routed[t]].sum())
            tally.passes += 1
        if ids.size > capacity:  # more than fit: keep those wanted soonest (MIN) or the last ones
            order = _evictable_first(rule, ids, t, last_use, frequency, next_use, horizon)
            held[:] = False
            held[(ids if rule in ("lru", "lfu") else order)[-capacity:]] = True
        else:
            over = misses.size - (capacity - int(held.sum()))
            if over > 0:
                candidates = held.copy()
                candidates[ids] = False
                candidates = np.flatnonzero(candidates)
                order = _evictable_first(rule, candidates, t, last_use, frequency, next_use, horizon)
                held[order[:over]] = False
            held[misses] = True
        age = t - np.where(last_use[ids] < 0, t, last_use[ids])
        frequency[ids] = frequency[ids] * 0.5 ** (age / LFU_HALF_LIFE) + counts
        last_use[ids] = t
    return tally


def first_uses(needed: list[np.ndarray], num_experts: int) -> np.ndarray:
    """(passes + 1, E): row r holds the first pass >= r that uses each expert (inf: none), so the next
    use after pass t is row t + 1. `needed[t]`: the experts pass t uses. Also the oracle's future."""
    table = np.full((len(needed) + 1, num_experts), np.inf)
    for t in range(len(needed) - 1, -1, -1):
        table[t] = table[t + 1]
        table[t, needed[t]] = t
    return table


def _evictable_first(rule, candidates, t, last_use, frequency, next_use, horizon) -> np.ndarray:
    """`candidates` (expert ids) ordered most evictable first under `rule`, ties broken by older use."""
    if rule == "lru":
        return candidates[np.argsort(last_use[candidates], kind="stable")]
    if rule == "lfu":
        age = t - np.where(last_use[candidates] < 0, t, last_use[candidates])
        score = frequency[candidates] * 0.5 ** (age / LFU_HALF_LIFE)
        return candidates[np.lexsort((last_use[candidates], score))]
    distance = next_use[t + 1, candidates] - t
    # not needed as far as MIN sees (never again, or beyond its horizon): first, oldest use first; then
    # farthest next use first
    unseen = np.isinf(distance) if horizon is None else distance > horizon
    key = np.where(unseen, last_use[candidates], -distance)
    return candidates[np.lexsort((key, ~unseen))]


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
    total.passes //= max(len(layers), 1)
    return total


def replay_recording(
    recording: list[dict[int, np.ndarray]], capacity: int, rule: str, horizon: int | None = None
) -> Tally:
    """An engine's recording (`OffloadRuntime.stop_recording`: per pass, {layer: ids (tokens, k)}) from
    empty caches, counting decode passes (one token) only, summed over layers."""
    layers = sorted({layer for p in recording for layer in p})
    decode = [next(iter(p.values())).shape[0] == 1 if p else False for p in recording]
    steps = [[p.get(layer, np.empty((0,), np.int64)) for p in recording] for layer in layers]
    return replay_layers(steps, capacity, rule, horizon, counted=decode)
