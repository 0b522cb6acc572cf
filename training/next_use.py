"""Fit the next-use head (`od_moe/predictor/next_use.py`) to recorded traces, and score traces with it.

For every token t and MoE layer l of a trace: the features the running engine would have right after t's
routing at l (router log-probabilities, passes since each expert's last use, decayed use counts: the
history restarts with each sequence, as a cache's would with each new prompt only roughly), the hidden
state x, and the targets, whether each expert is routed at l again within h tokens of the same sequence.
The loss is binary cross-entropy over all horizons, experts and layers; Adam, one shard at a time.
`trace_distances` gives the head's expected next-use distances on a trace, which `eviction_replay`
replays as od-moe's eviction rule. Not here: the head itself or recording.
"""

import time

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ..caching.layer_cache import LFU_HALF_LIFE
from ..predictor.next_use import AGE_CAP, HORIZONS, features
from ..progress import Progress
from .evaluate import log_softmax, multi_hot


def history(used: np.ndarray, sequence: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per token, layer and expert, right after the token's routing: passes since the last use (AGE_CAP if
    none in this sequence) and the use count decayed as the cache decays it ((N, L, E) each)."""
    N = used.shape[0]
    age, uses = np.empty(used.shape, np.float32), np.empty(used.shape, np.float32)
    last = np.full(used.shape[1:], -np.inf)
    count = np.zeros(used.shape[1:])
    decay = 0.5 ** (1.0 / LFU_HALF_LIFE)
    for t in range(N):
        if t and sequence[t] != sequence[t - 1]:
            last[:], count[:] = -np.inf, 0.0
        count = count * decay + used[t]
        last[used[t]] = t
        age[t] = np.minimum(t - last, AGE_CAP)
        uses[t] = count
    return age, uses


def targets(used: np.ndarray, sequence: np.ndarray) -> np.ndarray:
    """(N, L, K, E): whether each expert is routed at the layer again within h tokens of the same sequence."""
    N = used.shape[0]
    soonest = np.full(used.shape, np.inf, np.float32)  # tokens until the next use
    upcoming = np.full(used.shape[1:], np.inf)
    for t in range(N - 1, -1, -1):
        if t + 1 < N and sequence[t + 1] != sequence[t]:
            upcoming[:] = np.inf
        soonest[t] = upcoming - t
        upcoming[used[t]] = t
    return np.stack([soonest <= h for h in HORIZONS], axis=2)


def trace_inputs(traces: dict, num_experts: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(x (N, L, H) float32, features (N, L, E, F), used (N, L, E)) of a trace dict."""
    ids = traces["ids"]
    used = multi_hot(ids.reshape(-1, ids.shape[-1]), num_experts).reshape(*ids.shape[:2], num_experts)
    age, uses = history(used, traces["sequence"])
    feats = features(log_softmax(traces["logits"]), age, uses)
    return traces["features"].astype(np.float32), feats, used


def _loss(head, x, feats, y):
    return nn.losses.binary_cross_entropy(head(x, feats), y, with_logits=True).mean()


def fit_next_use(head, train_set, epochs: int = 2, batch_size: int = 1024, lr: float = 5e-3, seed: int = 0):
    """Train the head in place on a `TraceSet`; returns {"train_loss": per epoch, "training_s"}."""
    start = time.perf_counter()
    rng = np.random.default_rng(seed)
    optimizer = optim.Adam(learning_rate=lr)
    value_and_grad = nn.value_and_grad(head, _loss)
    num_experts = head.bias.shape[-1]
    steps = sum(-(-s["tokens"] // batch_size) for s in train_set.manifest["shards"]) * epochs
    losses = []
    with Progress("training next-use head", steps, "steps") as bar:
        for epoch in range(epochs):
            epoch_losses = []
            for index in rng.permutation(len(train_set.manifest["shards"])):
                shard = train_set.shard(int(index))
                x, feats, used = trace_inputs(shard, num_experts)
                y = targets(used, shard["sequence"])
                order = rng.permutation(len(x))
                for s in range(0, len(x), batch_size):
                    rows = np.sort(order[s : s + batch_size])
                    batch = [mx.array(a[rows], dtype=mx.float32) for a in (x, feats, y)]
                    loss, grads = value_and_grad(head, *batch)
                    optimizer.update(head, grads)
                    mx.eval(head.parameters(), optimizer.state, loss)
                    epoch_losses.append(loss.item())
                    bar.update(1, f"epoch {epoch + 1}/{epochs} loss {np.mean(epoch_losses[-50:]):.3f}")
            losses.append(float(np.mean(epoch_losses)))
    head.changed()
    return {"train_loss": losses, "training_s": time.perf_counter() - start}


def trace_distances(head, traces: dict, num_experts: int, batch: int = 4096) -> np.ndarray:
    """(N, L, E): the head's expected passes until each expert is used again, after each token's routing."""
    x, feats, _ = trace_inputs(traces, num_experts)
    out = np.empty(feats.shape[:3], np.float32)
    for layer in range(x.shape[1]):
        for s in range(0, len(x), batch):
            x_term = np.array(head.x_term(layer, mx.array(x[s : s + batch, layer])))
            out[s : s + batch, layer] = head.distances(layer, x_term, feats[s : s + batch, layer])
    return out
