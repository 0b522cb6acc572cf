"""Forecasts of a later layer's routing from an earlier layer's hidden state, for the rows the device
keeps (`kept_rows.py`): `forecast(source, x)` -> [(target layer, scores (n, E))], built lazily as MLX ops
of the pass. Two kinds: next-gate (the target's router applied to the source's state) and the shadow
network folded into a few matmuls. A decode pass runs one where `ForecastSettings.kind` asks for it (off by
default: forecasts copied ahead did not pay on the GPU measured, docs/GPU.md, "Also measured and not
kept"). Not here: what is done with the scores (`kept_rows.KeptRows`), choosing the kind
(`two_tier_runtime.forecast_of`), or the network's training (`predictor/`).
"""

import functools

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx.utils import tree_map


def next_gate_forecast(routers: tuple, distance: int):
    """Predictions from the target layers' routers applied to the source layer's hidden state:
    `forecast(source, x)` -> [(target, scores (n, E))] for target = source + distance (and, from layer 0,
    the layers before that). One matmul per target, in the hidden state's dtype."""
    weights, biases = routers
    layers = weights.shape[0]
    made = _Matrices(lambda: (np.ascontiguousarray(np.swapaxes(weights, 1, 2)), biases))

    def forecast(source: int, x: mx.array) -> list[tuple[int, mx.array]]:
        x = x.reshape(-1, x.shape[-1])
        w, b = made(x.dtype)
        return [(t, mx.addmm(b[t], x, w[t])) for t in _targets(source, distance, layers)]

    return forecast


def shadow_forecast(predictor, distance: int, routers: tuple):
    """Predictions from the shadow network (`predictor/model.py`) at `distance` layers ahead (at most its
    lookahead), from the source layer's hidden state; `routers`: the model's router weights (L, E, H) and
    biases (L, E), which its input and the next-gate term are made of. The network is folded
    for inference (the router logits it reads are a linear map of the same state, so they fold into its
    first layer; the next-gate term folds into its head): two or three matmuls per source layer."""
    c = predictor.config
    distance = min(distance, c.lookahead)
    made = {
        source: _Matrices(functools.partial(_folded, predictor, routers, source))
        for source in range(c.num_layers - 1)
    }

    def forecast(source: int, x: mx.array) -> list[tuple[int, mx.array]]:
        targets = _targets(source, distance, c.num_layers)
        if not targets:
            return []
        x = x.reshape(-1, x.shape[-1])
        first, first_b, deep, head, head_b, gate = made[source](x.dtype)
        h = nn.silu(mx.addmm(first_b, x, first))
        for w, b in deep:
            h = h + nn.silu(mx.addmm(b, h, w))
        out = []
        for t in targets:
            n = t - source - 1
            out.append((t, mx.addmm(mx.addmm(head_b[n], h, head[n]), x, gate[n])))
        return out

    return forecast


class _Matrices:
    """Numpy matrices made once (`make()` -> a tree of arrays), as MLX arrays of each dtype asked for."""

    def __init__(self, make):
        self.make, self._host, self._by_dtype = make, None, {}

    def __call__(self, dtype):
        if dtype not in self._by_dtype:
            if self._host is None:
                self._host = self.make()
            self._by_dtype[dtype] = tree_map(
                lambda a: mx.array(a.astype(np.float32)).astype(dtype), self._host
            )
            mx.eval(self._by_dtype[dtype])
        return self._by_dtype[dtype]


def _folded(predictor, routers: tuple, source: int):
    """The shadow network at `source` as plain matrices (float32 numpy): first layer (H, R) and bias with
    the router logits folded in, the deep layers [(R, R), bias], and per target the head (R, E), its bias
    with the next-gate bias scaled, and the next-gate weights scaled (H, E)."""
    c = predictor.config
    f32 = lambda a: np.array(a.astype(mx.float32))  # noqa: E731
    weights, biases = (np.asarray(a, np.float32) for a in routers)
    trunk_w, trunk_b = f32(predictor.trunks[source].weight), f32(predictor.trunks[source].bias)
    H = c.hidden_size
    tx, tl = trunk_w[:, :H], trunk_w[:, H:]  # (R, H), (R, E)
    first = tx.T + weights[source].T @ tl.T  # logits = x @ W_s.T + b_s
    first_b = trunk_b + biases[source] @ tl.T
    deep = [(f32(layer.weight).T.copy(), f32(layer.bias)) for layer in predictor.deep[source]]
    targets = c.targets(source)
    head_w = f32(predictor.heads[source].weight).reshape(len(targets), c.num_experts, -1)
    head_b = f32(predictor.heads[source].bias).reshape(len(targets), c.num_experts)
    scales = f32(predictor.gate_scales[source])
    heads, head_bs, gates = [], [], []
    for n, t in enumerate(targets):
        heads.append(head_w[n].T.copy())
        head_bs.append(head_b[n] + biases[t] * scales[n])
        gates.append(weights[t].T * scales[n][None, :])
    return first, first_b, deep, heads, head_bs, gates


def _targets(source: int, distance: int, layers: int) -> list[int]:
    near = list(range(1, min(distance, layers))) if source == 0 else []
    far = [source + distance] if source + distance < layers else []
    return near + far
