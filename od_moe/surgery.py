"""Model surgery: find the MoE blocks of an mlx-lm model and swap their experts for offloaded ones.

Any mlx-lm model whose experts are a `SwitchGLU` or `SwitchMLP` qualifies: Qwen/DeepSeek/OLMoE/GLM keep
it at `layer.mlp.switch_mlp`, Mixtral/PhiMoE/MiniMax/Granite at `layer.block_sparse_moe.switch_mlp`.
Routers, shared experts, attention and norms are left alone. Not here: cache policy or reads.
"""

import re
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP

SWITCH_TYPES = (SwitchGLU, SwitchMLP)
PROJECTION_TYPES = (SwitchLinear, QuantizedSwitchLinear)


@dataclass
class MoEBlock:
    path: str  # module path of the switch, e.g. "model.layers.3.mlp.switch_mlp"
    block: nn.Module  # the module that owns the switch and the router
    attr: str  # the switch's attribute name in `block`
    switch: nn.Module  # mlx-lm's SwitchGLU / SwitchMLP

    @property
    def projections(self) -> dict[str, nn.Module]:
        return {k: v for k, v in self.switch.children().items() if isinstance(v, PROJECTION_TYPES)}

    @property
    def num_experts(self) -> int:
        return next(iter(self.projections.values()))["weight"].shape[0]

    def expert_parts(self) -> dict[str, list[str]]:
        """Per projection, the names of its arrays that hold one row per expert."""
        E = self.num_experts
        return {
            name: [k for k, v in proj.items() if isinstance(v, mx.array) and v.ndim >= 1 and v.shape[0] == E]
            for name, proj in self.projections.items()
        }


def _natural_key(path: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path))


def find_moe_blocks(model: nn.Module) -> list[MoEBlock]:
    """Every MoE block of `model`, in layer order."""
    blocks = []
    for path, module in model.named_modules():
        for attr, child in module.children().items():
            if isinstance(child, SWITCH_TYPES):
                blocks.append(MoEBlock(f"{path}.{attr}" if path else attr, module, attr, child))
    return sorted(blocks, key=lambda b: _natural_key(b.path))


def top_k_of(block: nn.Module) -> int:
    """Experts routed per token, as the block's mlx-lm code names it."""
    for attr in ("top_k", "num_experts_per_tok", "n_routed_experts_per_tok"):
        value = getattr(block, attr, None)
        if isinstance(value, int):
            return value
    gate = getattr(block, "gate", None)
    value = getattr(gate, "top_k", None)
    return value if isinstance(value, int) else 0


def expert_nbytes(blocks: list[MoEBlock]) -> int:
    """Bytes the experts of all blocks take in memory, in their in-memory dtypes (not evaluated)."""
    return sum(
        proj[name].nbytes
        for b in blocks
        for pname, names in b.expert_parts().items()
        for proj in [b.projections[pname]]
        for name in names
    )
