"""Could a forecast one layer ahead name the misses of the rows the device keeps, in time to copy them?
On the bundled model in `lru` two-tier mode at 25% (16 rows a layer), the bench's 3 prompts x 48 greedy
tokens: each decode pass's routing and, at every layer L-1, the next-gate scores for layer L (layer L's
router applied to layer L-1's hidden state: `forecast.next_gate_forecast`) are recorded; least recently
used rows are replayed per layer (`od_moe.caching.replay`'s rule); for each miss, is it among the forecast's
top P experts not in a row? Also how many of those P the layer then routes. Deterministic: counts, not
timings.

    python3 lab/tools/miss_forecast.py [--rows 16] [--tokens 48]

Layer 0 has no earlier layer and is left out of the recall.
"""

import argparse
import collections

import mlx.core as mx
import numpy as np

import od_moe
from od_moe.bench.foundation import PROMPTS
from od_moe.caching.replay import replay_layer
from od_moe.two_tier import forecast
from od_moe.two_tier.settings import ForecastSettings, TwoTierSettings

TOPS = (1, 2, 4, 8)


def record(tokens: int):
    """{(pass, layer): routed ids} of decode passes and {(pass, layer): next-gate scores from layer - 1},
    passes counted from the first decode pass: the scores come from a forecast of the lab's own
    (`ForecastSettings(kind="custom")`), which the runtime calls at every layer of a decode pass and which
    predicts nothing into the rows; the routing from `record_routing`."""
    scores, decoded = {}, [0]
    next_gate = []  # made once the engine's routers are known

    def kept(source, x):  # recorded, nothing predicted into the rows
        if source == 0:
            decoded[0] += 1
        for target, s in next_gate[0](source, x):
            scores[(decoded[0] - 1, target)] = np.array(s.astype(mx.float32))[0]
        return []

    recorded = TwoTierSettings(forecast=ForecastSettings(kind="custom", custom=kept))
    engine = od_moe.load(capacity="25%", two_tier="lru", path_settings=recorded)
    next_gate.append(forecast.next_gate_forecast(engine.routers(), 1))
    passes = []
    for prompt in PROMPTS:
        passes += [p for p in engine.record_routing(prompt, tokens) if next(iter(p.values())).shape[0] == 1]
    routed = {(c, layer): ids.reshape(-1) for c, p in enumerate(passes) for layer, ids in p.items()}
    return routed, scores, len(engine.caches)


def replay(routed, scores, layers: int, rows: int) -> collections.Counter:
    """LRU over `rows` a layer (`od_moe.caching.replay`'s rule) on the recorded passes, and what the forecast
    of each pass names among the experts not held before it."""
    counts = collections.Counter()
    passes = sorted({c for c, _ in routed})
    for layer in range(layers):
        steps = [routed[(c, layer)] for c in passes]

        def observe(t, missed, held, layer=layer, steps=steps):
            counts["misses"] += len(missed)
            c = passes[t]
            if layer == 0 or (c, layer) not in scores:
                return
            order = [e for e in np.argsort(-scores[(c, layer)], kind="stable").tolist() if e not in held]
            routed_now = set(steps[t].tolist())
            counts["forecast"] += len(missed)
            for top in TOPS:
                named = set(order[:top])
                counts[f"recall{top}"] += sum(e in named for e in missed)
                counts[f"routed{top}"] += len(named & routed_now)
                counts[f"named{top}"] += len(named)

        replay_layer(steps, rows, "lru", observe=observe)
    counts["passes"] = len(passes)
    return counts


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    args = parser.parse_args()
    counts = replay(*record(args.tokens), args.rows)
    print(f"{counts['passes']} decode passes, {counts['misses'] / counts['passes']:.1f} misses a token")
    print("| top P not in a row | misses named | named experts routed |")
    print("|---|---|---|")
    for top in TOPS:
        recall = counts[f"recall{top}"] / counts["forecast"]
        print(f"| {top} | {recall:.3f} | {counts[f'routed{top}'] / counts[f'named{top}']:.3f} |")


if __name__ == "__main__":
    main()
