"""Replaying recorded routing through a cache of C slots per layer under an eviction rule, on demand reads
only: how many experts each rule would read for the same tokens.

Rules: `lru` (od-moe's default), `lfu` (use counts halving every `cache.LFU_HALF_LIFE` passes, as the
cache keeps them), and Belady's `min` (evict the resident expert whose next use is farthest away), which
reads the fewest experts any policy can, prefetching or not, for that routing and capacity. With a
`horizon` of n passes, MIN knows only the next n passes: experts not used within them go first, oldest
use first. A pass needing more distinct experts than there are slots reads all it misses and keeps the
ones needed again soonest (MIN) or the last ones (others); only prefill passes do that.

Used by the bench (MIN's count beside each row's) and by `od-moe eval-predictor` (the rules on held-out
text). Not here: the live cache (`cache.py`) or what it counts (`stats.py`).
"""

import bisect
from dataclasses import dataclass

import numpy as np

from .cache import LFU_HALF_LIFE

RULES = ("lru", "lfu", "min")


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
) -> Tally:
    """One layer: `steps[t]` the expert ids routed at pass t (any shape); `counted[t]`: whether pass t
    counts (default: all); `resident`: experts in the cache before the first pass (default: none)."""
    if rule not in RULES:
        raise ValueError(f"unknown eviction rule {rule!r}: one of {', '.join(RULES)}")
    occurrences: dict[int, list[int]] = {}
    needed = [np.unique(np.asarray(s)) for s in steps]
    for t, ids in enumerate(needed):
        for e in ids.tolist():
            occurrences.setdefault(e, []).append(t)
    last_use: dict[int, float] = {}
    frequency: dict[int, float] = {}
    held = set() if resident is None else {int(e) for e in resident}
    tally = Tally()

    def next_use(e: int, t: int) -> float:
        uses = occurrences.get(e, ())
        i = bisect.bisect_right(uses, t)
        return uses[i] if i < len(uses) else np.inf

    def evictable_first(candidates: list[int], t: int) -> list[int]:
        if rule == "lru":
            return sorted(candidates, key=lambda e: last_use.get(e, -1.0))
        if rule == "lfu":

            def score(e):
                age = t - last_use.get(e, t)
                return (frequency.get(e, 0.0) * 0.5 ** (age / LFU_HALF_LIFE), last_use.get(e, -1.0))

            return sorted(candidates, key=score)

        def distance(e):
            d = next_use(e, t) - t
            unknown = horizon is not None and d > horizon
            if unknown or d == np.inf:  # not needed as far as MIN sees: oldest use first
                return (0, last_use.get(e, -1.0))
            return (1, -d)  # farthest next use first

        return sorted(candidates, key=distance)

    for t, ids in enumerate(needed):
        routed = np.asarray(steps[t]).ravel()
        hit = np.isin(routed, list(held)) if held else np.zeros(routed.size, bool)
        misses = [e for e in ids.tolist() if e not in held]
        if counted is None or counted[t]:
            tally.reads += len(misses)
            tally.lookups += routed.size
            tally.hits += int(hit.sum())
            tally.passes += 1
        if len(ids) > capacity:  # more than fit: keep those wanted soonest (MIN) or the last ones
            keep = evictable_first(ids.tolist(), t)[-capacity:] if rule == "min" else ids.tolist()[-capacity:]
            held = set(keep)
        else:
            room = capacity - len(held)
            if len(misses) > room:
                victims = evictable_first([e for e in held if e not in set(ids.tolist())], t)
                held.difference_update(victims[: len(misses) - room])
            held.update(misses)
        uses = np.unique(routed, return_counts=True)
        for e, n in zip(uses[0].tolist(), uses[1].tolist()):
            age = t - last_use.get(e, t)
            frequency[e] = frequency.get(e, 0.0) * 0.5 ** (age / LFU_HALF_LIFE) + n
            last_use[e] = t
    return tally


def replay_recording(
    recording: list[dict[int, np.ndarray]], capacity: int, rule: str, horizon: int | None = None
) -> Tally:
    """An engine's recording (`OffloadRuntime.stop_recording`: per pass, {layer: ids (tokens, k)}) from
    empty caches, counting decode passes (one token) only, summed over layers."""
    layers = sorted({layer for p in recording for layer in p})
    decode = [next(iter(p.values())).shape[0] == 1 if p else False for p in recording]
    total = Tally()
    for layer in layers:
        steps = [p.get(layer, np.empty((0,), np.int64)) for p in recording]
        tally = replay_layer(steps, capacity, rule, horizon, counted=decode)
        total = total + tally
    total.passes //= max(len(layers), 1)
    return total
