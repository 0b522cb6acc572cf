"""What od-moe reads from a model's routers: one router tap, the routers as matrices, next-gate logits.

Shared by the prefetch policies, the shadow predictor and trace recording, so each is written once:
- `RouterTap` wraps an MoE block's `gate` and keeps its last output (logits, or (ids, scores) for
  routers that pick experts themselves) for whoever reads it during the same forward pass.
- `router_matrices` gives the routers of all MoE blocks as dense float32 weights (L, E, H) and biases.
- `next_gate` applies routers of layers ahead to a hidden state: "next-gate" speculation.
- `routing_weights`: the weight a token gives each of its routed experts, from the tapped output.
Not here: what is predicted or prefetched (`prefetch/policies.py`, `predictor/`).
"""

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..errors import UserError


class RouterTap(nn.Module):
    """Passes an MoE block's router through unchanged and keeps its last output in `output` and its
    logits in `logits`: the output itself for linear routers; for routers that return (ids, scores)
    (DeepSeek, Granite, Gemma 4...), their projection of the same input, a lazy array computed only
    where it is read (the shadow predictor's traces)."""

    def __init__(self, gate: nn.Module):
        super().__init__()
        self.gate = gate
        self.output = self.logits = None  # plain attributes, not parameters

    def __call__(self, x):
        out = self.gate(x)
        object.__setattr__(self, "output", out)
        object.__setattr__(self, "logits", out if isinstance(out, mx.array) else router_logits(self.gate, x))
        return out


def router_logits(gate: nn.Module, x: mx.array) -> mx.array | None:
    """The logits `gate` computes from x before it picks experts (None where it has no one projection)."""
    linear = _router_linear(gate)
    if isinstance(linear, (nn.Linear, nn.QuantizedLinear)):
        return linear(x)
    return None if linear is None else x @ linear.weight.T


ROUTER_NAMES = ("gate", "router")  # what mlx-lm's MoE blocks call their router


def _router_name(block: nn.Module) -> str | None:
    if isinstance(block, nn.Module):
        for name in ROUTER_NAMES:
            if isinstance(block.get(name), nn.Module):
                return name
    return None


def tap_router(block: nn.Module) -> RouterTap | None:
    """The block's router tap, installed on first use; None for a block without a router."""
    name = _router_name(block)
    if name is None or isinstance(block[name], RouterTap):
        return block.get(name)
    setattr(block, name, RouterTap(block[name]))
    return block[name]


def router_of(block: nn.Module) -> nn.Module | None:
    """The block's router itself (inside a tap, if one is installed)."""
    name = _router_name(block)
    gate = block[name] if name else None
    return gate.gate if isinstance(gate, RouterTap) else gate


def _router_linear(gate: nn.Module | None) -> nn.Module | None:
    """The projection that gives a router its logits: the router itself (a `Linear`, DeepSeek's `MoEGate`)
    or its one linear child (Granite's `layer`, Hunyuan's `wg`, Bailing's `gate_proj`, Gemma 4's `proj`)."""
    if gate is None or "weight" in gate:
        return gate
    linears = [m for m in gate.children().values() if isinstance(m, (nn.Linear, nn.QuantizedLinear))]
    return linears[0] if len(linears) == 1 else None


def router_matrices(moe_blocks) -> tuple:
    """The routers of `moe_blocks` as dense float32 arrays: weights (L, E, H) and biases (L, E)."""
    weights, biases = [], []
    for block in moe_blocks:
        gate = _router_linear(router_of(block))
        if isinstance(gate, nn.QuantizedLinear):
            w = mx.dequantize(
                gate.weight,
                gate.scales,
                gate.get("biases"),
                gate.group_size,
                gate.bits,
                mode=getattr(gate, "mode", "affine"),
            )
        elif gate is not None:
            w = gate.weight
        else:
            raise UserError(
                f"{type(block).__name__} has no linear router (`gate` or `router` with one weight): this "
                "model's routing cannot drive next-gate speculation or the shadow predictor"
            )
        b = gate.get("bias") if isinstance(gate, nn.Module) else None
        weights.append(np.array(w.astype(mx.float32)))
        biases.append(np.array(b.astype(mx.float32)) if b is not None else np.zeros(w.shape[0], np.float32))
    return np.stack(weights), np.stack(biases)


def next_gate(x: mx.array, weights: mx.array, biases: mx.array) -> mx.array:
    """Router logits of layers ahead for hidden states x (n, H): weights (D, E, H), biases (D, E) of
    those layers -> (n, D, E)."""
    return mx.einsum("nh,deh->nde", x.astype(mx.float32), weights) + biases


def routing_weights(router_output, indices: mx.array) -> mx.array:
    """Unnormalised routing weight of each chosen expert, from a tapped router output.

    Routers that return (indices, scores) give scores directly; plain linear routers give logits,
    whose softmax is proportional to the weights of softmax-routed families (Qwen, Mixtral, OLMoE).
    """
    out = router_output
    if isinstance(out, (tuple, list)) and len(out) == 2 and out[1].shape == indices.shape:
        return out[1].astype(mx.float32)
    if isinstance(out, mx.array) and out.shape[:-1] == indices.shape[:-1]:
        probs = mx.softmax(out.astype(mx.float32), axis=-1)
        return mx.take_along_axis(probs, indices, axis=-1)
    return mx.ones(indices.shape, dtype=mx.float32)
