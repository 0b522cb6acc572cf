"""Experts a decoded token moves across the bus under cache rules a device kernel could run, on routing
recorded from the bundled model: least recently used and Belady's MIN (`od_moe.caching.replay`), and decayed
counts with selective admission, per layer with C rows, every miss one expert's bytes (read in place or
copied into a row: the same bytes).

    python3 lab/tools/admission_sim.py [--capacities 16,24] [--decays 0.5,0.8,0.9,0.95,0.98] [--model M]

Routing: the bench's warm-up prompt and its 3 prompts, 48 greedy tokens each, all experts resident, of the
bundled model or `--model` (a real shape's checkpoint: its routing is its random weights').
`decay a`: each expert's score is multiplied by a every pass and raised by 1 where routed; a missed
expert takes the row of the lowest-scored expert not routed in this pass only if its own score is higher
(else it is read in place and the rows stay). Deterministic: counts, not timings.
"""

import argparse
import functools

import numpy as np

import od_moe
from od_moe.bench.foundation import PROMPTS
from od_moe.bench.two_tier_grid import WARM_PROMPT
from od_moe.caching.replay import replay_recording


class DecayedCounts:
    def __init__(self, capacity: int, decay: float, experts: int = 1024):
        self.capacity, self.decay, self.score, self.held = capacity, decay, np.zeros(experts), set()

    def step(self, ids: set[int]) -> int:
        missed = sum(1 for e in ids if e not in self.held)
        self.score *= self.decay
        self.score[list(ids)] += 1
        for e in sorted(ids - self.held):
            if len(self.held) < self.capacity:
                self.held.add(e)
                continue
            worst = min((k for k in self.held if k not in ids), key=lambda k: self.score[k])
            if self.score[e] > self.score[worst]:
                self.held.remove(worst)
                self.held.add(e)
        return missed


def per_token(recording, make) -> float:
    """Misses of decode passes per decoded token, summed over layers."""
    decode = [bool(p) and next(iter(p.values())).shape[0] == 1 for p in recording]
    missed = 0
    for layer in sorted({layer for p in recording for layer in p}):
        rule = make()
        for routed, counted in zip(recording, decode):
            ids = routed.get(layer)
            for row in () if ids is None else np.asarray(ids).reshape(-1, ids.shape[-1]):
                missed += rule.step({int(e) for e in row}) * counted
    return missed / sum(decode)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacities", default="16,24")
    parser.add_argument("--decays", default="0.5,0.8,0.9,0.95,0.98")
    parser.add_argument("--model", default=None)
    args = parser.parse_args()
    engine = od_moe.load(args.model, capacity=1.0, two_tier=False)
    recording = []
    for prompt in [WARM_PROMPT, *PROMPTS]:
        recording += engine.record_routing(prompt, 48)
    decoded = sum(bool(p) and next(iter(p.values())).shape[0] == 1 for p in recording)
    for capacity in (int(c) for c in args.capacities.split(",")):
        row = {"lru": replay_recording(recording, capacity, "lru").reads / decoded}
        for decay in (float(d) for d in args.decays.split(",")):
            row[f"decay {decay:g}"] = per_token(recording, functools.partial(DecayedCounts, capacity, decay))
        row["min"] = replay_recording(recording, capacity, "min").reads / decoded
        print(f"{capacity} rows: " + ", ".join(f"{k} {v:.1f}" for k, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
