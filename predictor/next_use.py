"""The next-use head: how many passes until each expert of a layer is needed again, learned from traces.

Belady's MIN evicts the expert needed farthest ahead; this head estimates that distance. At MoE layer l,
once a token's routing is known, it gives for every expert e the probability that e is routed at layer l
within the next h tokens, for each horizon h in `HORIZONS`:

    logit_h(e) = scale[l, h] * (W_l x)[e] + weights[l, h] . f(e) + bias[l, h, e]

from the hidden state x entering the layer's MoE block and per-expert features f(e) of the recent routing:
the router's log-probability of e for this token, log(1 + passes since e was last used), log(1 + its
decayed use count) and their products (`features`). The expected distance, E[min(D, 128)] from the
cumulative probabilities, is what eviction and the prefetch governor compare (`distances`). The x term runs
on the device with the layer (lazy, evaluated with its routing); the rest is a few hundred numpy
multiply-adds on the host. A child of `ShadowPredictor`, saved in its file.
Not here: training (`od_moe.training.next_use`) or using the distances (`prefetch/policies.py`,
`per_layer/per_layer_runtime.py`).
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

HORIZONS = (1, 2, 4, 8, 16, 32, 64)  # tokens ahead
TAIL = 128  # distances are expected values of min(D, TAIL)
AGE_CAP = 512.0  # passes since last use, and the age of an expert never used
NUM_FEATURES = 6
LOGPROB_FLOOR = -16.0


def features(logprobs: np.ndarray, age: np.ndarray, uses: np.ndarray) -> np.ndarray:
    """Per-expert features (..., E, NUM_FEATURES) from the router log-probabilities of the token just
    routed, passes since each expert's last use (`AGE_CAP` if never) and its decayed use count."""
    lp = np.maximum(logprobs, LOGPROB_FLOOR)
    la, lu = np.log1p(np.minimum(age, AGE_CAP)), np.log1p(uses)
    return np.stack([lp, la, lu, la * lu, lu * lu, np.maximum(lp, -8.0)], axis=-1).astype(np.float32)


def expected_distance(probs: np.ndarray) -> np.ndarray:
    """E[min(D, TAIL)] from P(D <= h) for h in HORIZONS, (..., K, E) -> (..., E); D >= 1 always."""
    probs = np.maximum.accumulate(probs, axis=-2)  # a cumulative distribution never falls
    edges = np.array(HORIZONS + (TAIL,), np.float32)
    widths = np.diff(edges)  # P(D > h) counts for the passes from h to the next horizon
    return 1.0 + ((1.0 - probs) * widths[:, None]).sum(axis=-2)


class NextUseHead(nn.Module):
    def __init__(self, num_layers: int, hidden_size: int, num_experts: int):
        super().__init__()
        K = len(HORIZONS)
        self.proj = mx.zeros((num_layers, hidden_size, num_experts))
        self.proj_bias = mx.zeros((num_layers, num_experts))
        self.scale = mx.ones((num_layers, K))
        self.weights = mx.zeros((num_layers, K, NUM_FEATURES))
        self.bias = mx.zeros((num_layers, K, num_experts))
        object.__setattr__(self, "_host", None)  # numpy copies of the small per-layer parameters

    def for_layers(self, first: int, count: int) -> "NextUseHead":
        """The head of layers first .. first+count-1 alone, indexed from 0 (`ShadowPredictor.for_layers`)."""
        part = NextUseHead(count, *self.proj.shape[1:])
        names = ("proj", "proj_bias", "scale", "weights", "bias")
        part.update({name: getattr(self, name)[first : first + count] for name in names})
        return part

    def x_term(self, layer: int, x: mx.array) -> mx.array:
        """(n, E): W_l x, lazy (run with the layer on the device)."""
        return x.astype(mx.float32) @ self.proj[layer].astype(mx.float32) + self.proj_bias[layer]

    def __call__(self, x: mx.array, feats: mx.array) -> mx.array:
        """Training: logits (B, L, K, E) from x (B, L, H) and features (B, L, E, F), every layer at once."""
        xt = mx.einsum("blh,lhe->ble", x, self.proj) + self.proj_bias
        mixed = mx.einsum("blef,lkf->blke", feats, self.weights)
        return self.scale[None, :, :, None] * xt[:, :, None] + mixed + self.bias[None]

    def distances(self, layer: int, x_term: np.ndarray, feats: np.ndarray) -> np.ndarray:
        """(..., E) expected passes until each expert is used again, from the evaluated x term (..., E) and
        the features (..., E, F) of `layer` (numpy, on the host)."""
        if self._host is None:
            host = [np.array(a.astype(mx.float32)) for a in (self.scale, self.weights, self.bias)]
            object.__setattr__(self, "_host", host)
        scale, weights, bias = (a[layer] for a in self._host)
        logits = scale[:, None] * x_term[..., None, :] + np.swapaxes(feats @ weights.T, -1, -2) + bias
        return expected_distance(np.exp(-np.logaddexp(0.0, -logits)))  # the sigmoid, without overflow

    def changed(self):
        """Drop the host copies (after training or loading new weights)."""
        object.__setattr__(self, "_host", None)
