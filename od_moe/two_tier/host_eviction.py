"""Which host row the host tier gives up when it needs one, past the host's memory: by the shadow network's
next-use head, the expert estimated to be routed again last goes first (Belady's rule on estimates), where
least recent use would evict an expert about to be needed.

At each single-position decode pass's MoE layer the head's inputs are made lazily from the layer's input
(the head's x term, and the router's log-probabilities from the layer's router weights), evaluated with the
pass's logits; once the pass's routing of the layer is final (its flags read), the layer's routing history
is noted and the head's expected passes until each expert is routed again become the passes at which each
is due (`due`, which `HostTier` evicts by). On the bundled model (device 16 of 64) it read 11% fewer bytes
from disk than least recent use with a host tier of 16, 14% with 8 (docs/GPU.md, "Replayed against a
clock"), at the cost of the head's work at each layer.
Not here: the rows themselves (`host_tier.py`), the head or its training (`predictor/next_use.py`,
`training/next_use.py`).
"""

import mlx.core as mx
import numpy as np

from ..caching.layer_cache import RoutingHistory
from ..predictor.next_use import AGE_CAP, features


class NextUseOrder:
    """Per MoE layer and expert, the pass at which the head estimates it is routed again (nan: no estimate
    yet, least recent use then)."""

    def __init__(self, head, routers: tuple[np.ndarray, np.ndarray], num_experts: int):
        self.head, self._routers = head, routers  # float32 weights (L, E, H) and biases (L, E)
        self._matrices: tuple[mx.array, mx.array] | None = None  # (L, H, E), (L, E) in the model's dtype
        layers = routers[0].shape[0]
        self.due = np.full((layers, num_experts), np.nan)
        self._history = [RoutingHistory(num_experts) for _ in range(layers)]
        self._inputs: dict[int, tuple[mx.array, mx.array]] = {}  # layer -> lazy (x term, log-probabilities)

    def inputs(self, layer: int, x: mx.array) -> list[mx.array]:
        """The head's inputs at `layer` of a decode pass from its input `x` (one position), lazy: the
        arrays to evaluate with the pass."""
        last = x.reshape(-1, x.shape[-1])[-1:]
        if self._matrices is None:
            w, b = self._routers
            self._matrices = (mx.array(np.swapaxes(w, 1, 2)).astype(x.dtype), mx.array(b))
            mx.eval(self._matrices)
        weights, biases = self._matrices
        logits = (last @ weights[layer]).astype(mx.float32) + biases[layer]
        made = (self.head.x_term(layer, last)[0], (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[0])
        self._inputs[layer] = made
        return list(made)

    def pending(self) -> list[mx.array]:
        """The lazy inputs not yet settled (to evaluate with a pass's logits)."""
        return [a for made in self._inputs.values() for a in made]

    def routed(self, layer: int, ids: np.ndarray, clock: int):
        """`layer`'s routing `ids` in the pass at `clock` is final: where the head's inputs were made at it
        (a decode pass of one position), note it and estimate each expert's next use."""
        made = self._inputs.pop(layer, None)
        if made is None:
            return
        history = self._history[layer]
        history.note(np.asarray(ids).reshape(1, -1))
        x_term, logprobs = (np.array(a.astype(mx.float32)) for a in made)
        age, uses = history.ages_and_uses(never=AGE_CAP)
        self.due[layer] = clock + self.head.distances(layer, x_term, features(logprobs, age, uses))

    def forget(self, layers):
        """Drop the inputs made at `layers` (a stopped pass's, computed from wrong inputs past its miss)."""
        for layer in layers:
            self._inputs.pop(layer, None)
