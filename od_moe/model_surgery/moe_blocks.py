"""Model surgery: find the MoE blocks of an mlx-lm model and swap their experts for offloaded ones.

Any mlx-lm model whose experts are a `SwitchGLU` or `SwitchMLP` qualifies: Qwen/DeepSeek/OLMoE/GLM keep
it at `layer.mlp.switch_mlp`, Mixtral/PhiMoE/MiniMax/Granite at `layer.block_sparse_moe.switch_mlp`,
gpt-oss/Llama 4/dots at `...experts`, Gemma 4 at `layer.experts.switch_glu` with its router on the layer.
Routers, shared experts, attention and norms are left alone. Not here: cache policy or reads.
"""

import re
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU, SwitchLinear, SwitchMLP

from ..errors import UserError
from .routing import router_of

SWITCH_TYPES = (SwitchGLU, SwitchMLP)
PROJECTION_TYPES = (SwitchLinear, QuantizedSwitchLinear)
_LAYER_PATH = re.compile(r"^(?:(.*?)\.)?layers\.(\d+)\.")


def decoder_layer_of(path: str) -> tuple[str, int] | None:
    """(the module path that holds the decoder `layers` list, "" for the model itself; the index in it) of
    the module at `path` (e.g. ("model", 3) for `model.layers.3.mlp.switch_mlp`); None where it sits in no
    `layers` list."""
    m = _LAYER_PATH.match(path)
    return None if m is None else (m.group(1) or "", int(m.group(2)))


@dataclass
class MoEBlock:
    path: str  # module path of the switch, e.g. "model.layers.3.mlp.switch_mlp"
    block: nn.Module  # the module that owns the router (and, but for Gemma 4, the switch)
    attr: str  # the switch's attribute name in `parent`
    switch: nn.Module  # mlx-lm's SwitchGLU / SwitchMLP
    parent: nn.Module | None = None  # the module that owns the switch, where that is not `block`
    owner: nn.Module | None = None  # the module that holds `block` (a decoder layer), where it is not one
    owner_attr: str = ""  # `block`'s attribute name in `owner`

    def replace_switch(self, module: nn.Module):
        """Put `module` where the switch was."""
        holder = self.block if self.parent is None else self.parent
        setattr(holder, self.attr, module)

    def replace_block(self, module: nn.Module):
        """Put `module` where the block was (in `owner`)."""
        setattr(self.owner, self.owner_attr, module)

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
    modules = dict(model.named_modules())
    blocks = []
    for path, module in modules.items():
        for attr, child in module.children().items():
            if isinstance(child, SWITCH_TYPES):
                owner = path
                while router_of(modules[owner]) is None and owner:  # Gemma 4: the router is on the layer
                    owner = owner.rpartition(".")[0]
                if owner != path and router_of(modules[owner]) is not None:
                    where = dict(block=modules[owner], parent=module)
                else:  # a block of its own inside its decoder layer
                    holder, _, name = path.rpartition(".")
                    where = dict(block=module)
                    if path and holder in modules and not name.isdigit():
                        where.update(owner=modules[holder], owner_attr=name)
                blocks.append(MoEBlock(f"{path}.{attr}" if path else attr, attr=attr, switch=child, **where))
    return sorted(blocks, key=lambda b: _natural_key(b.path))


def top_k_of(block: nn.Module) -> int:
    """Experts routed per token, as the block's (or its router's) mlx-lm code names it."""
    router = router_of(block)
    for owner in (block, router, getattr(router, "config", None)):
        for attr in ("top_k", "num_experts_per_tok", "n_routed_experts_per_tok", "k", "top_k_experts"):
            value = getattr(owner, attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                return value
    return 0


def offloadable_blocks(model: nn.Module, path) -> list[MoEBlock]:
    """The MoE blocks of `model` (loaded from `path`), or a UserError naming what od-moe would need."""
    blocks = find_moe_blocks(model)
    per_expert = [
        name
        for name, module in model.named_modules()
        if isinstance(module.get("experts"), list) and len(module["experts"]) > 1
    ]
    if not blocks and per_expert:
        raise UserError(
            f"{path}: the experts of this model ({per_expert[0]}.experts) are separate modules that mlx-lm "
            "runs one by one, not one stacked SwitchGLU/SwitchMLP: od-moe cannot offload them; use mlx-lm "
            "directly"
        )
    if not blocks:
        raise UserError(
            f"{path} has no Mixture-of-Experts layer (no SwitchGLU/SwitchMLP experts): od-moe only helps "
            "MoE models; use mlx-lm directly"
        )
    counts = sorted({b.num_experts for b in blocks})
    if len(counts) > 1:
        raise UserError(
            f"{path}: MoE layers have different numbers of experts ({', '.join(map(str, counts))}): od-moe "
            "needs the same number in every MoE layer"
        )
    return blocks


def weight_nbytes(model: nn.Module, blocks: list[MoEBlock]) -> tuple[int, int]:
    """(bytes of one expert slot, bytes of every non-expert weight) in memory, from the arrays' shapes and
    dtypes (nothing is evaluated): what capacity and memory-budget arithmetic counts."""
    experts = expert_nbytes(blocks)
    # tree_flatten without a destination gives a list of (name, value) pairs; its type also admits a dict
    total = sum(v.nbytes for _, v in cast(list[tuple[str, mx.array]], tree_flatten(model.parameters())))
    return experts // (blocks[0].num_experts * len(blocks)), total - experts


def expert_nbytes(blocks: list[MoEBlock]) -> int:
    """Bytes the experts of all blocks take in memory, in their in-memory dtypes (not evaluated)."""
    return sum(
        proj[name].nbytes
        for b in blocks
        for pname, names in b.expert_parts().items()
        for proj in [b.projections[pname]]
        for name in names
    )
