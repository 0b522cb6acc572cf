"""Fit a shadow predictor to recorded routing traces (MLX, memory bounded: one shard at a time).

Each example is a (token, source layer i) pair; its targets are the true top-k experts of layers i+1 ...
i+D. The loss is a listwise softmax cross-entropy per target layer against the uniform distribution over
the true experts, summed over lookaheads and source layers. Next-gate logits are computed from the
recorded features with the model's router matrices (numpy) and fed in, so the network learns a correction
to them. AdamW with a warm-up and a cosine decay. Not here: recording or evaluation.
"""

import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np

from ..progress import Progress
from .evaluate import multi_hot, next_gate_logits, previous_token_logprobs


def _layer_batches(shard: dict, config, routers, rows: np.ndarray):
    """Per source layer: (x, logits, next-gate logits, previous token's routing, target distribution)."""
    feats, logits, ids = shard["features"][rows], shard["logits"], shard["ids"][rows]
    k = ids.shape[-1]
    out = []
    for i in range(config.num_layers - 1):
        targets = config.targets(i)
        x = feats[:, i].astype(np.float32)
        lg = logits[rows, i].astype(np.float32)
        ng = next_gate_logits(feats, routers, i, targets)
        prev = previous_token_logprobs(shard, rows, targets, config.num_experts)
        y = np.stack([multi_hot(ids[:, j], config.num_experts) for j in targets], 1).astype(np.float32) / k
        out.append(tuple(None if a is None else mx.array(a) for a in (x, lg, ng, prev, y)))
    return out


def loss_fn(predictor, batches) -> mx.array:
    total = 0.0
    for i, (x, lg, ng, prev, y) in enumerate(batches):
        scores = predictor(i, x, lg, ng, prev)
        total = total + mx.mean(-mx.sum(y * nn.log_softmax(scores, axis=-1), axis=-1))
    return total


def train_predictor(
    predictor,
    train_set,
    routers,
    epochs: int = 4,
    batch_size: int = 512,
    lr: float = 2e-3,
    weight_decay: float = 1e-4,
    seed: int = 0,
    heldout: dict | None = None,
    on_epoch: Callable[[int, dict], None] | None = None,
) -> dict:
    """Train in place on a `TraceSet`; returns the history (train and held-out loss per epoch, seconds)."""
    rng = np.random.default_rng(seed)
    mx.random.seed(seed)
    steps_per_epoch = sum(-(-s["tokens"] // batch_size) for s in train_set.manifest["shards"])
    total_steps = max(1, steps_per_epoch * epochs)
    warmup = min(100, total_steps // 10 + 1)
    schedule = optim.join_schedules(
        [
            optim.linear_schedule(lr / 20, lr, warmup),
            optim.cosine_decay(lr, max(1, total_steps - warmup), lr / 20),
        ],
        [warmup],
    )
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=weight_decay)
    value_and_grad = nn.value_and_grad(predictor, loss_fn)
    history = {"train_loss": [], "heldout_loss": [], "seconds": 0.0, "steps": 0}
    start = time.perf_counter()
    heldout_batches = _heldout_batches(heldout, predictor.config, routers) if heldout else None
    with Progress("training", total_steps, "steps") as bar:
        for epoch in range(epochs):
            losses = []
            order = rng.permutation(len(train_set.manifest["shards"]))
            for shard_index in order:
                shard = train_set.shard(int(shard_index))
                rows = rng.permutation(len(shard["tokens"]))
                for s in range(0, len(rows), batch_size):
                    batches = _layer_batches(
                        shard, predictor.config, routers, np.sort(rows[s : s + batch_size])
                    )
                    loss, grads = value_and_grad(predictor, batches)
                    optimizer.update(predictor, grads)
                    mx.eval(predictor.parameters(), optimizer.state, loss)
                    losses.append(loss.item())
                    history["steps"] += 1
                    bar.update(1, f"epoch {epoch + 1}/{epochs} loss {np.mean(losses[-50:]):.3f}")
            history["train_loss"].append(float(np.mean(losses)))
            if heldout_batches is not None:
                history["heldout_loss"].append(
                    float(np.mean([loss_fn(predictor, b).item() for b in heldout_batches]))
                )
            if on_epoch:
                on_epoch(epoch, history)
    history["seconds"] = time.perf_counter() - start
    return history


def _heldout_batches(traces: dict, config, routers, batch_size: int = 2048) -> list:
    n = len(traces["tokens"])
    return [
        _layer_batches(traces, config, routers, np.arange(s, min(n, s + batch_size)))
        for s in range(0, n, batch_size)
    ]
