"""The shadow network: from what exists at MoE layer i, scores for every expert of layers i+1 ... i+D.

Inputs at source layer i, for each token: the hidden state entering layer i's MoE block (x_i), layer i's
router logits, the "next-gate" logits, the routers of the target layers applied to x_i (the model's own
router weights, attached at load, not stored here), and the previous token's router log-probabilities at
the target layers. Per source layer, a trunk `[x_i, logits_i] -> R` (SiLU, then `depth - 1` residual SiLU
layers of width R) feeds one head per lookahead (fused into one matmul); each head's output is added to
its next-gate logits times a learned per-expert scale, so the network starts from next-gate speculation
and learns the correction. A predictor may also carry a next-use head (`next_use.py`: how soon each
expert is needed again, for eviction). Saved as `predictor.safetensors` plus `config.json`, tied to one
model's identity.
Not here: training (`od_moe.training.train`) or prefetching.
"""

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import UserError
from ..model_surgery.routing import next_gate
from .next_use import NextUseHead

WEIGHTS_FILE, CONFIG_FILE = "predictor.safetensors", "config.json"


@dataclass
class PredictorConfig:
    model_identity: str
    num_layers: int  # MoE layers of the model
    num_experts: int
    hidden_size: int
    top_k: int
    lookahead: int = 4
    rank: int = 64
    depth: int = 1  # trunk layers: the first from the inputs, the others residual R -> R
    next_use: bool = False  # has a next-use head (eviction); predictors saved before it have none
    data_sha256: str = ""
    trained_tokens: int = 0
    metrics: dict = field(default_factory=dict)

    @classmethod
    def from_dict(cls, d: dict) -> "PredictorConfig":
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        return cls(**known)

    def misfits(self, num_layers: int, num_experts: int, hidden_size: int) -> list[str]:
        """What of this predictor's shape differs from a model's (its MoE layers, experts a layer and hidden
        size), each as "num_experts 32 (the model has 64)"; empty where it fits."""
        model = {"num_layers": num_layers, "num_experts": num_experts, "hidden_size": hidden_size}
        return [
            f"{k} {getattr(self, k)} (the model has {v})" for k, v in model.items() if getattr(self, k) != v
        ]

    def targets(self, source: int) -> list[int]:
        """The target layers a prediction made at `source` covers."""
        return list(range(source + 1, min(source + self.lookahead, self.num_layers - 1) + 1))


class ShadowPredictor(nn.Module):
    def __init__(self, config: PredictorConfig):
        super().__init__()
        c = self.config = config
        if c.depth < 1 or c.rank < 1:
            raise UserError(f"rank {c.rank} and depth {c.depth} must be at least 1")
        if not 1 <= c.lookahead < c.num_layers:
            raise UserError(
                f"lookahead {c.lookahead} must be 1 to {c.num_layers - 1}: the model has {c.num_layers} "
                "MoE layers, and a prediction must land on a layer that exists"
            )
        in_dim = c.hidden_size + c.num_experts
        sources = range(c.num_layers - 1)
        self.trunks = [nn.Linear(in_dim, c.rank) for _ in sources]
        self.deep = [
            [nn.Linear(c.rank, c.rank) for _ in range(c.depth - 1)] for _ in sources
        ]  # empty at depth 1
        self.heads = [nn.Linear(c.rank, c.num_experts * len(c.targets(i))) for i in sources]
        for head in self.heads:  # start as next-gate speculation (or uniform without it)
            head.update({"weight": mx.zeros_like(head.weight), "bias": mx.zeros_like(head.bias)})
        self.gate_scales = [mx.ones((len(c.targets(i)), c.num_experts)) for i in sources]
        # a learned weight of the previous token's router log-probabilities at each target layer
        self.prev_scales = [mx.zeros((len(c.targets(i)), c.num_experts)) for i in sources]
        if c.next_use:
            self.next_use = NextUseHead(c.num_layers, c.hidden_size, c.num_experts)
        self._routers: mx.array | None = None  # (L, E, H) and (L, E): the model's routers

    # -- routers ------------------------------------------------------------------------------------
    def attach_routers(self, weights: np.ndarray, biases: np.ndarray):
        """Give the predictor the model's router weights (L, E, H) and biases (L, E) for next-gate logits."""
        object.__setattr__(self, "_routers", (mx.array(weights, mx.float32), mx.array(biases, mx.float32)))

    def next_gate(self, source: int, x: mx.array) -> mx.array:
        """The target layers' routers applied to `x` (n, H): (n, D_i, E)."""
        if self._routers is None:
            raise RuntimeError("attach_routers() first: next-gate logits need the model's router weights")
        w, b = self._routers
        targets = self.config.targets(source)
        return next_gate(x, w[targets[0] : targets[-1] + 1], b[targets[0] : targets[-1] + 1])

    # -- prediction ---------------------------------------------------------------------------------
    def __call__(
        self,
        source: int,
        x: mx.array,
        logits: mx.array,
        gate_logits: mx.array | None = None,
        prev: mx.array | None = None,
    ) -> mx.array:
        """Scores (n, D_i, E) for the target layers of `source`, from x (n, H) and the router logits (n, E)
        of that layer. `gate_logits`, the next-gate logits (n, D_i, E), may be given precomputed
        (training); otherwise they are computed. `prev` (n, D_i, E): the previous token's router
        log-probabilities at the target layers (None: a first token)."""
        c = self.config
        x = x.astype(mx.float32)
        h = nn.silu(self.trunks[source](mx.concatenate([x, logits.astype(mx.float32)], axis=-1)))
        for layer in self.deep[source]:
            h = h + nn.silu(layer(h))
        out = self.heads[source](h).reshape(x.shape[0], -1, c.num_experts)
        gate_logits = self.next_gate(source, x) if gate_logits is None else gate_logits
        out = out + gate_logits * self.gate_scales[source]
        if prev is not None:
            out = out + prev.astype(mx.float32) * self.prev_scales[source]
        return out

    def predict_topk(
        self, source: int, x: mx.array, logits: mx.array, k: int, prev: mx.array | None = None
    ) -> mx.array:
        """The k highest-scored experts per token and target layer: (n, D_i, k), best first."""
        scores = self(source, x, logits, prev=prev)
        return mx.argsort(-scores, axis=-1)[..., :k]

    def for_layers(self, first: int, count: int) -> "ShadowPredictor":
        """The predictor of MoE layers first .. first+count-1 alone (one pipeline rank's,
        `distributed/rank_split.py`), indexed from 0: each source keeps its heads for the targets inside that
        range (a prediction past its end is the next rank's: next-gate carries it across the seam), the
        next-use head its layers. Shares the weights; attach the rank's routers to it."""
        c = self.config
        if first == 0 and count == c.num_layers:
            return self
        part = ShadowPredictor(replace(c, num_layers=count, lookahead=min(c.lookahead, max(count - 1, 1))))
        part._share(self, first)
        return part

    def _share(self, whole: "ShadowPredictor", first: int):
        """Take `whole`'s weights for MoE layers `first` on, as many as this predictor's (`for_layers`)."""
        c, E = self.config, self.config.num_experts
        for local in range(c.num_layers - 1):
            source, n = first + local, len(c.targets(local))
            self.trunks[local], self.deep[local] = whole.trunks[source], whole.deep[source]
            head = nn.Linear(c.rank, n * E)
            head.update(
                {"weight": whole.heads[source].weight[: n * E], "bias": whole.heads[source].bias[: n * E]}
            )
            self.heads[local] = head
            self.gate_scales[local] = whole.gate_scales[source][:n]
            self.prev_scales[local] = whole.prev_scales[source][:n]
        if c.next_use:
            self.next_use = whole.next_use.for_layers(first, c.num_layers)

    def retarget(self, model_identity: str):
        """Tie the predictor to another model whose hidden states and routing are the same as the one it
        was trained on (the benchmark's widened copy of the bundled model); nothing checks that they are."""
        self.config = replace(self.config, model_identity=model_identity)

    def record_metrics(self, metrics: dict):
        """Keep the held-out metrics of its training in its configuration (saved with it)."""
        self.config = replace(self.config, metrics=metrics)

    @property
    def identity(self) -> str:
        """A digest of the configuration and weights: what snapshots made with this predictor are tied to."""
        import hashlib

        from mlx.utils import tree_flatten

        digest = hashlib.sha256(json.dumps(asdict(self.config), sort_keys=True, default=str).encode())
        for key, value in tree_flatten(self.parameters()):
            digest.update(key.encode())
            digest.update(np.array(value).tobytes())
        return digest.hexdigest()[:16]

    # -- size and cost ------------------------------------------------------------------------------
    def num_params(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.size for _, v in tree_flatten(self.parameters()))

    def nbytes(self) -> int:
        from mlx.utils import tree_flatten

        return sum(v.nbytes for _, v in tree_flatten(self.parameters()))

    def macs_per_token(self) -> int:
        """Multiply-adds to predict from every source layer for one token (next-gate logits included)."""
        c = self.config
        in_dim = c.hidden_size + c.num_experts
        total = 0
        for i in range(c.num_layers - 1):
            d = len(c.targets(i))
            total += in_dim * c.rank + (c.depth - 1) * c.rank * c.rank + c.rank * c.num_experts * d
            total += c.hidden_size * c.num_experts * d  # next-gate logits
        if c.next_use:
            total += c.num_layers * c.hidden_size * c.num_experts
        return total

    # -- persistence --------------------------------------------------------------------------------
    def save(self, path):
        from mlx.utils import tree_flatten

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        mx.save_safetensors(str(out / WEIGHTS_FILE), dict(tree_flatten(self.parameters())))
        (out / CONFIG_FILE).write_text(json.dumps(asdict(self.config), indent=1))


def load_predictor(path, model_identity: str | None = None) -> ShadowPredictor:
    """A saved predictor; a UserError if the folder is not one or it was trained for another model."""
    folder = Path(path).expanduser()
    if not (folder / CONFIG_FILE).is_file() or not (folder / WEIGHTS_FILE).is_file():
        raise UserError(
            f"{folder} is not a predictor folder (needs {CONFIG_FILE} and {WEIGHTS_FILE}): "
            "give a folder that `od-moe train-predictor --out` wrote, or 'bundled' for the embedded model's"
        )
    try:
        config = PredictorConfig.from_dict(json.loads((folder / CONFIG_FILE).read_text()))
    except (json.JSONDecodeError, TypeError) as e:
        raise UserError(f"{folder / CONFIG_FILE} is not a valid predictor config: {e}")
    if model_identity is not None and config.model_identity != model_identity:
        raise UserError(
            f"predictor {folder} was trained for another model (identity {config.model_identity}, "
            f"this model is {model_identity}): train one for this model with `od-moe train-predictor "
            "--model ...`"
        )
    predictor = ShadowPredictor(config)
    try:
        predictor.load_weights(str(folder / WEIGHTS_FILE))
        mx.eval(predictor.parameters())
    except (ValueError, RuntimeError) as e:  # a truncated file, or weights of other dimensions
        raise UserError(
            f"{folder / WEIGHTS_FILE} does not hold this predictor's weights ({str(e).splitlines()[0]}): "
            "train it again with `od-moe train-predictor`"
        )
    return predictor
