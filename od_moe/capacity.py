"""Turning what the user asks for (a count, a fraction, a memory budget) into slots per MoE layer.

A slot holds one expert: weight + scales + biases of gate/up/down in their in-memory dtypes (the
quantization metadata adds about 12.5% at group size 64 and is counted). A memory budget covers the whole
engine: non-expert weights, C slots in every MoE layer, and a reserve for the KV cache and activations.
"""

import math
import re

from .backend import available_memory_bytes
from .errors import UserError

BUDGET_RESERVE = 0.10  # of the budget, kept for KV cache, activations and staging buffers
AUTO_BUDGET_FRACTION = 0.70  # of available memory, when neither capacity nor budget is given

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "m": 1e6,
    "mb": 1e6,
    "g": 1e9,
    "gb": 1e9,
    "t": 1e12,
    "tb": 1e12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(text: str | int | float) -> int:
    """'8GB', '512MiB', '1.5g', 1234 -> bytes."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = int(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
        unit = match.group(2).lower() if match else None
        if not match or unit not in _UNITS:
            raise UserError(f"cannot read memory size {text!r}: write it like 8GB, 512MiB or 1073741824")
        value = int(float(match.group(1)) * _UNITS[unit])
    if value <= 0:
        raise UserError(f"memory size must be positive, got {text!r}")
    return value


def parse_capacity(text: str | int | float | None) -> int | float | None:
    """'16' -> 16 experts; '0.25' or '25%' -> a fraction of each layer's experts; None stays None."""
    if text is None or isinstance(text, (int, float)) and not isinstance(text, bool):
        return text
    s = str(text).strip()
    try:
        if s.endswith("%"):
            return float(s[:-1]) / 100
        return int(s) if re.fullmatch(r"[0-9]+", s) else float(s)
    except ValueError:
        raise UserError(
            f"cannot read capacity {text!r}: give a count of experts (16), a fraction (0.25) or a "
            "percentage (25%)"
        )


def resolve_capacity(
    capacity, memory_budget, num_experts: int, moe_layers: int, slot_nbytes: int, non_expert_nbytes: int
) -> int:
    """Slots per MoE layer.

    capacity: int count (1..E), float fraction in (0, 1], or None; memory_budget: bytes, a size string,
    "auto" or None. With neither, the budget is 70% of available memory.
    """
    if capacity is not None and memory_budget is not None:
        raise UserError("give either a capacity or a memory budget, not both")
    capacity = parse_capacity(capacity)
    if capacity is not None:
        if isinstance(capacity, bool):
            raise UserError(f"capacity must be a number, got {capacity!r}")
        if isinstance(capacity, float):
            if 0 < capacity <= 1:
                return max(1, round(capacity * num_experts))
            if not capacity.is_integer():
                raise UserError(
                    f"capacity must be a count of experts or a fraction in (0, 1], got {capacity}"
                )
        count = int(capacity)
        if not 1 <= count <= num_experts:
            raise UserError(
                f"capacity must be between 1 and {num_experts} experts per layer (or a fraction in (0, 1]), "
                f"got {count}"
            )
        return count
    if memory_budget is None or memory_budget == "auto":
        budget = int(available_memory_bytes() * AUTO_BUDGET_FRACTION)
    else:
        budget = parse_size(memory_budget)
    usable = budget * (1 - BUDGET_RESERVE) - non_expert_nbytes
    slots = int(usable // (slot_nbytes * moe_layers)) if usable > 0 else 0
    if slots < 1:
        need = budget_for(1, moe_layers, slot_nbytes, non_expert_nbytes)
        raise UserError(
            f"memory budget {budget} bytes is too small for this model: it needs at least {need} bytes "
            f"(non-expert weights {non_expert_nbytes} + one {slot_nbytes}-byte expert in each of "
            f"{moe_layers} layers + reserve)"
        )
    return min(slots, num_experts)


def budget_for(slots: int, moe_layers: int, slot_nbytes: int, non_expert_nbytes: int) -> int:
    """The smallest memory budget that `resolve_capacity` turns into `slots` experts per layer."""
    need = (non_expert_nbytes + slot_nbytes * moe_layers * slots) / (1 - BUDGET_RESERVE)
    budget = math.ceil(need)
    while budget * (1 - BUDGET_RESERVE) - non_expert_nbytes < slot_nbytes * moe_layers * slots:
        budget += 1  # float rounding: the budget must buy the slots back exactly
    return budget
