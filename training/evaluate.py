"""How well experts of layers ahead are named: the shadow predictor and the baselines, on the same tokens.

Definitions (../shared/DESIGN.md): recall@k at lookahead d averages, over tokens and source layers i with
i+d < L, |predicted top-k for layer i+d ∩ true top-k of layer i+d| / k, the prediction using only what
exists at layer i; recall@2k counts the true experts among the top 2k predicted, still divided by k.
Baselines: next-gate speculation (layer i+d's router on layer i's MoE input), the previous token's
experts at the same layer, and a static frequency profile (the C most used experts per layer on the first
half of the tokens, hit rate on the second half). `eviction_replay`: what each eviction rule (LRU, LFU,
od-moe's learned next-use estimate, Belady's MIN, MIN knowing the next 1, 2 or 4 tokens) would read on
the same routing (`od_moe/caching/replay.py`). Not here: training, or the report's printing
(`accounting/report.py`).
"""

import time

import mlx.core as mx
import numpy as np

from ..caching.replay import replay_layers
from ..model_surgery.routing import next_gate

PROFILE_FRACTIONS = (0.125, 0.25, 0.5)


def multi_hot(ids: np.ndarray, num_experts: int) -> np.ndarray:
    """(N, k) expert ids -> (N, E) booleans."""
    out = np.zeros((ids.shape[0], num_experts), bool)
    np.put_along_axis(out, ids.astype(np.int64), True, axis=-1)
    return out


def recall(predicted: np.ndarray, truth: np.ndarray, k: int) -> np.ndarray:
    """Per row: how many of the true experts (multi-hot (N, E)) are among `predicted` (N, m), over k."""
    return np.take_along_axis(truth, predicted.astype(np.int64), axis=-1).sum(axis=-1) / k


def top(scores: np.ndarray, m: int) -> np.ndarray:
    """Indices of the m highest scores per row."""
    return np.argpartition(-scores, m - 1, axis=-1)[..., :m]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Router logits (any dtype) -> float32 log-probabilities over the last axis."""
    lg = logits.astype(np.float32)
    lg = lg - lg.max(-1, keepdims=True)
    return lg - np.log(np.exp(lg).sum(-1, keepdims=True))


def previous_token_logprobs(traces: dict, rows: np.ndarray, layers, num_experts: int) -> np.ndarray:
    """(n, len(layers), E): the router log-probabilities of the previous token of the same sequence at
    `layers` (what the running engine feeds the predictor); zeros for a first token."""
    rows = np.asarray(rows)
    prev = np.maximum(rows - 1, 0)
    ok = (rows > 0) & (traces["sequence"][prev] == traces["sequence"][rows])
    out = np.zeros((len(rows), len(layers), num_experts), np.float32)
    for n, j in enumerate(layers):
        out[:, n] = log_softmax(traces["logits"][prev, j]) * ok[:, None]
    return out


def next_gate_logits(features: np.ndarray, routers, source: int, targets) -> np.ndarray:
    """(N, len(targets), E): the routers of `targets` applied to the recorded MoE inputs of `source`."""
    weights, biases = routers
    lo, hi = targets[0], targets[-1] + 1
    return np.array(
        next_gate(mx.array(features[:, source]), mx.array(weights[lo:hi]), mx.array(biases[lo:hi]))
    )


def baselines(traces: dict, routers, lookahead: int) -> dict:
    ids, features = traces["ids"], traces["features"]
    N, L, k = ids.shape
    E = routers[0].shape[1]
    truth = [multi_hot(ids[:, j], E) for j in range(L)]
    next_gate, next_gate_2k = {}, {}
    for d in range(1, lookahead + 1):
        r1, r2 = [], []
        for i in range(L - d):
            scores = next_gate_logits(features, routers, i, [i + d])[:, 0]
            r1.append(recall(top(scores, k), truth[i + d], k))
            r2.append(recall(top(scores, 2 * k), truth[i + d], k))
        next_gate[str(d)] = float(np.mean(r1))
        next_gate_2k[str(d)] = float(np.mean(r2))
    same = traces["sequence"][1:] == traces["sequence"][:-1]
    prev = [recall(ids[:-1, i][same], truth[i][1:][same], k) for i in range(L)]
    profile = {}
    half = N // 2
    for frac in PROFILE_FRACTIONS:
        C = max(1, int(E * frac))
        hits = []
        for i in range(L):
            counts = np.bincount(ids[:half, i].ravel(), minlength=E)
            resident = np.zeros(E, bool)
            resident[np.argsort(-counts, kind="stable")[:C]] = True
            hits.append(resident[ids[half:, i]].mean())
        profile[str(frac)] = float(np.mean(hits))
    return {
        "next_gate": next_gate,
        "next_gate_recall_at_2k": next_gate_2k,
        "prev_token": float(np.mean(np.concatenate(prev))),
        "static_profile": profile,
    }


def predictor_scores(predictor, traces: dict, routers, source: int, batch: int = 4096) -> np.ndarray:
    """Scores (N, D_i, E) of the predictor at `source` for every token of `traces`."""
    c = predictor.config
    targets = c.targets(source)
    out = []
    for s in range(0, traces["ids"].shape[0], batch):
        x = traces["features"][s : s + batch, source].astype(np.float32)
        logits = traces["logits"][s : s + batch, source].astype(np.float32)
        ng = next_gate_logits(traces["features"][s : s + batch], routers, source, targets)
        rows = np.arange(s, min(s + batch, traces["ids"].shape[0]))
        prev = mx.array(previous_token_logprobs(traces, rows, targets, c.num_experts))
        scores = predictor(source, mx.array(x), mx.array(logits), mx.array(ng), prev)
        out.append(np.array(scores))
    return np.concatenate(out)


def evaluate_predictor(predictor, traces: dict, routers) -> dict:
    """recall@k and recall@2k per lookahead, overall and per source layer."""
    c = predictor.config
    ids = traces["ids"]
    N, L, k = ids.shape
    truth = [multi_hot(ids[:, j], c.num_experts) for j in range(L)]
    per = {d: {"k": [], "2k": []} for d in range(1, c.lookahead + 1)}
    for i in range(L - 1):
        scores = predictor_scores(predictor, traces, routers, i)
        for n, j in enumerate(c.targets(i)):
            order = top(scores[:, n], 2 * k)
            s = scores[:, n]
            best2k = np.take_along_axis(order, np.argsort(-np.take_along_axis(s, order, -1), -1), -1)
            per[j - i]["k"].append(recall(best2k[:, :k], truth[j], k).mean())
            per[j - i]["2k"].append(recall(best2k, truth[j], k).mean())
    return {
        str(d): {
            "recall_at_k": float(np.mean(v["k"])),
            "recall_at_2k": float(np.mean(v["2k"])),
            "per_layer": [float(x) for x in v["k"]],
            "per_layer_at_2k": [float(x) for x in v["2k"]],
        }
        for d, v in per.items()
        if v["k"]
    }


def predictor_latency_ms(predictor, hidden_size: int, num_experts: int, repeats: int = 50) -> float:
    """Wall time to predict from every source layer for one token (next-gate logits included), in ms."""
    c = predictor.config
    x = mx.random.normal((1, hidden_size))
    logits = mx.random.normal((1, num_experts))
    prev = [mx.zeros((1, len(c.targets(i)), num_experts)) for i in range(c.num_layers - 1)]
    mx.eval(x, logits, prev)

    def once():
        mx.eval([predictor.predict_topk(i, x, logits, 2 * c.top_k, prev[i]) for i in range(c.num_layers - 1)])

    once()
    start = time.perf_counter()
    for _ in range(repeats):
        once()
    return (time.perf_counter() - start) / repeats * 1000


EVICTION_FRACTIONS = (0.125, 0.25, 0.5)
EVICTION_RULES = (("lru", None), ("lfu", None), ("min", 1), ("min", 2), ("min", 4), ("min", None))
WARM_UP_TOKENS = 256


def eviction_replay(traces: dict, num_experts: int, distances: np.ndarray | None = None) -> dict:
    """Experts read per token (all layers) and demand hit rate of each eviction rule on the held-out
    routing, token by token from empty caches, after `WARM_UP_TOKENS`: {fraction: {rule: figures}}.
    `distances` (N, L, E), the predictor's next-use estimates (`next_use.trace_distances`), add od-moe's
    rule, `next-use`."""
    ids = traces["ids"]
    N, L, _ = ids.shape
    counted = [t >= min(WARM_UP_TOKENS, N // 2) for t in range(N)]
    rules = (
        EVICTION_RULES
        if distances is None
        else EVICTION_RULES[:2] + (("next-use", None),) + EVICTION_RULES[2:]
    )
    steps = [list(ids[:, layer]) for layer in range(L)]
    out = {}
    for fraction in EVICTION_FRACTIONS:
        capacity = max(1, int(num_experts * fraction))
        figures = {}
        for rule, horizon in rules:
            per_layer = None if rule != "next-use" else [distances[:, layer] for layer in range(L)]
            total = replay_layers(steps, capacity, rule, horizon, counted, per_layer)
            name = rule if horizon is None else f"{rule}@{horizon}"
            figures[name] = {"reads_per_token": total.reads_per_pass, "hit_rate": total.hit_rate}
        out[str(fraction)] = figures
    return out
