"""Which experts deserve a device slot in two-tier mode: decayed routing counts and the swaps they justify.

In two-tier mode (`two_tier_runtime.py`) a miss is read in place from host memory and costs about a third
of what copying the expert into a slot costs (docs/GPU.md, "Slots and admission"). So a slot is worth filling
only for an expert used a few more times while it stays than the expert it replaces: the cache is an
admission problem, not an eviction one.
`Admission` keeps, per MoE layer, each expert's routing count decayed per forward pass (a prefill pass
counts all its tokens, so the prompt's own routing seeds the slots: router discovery for free), and
`swaps` names the experts to copy in and the slots they go to: free slots first, then a replacement only
where the newcomer's count beats the resident's by a margin, at most so many per layer each time
(`settings.AdmissionSettings`). Pure numpy on the host; the counts come from the device lazily. Not here: when
admission runs (every `AdmissionSettings.every` positions: `two_tier_runtime.py`), the copies or the counting.
"""

import numpy as np

from .settings import AdmissionSettings


class Admission:
    """Decayed routing counts of every expert of every MoE layer, and the swaps they justify by
    `settings` (its half-life, margin and swaps a layer)."""

    def __init__(self, layers: int, num_experts: int, settings: AdmissionSettings):
        self.scores = np.zeros((layers, num_experts))
        self.settings = settings

    def add(self, counts: np.ndarray, passes: int = 1):
        """The routing of `passes` forward passes: `counts` (layers, experts), how often each expert was
        routed (the older counts decay by those passes; the new ones count in full)."""
        self.scores *= 0.5 ** (passes / self.settings.half_life)
        self.scores += counts

    def seed(self, layer: int, counts: np.ndarray):
        """Add a profile's counts (for example another run's routing) to one layer's scores."""
        self.scores[layer] += counts

    def swaps(self, layer: int, expert_in_slot: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(expert ids, slots) to copy them into for one layer whose slots hold `expert_in_slot` (-1:
        free): the most routed absent experts, into free slots, then over the least routed residents."""
        scores = self.scores[layer]
        resident = np.zeros(len(scores), dtype=bool)
        resident[expert_in_slot[expert_in_slot >= 0]] = True
        absent = np.flatnonzero(~resident & (scores > 0))
        absent = absent[np.argsort(-scores[absent], kind="stable")]
        free = np.flatnonzero(expert_in_slot < 0)
        n = min(len(free), len(absent))
        ids, slots = list(absent[:n]), list(free[:n])
        occupied = np.flatnonzero(expert_in_slot >= 0)
        victims = occupied[np.argsort(scores[expert_in_slot[occupied]], kind="stable")]
        for newcomer, victim in zip(absent[n : n + self.settings.max_swaps], victims):
            if scores[newcomer] < scores[expert_in_slot[victim]] + self.settings.margin:
                break
            ids.append(newcomer)
            slots.append(victim)
        return np.asarray(ids, dtype=np.int64), np.asarray(slots, dtype=np.int64)
