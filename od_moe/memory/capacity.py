"""Turning what the user asks for (a count, a fraction, a memory budget) into slots per MoE layer.

A slot holds one expert: weight + scales + biases of gate/up/down in their in-memory dtypes (the
quantization metadata adds about 12.5% at group size 64 and is counted). A memory budget covers the whole
engine's MLX memory: non-expert weights, C slots in every MoE layer, the working memory generation needs
beyond weights (`working_nbytes`: the KV cache of `RESERVED_CONTEXT` tokens, twice, and the routers' float32
copies prefetch predicts with), and 10% for activations. Contexts longer than `RESERVED_CONTEXT` take
twice `kv_nbytes_per_token` more per token. Not counted: host memory outside MLX (numpy staging buffers,
the page cache), MLX's cache of other freed buffers, and on CUDA the reader's staging rows
(`per_layer/mlx_rows.py`: MLX arrays kept in host memory, at most `MLX_ROW_BYTES`, which MLX counts as its
own).

On CUDA the device's memory is its own, and the slots live there: a device budget (`device_budget`: a
given size, else `DEVICE_BUDGET_FRACTION` of what the card has free) holds the CUDA runtime's libraries
(`DEVICE_LIBRARY_NBYTES`), the non-expert weights, the slots, the working memory of a stated context
(`Context`: a KV cache of a 4k-token prompt and 256 generated tokens for each sequence decoded together, a
prefill chunk's activations) and the reserve; the memory budget is then the host's (every expert, in
two-tier mode). What the card holds for the process while it decodes (`card_nbytes`) is its CUDA context,
the libraries and what the slots' budget buys; a prefill may take more, up to the device budget, and an
idle engine gives it back (`backend.release_cached_memory`).
"""

import math
import re
import sys
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

from ..errors import UserError
from ..units import format_bytes
from .backend import available_memory_bytes

BUDGET_RESERVE = 0.10  # of the budget, kept for activations
RESERVED_CONTEXT = 256  # tokens of KV cache every budget holds: mlx-lm grows its caches 256 tokens at a time
AUTO_BUDGET_FRACTION = 0.70  # of available memory, when neither capacity nor budget is given
# Of the card's free memory at load, when no device budget is given: the rest is left to the driver and
# to MLX's rounding of its allocations.
DEVICE_BUDGET_FRACTION = 0.90
# Device memory the CUDA runtime takes beside the process's context and MLX's arrays (cuBLAS workspaces,
# MLX's CUDA graphs, loaded kernels), which no MLX counter sees: 0.66 GB measured for the Qwen3-30B-A3B
# shape once MLX's cache was cleared, 0.44 GB for stock mlx-lm (docs/GPU.md, "A card smaller than the model").
DEVICE_LIBRARY_NBYTES = 700_000_000
DEFAULT_CONTEXT = 4096 + 256  # tokens a device budget keeps KV cache for: a 4k-token prompt, 256 generated
PREFILL_CHUNK = 2048  # prompt tokens mlx-lm's generation prefills at once (its prefill_step_size)
KV_PROBE = 256  # tokens of the lazy runs `kv_nbytes_per_token` measures caches with: one of mlx-lm's steps


@dataclass(frozen=True)
class Context:
    """The context a budget keeps working memory for: a KV cache of `tokens` for each of `sequences`
    decoded together, and the activations of a prefill chunk of `chunk` tokens over that context."""

    tokens: int = RESERVED_CONTEXT
    sequences: int = 1
    chunk: int = RESERVED_CONTEXT

    @classmethod
    def for_device(cls, max_positions: int, sequences: int = 1, tokens: int | None = None) -> "Context":
        """The context a device budget holds: `tokens` (default `DEFAULT_CONTEXT`, at most the model's
        positions) for each of `sequences`, prefilled in mlx-lm's chunks."""
        tokens = min(tokens or DEFAULT_CONTEXT, max_positions)
        return cls(tokens, sequences, min(tokens, PREFILL_CHUNK))

    def describe(self) -> str:
        plural = "s" if self.sequences > 1 else ""
        return f"a KV cache of {self.tokens:,} tokens for {self.sequences} sequence{plural}"


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
            percent = float(s[:-1])
        else:
            return int(s) if re.fullmatch(r"[0-9]+", s) else float(s)
    except ValueError:
        raise UserError(
            f"cannot read capacity {text!r}: give a count of experts (16), a fraction (0.25) or a "
            "percentage (25%)"
        )
    if not 0 < percent <= 100:  # 200% is not 2 experts: a percentage is a share of the layer's experts
        raise UserError(f"capacity {s} is not a share of a layer's experts: give a percentage in (0%, 100%]")
    return percent / 100


def no_slots(capacity, tiered: bool) -> bool:
    """Whether `capacity` asks for no slots where that is taken: in two-tier mode, which reads every
    expert in place (elsewhere `resolve_capacity` refuses 0)."""
    return tiered and capacity is not None and parse_capacity(capacity) == 0


# od-moe's replacements of a MoE block's switch: run, they would read experts (a pipeline rank's stand-ins
# for the other ranks' layers, `distributed.rank_split.PassThrough`, run as the rank runs them)
_EXPERT_READERS = ("od_moe.per_layer.", "od_moe.two_tier.")


def kv_nbytes_per_token(model) -> int:
    """KV-cache bytes one more token of context takes, as mlx-lm's own caches hold them for this model: the
    model run lazily (nothing is evaluated, no weight is read) on prompts of `KV_PROBE` and twice as many
    tokens into fresh caches (`make_prompt_cache`), and what their states hold apart, per token. So
    multi-head latent attention (DeepSeek's keys and values per head, or a latent), sliding windows (a
    bounded cache) and recurrent layers (a fixed state) count as they are held (every family of
    `tests/tiny_models.py` runs). A model od-moe has changed (its switches would read experts) is not run:
    a ValueError (engines keep the figure measured before, `Engine.kv_nbytes_per_token`). Where the run
    fails, the outputs of every k and v projection (a model without them counted as full multi-head
    attention, 2 x hidden a layer), said on stderr: a guess, wrong for latent attention."""
    if any(type(m).__module__.startswith(_EXPERT_READERS) for _, m in model.named_modules()):
        raise ValueError(
            "the model's MoE blocks are od-moe's: pass the KV figure measured before (kv_per_token)"
        )
    try:
        held = [_cache_nbytes(model, tokens) for tokens in (KV_PROBE, 2 * KV_PROBE)]
        return max(0, (held[1] - held[0]) // KV_PROBE)
    except Exception as e:  # a family whose code cannot run on a dummy prompt: the projections' outputs
        guess = _projected_kv_nbytes_per_token(model)
        print(
            f"od-moe: the model's KV cache could not be measured ({type(e).__name__}: {str(e)[:120]}); "
            f"counted as its k and v projections' outputs, {guess} bytes a token, a guess",
            file=sys.stderr,
        )
        return guess


def _cache_nbytes(model, tokens: int) -> int:
    """Bytes the states of fresh caches hold after a lazy run of `tokens` tokens (shapes only)."""
    caches = make_prompt_cache(model)
    model(mx.zeros((1, tokens), mx.int32), cache=caches)
    # tree_flatten without a destination gives a list of (name, value) pairs; its type also admits a dict
    return sum(
        v.nbytes
        for c in caches
        for _, v in cast(list[tuple[str, object]], tree_flatten(c.state))
        if isinstance(v, mx.array)
    )


def _projected_kv_nbytes_per_token(model) -> int:
    outputs = sum(
        m.weight.shape[0]
        for name, m in model.named_modules()
        if name.rsplit(".", 1)[-1] in ("k_proj", "v_proj") and "weight" in m
    )
    if not outputs:
        args = getattr(model, "args", None)
        outputs = 2 * getattr(args, "hidden_size", 0) * len(getattr(model, "layers", ()))
    return outputs * _itemsize(model)


def _itemsize(model) -> int:
    """Bytes per activation: the compute dtype's (that of the model's floating weights)."""
    # tree_flatten without a destination gives a list of (name, value) pairs; its type also admits a dict
    parameters = cast(list[tuple[str, mx.array]], tree_flatten(model.parameters()))
    floating = [v.dtype for _, v in parameters if mx.issubdtype(v.dtype, mx.floating)]
    return floating[0].size if floating else 4


def activation_nbytes_per_token(model, context: int = RESERVED_CONTEXT) -> int:
    """Transient bytes one prompt token of a prefill chunk takes at the layer being computed (an
    estimate from the config, fitted on the bundled model in float32: 22 kB measured for a 170-token
    chunk): per routed expert its sorted input and output (2 x hidden) and the gate, up and activated
    intermediate (3 x moe intermediate); and a row of attention scores per head over the `context`."""
    args = getattr(model, "args", None)
    hidden = getattr(args, "hidden_size", 0)
    inter = getattr(args, "moe_intermediate_size", 0) or getattr(args, "intermediate_size", hidden)
    heads = getattr(args, "num_attention_heads", 1)
    return (experts_per_token(model) * (2 * hidden + 3 * inter) + heads * context) * _itemsize(model)


def experts_per_token(model) -> int:
    """Experts routed per token, from the config (8 where it does not say)."""
    return getattr(getattr(model, "args", None), "num_experts_per_tok", None) or 8


def working_nbytes(
    model,
    moe_layers: int,
    num_experts: int,
    staged_expert_nbytes: int = 0,
    context: Context = Context(),
    kv_per_token: int | None = None,
) -> int:
    """MLX memory generation needs beyond the weights and slots, counted into every budget: the KV cache
    of the `context` (by default `RESERVED_CONTEXT` tokens of one sequence) twice, since mlx-lm grows a
    cache by copying it into a larger buffer and the old one stays in MLX's cache of freed buffers until
    mlx-lm next clears it (every 256 decoded tokens); the activations of its prefill chunk; and the dense
    float32 router copies the prefetch policies predict with. In two-tier
    mode (`staged_expert_nbytes`: an expert's bytes) also a staged pass's device copy of the experts its
    layer routes to (`two_tier/staged_passes.py`): for a chunk that long, every expert of one layer in
    practice. `kv_per_token`: `kv_nbytes_per_token(model)` where the caller has it (a model od-moe has
    changed must not be run: pass it)."""
    hidden = getattr(getattr(model, "args", None), "hidden_size", 0)
    kv_per_token = kv_nbytes_per_token(model) if kv_per_token is None else kv_per_token
    kv = 2 * kv_per_token * context.tokens * context.sequences  # the cache and its last, smaller copy
    activations = activation_nbytes_per_token(model, context.tokens) * context.chunk
    staged = min(num_experts, context.chunk * experts_per_token(model)) * staged_expert_nbytes
    return kv + activations + moe_layers * num_experts * hidden * 4 + staged


def resolve_capacity(
    capacity,
    memory_budget,
    num_experts: int,
    moe_layers: int,
    slot_nbytes: int,
    non_expert_nbytes: int,
    working_nbytes: int = 0,
) -> int:
    """Slots per MoE layer.

    capacity: int count (1..E), float fraction in (0, 1], or None; memory_budget: bytes, a size string,
    "auto" or None. With neither, the budget is 70% of available memory. A budget covers the non-expert
    weights, the slots, `working_nbytes` (see `working_nbytes`) and `BUDGET_RESERVE`.
    """
    if capacity is not None and memory_budget is not None:
        raise UserError(
            "give either a capacity or a memory budget, not both (on a GPU with memory of its own the memory "
            "budget is the host's, and goes with a capacity)"
        )
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
    slots = max(0, _slots_within(budget, non_expert_nbytes + working_nbytes, slot_nbytes, moe_layers))
    if slots < 1:
        need = budget_for(1, moe_layers, slot_nbytes, non_expert_nbytes, working_nbytes)
        raise UserError(
            f"memory budget {format_bytes(budget)} is too small for this model: it needs at least "
            f"{format_bytes(need)} (non-expert weights {format_bytes(non_expert_nbytes)} + working memory "
            f"{format_bytes(working_nbytes)} + one {format_bytes(slot_nbytes)} expert in each of "
            f"{moe_layers} layers + {BUDGET_RESERVE:.0%} reserve)"
        )
    return min(slots, num_experts)


def device_budget(device_memory, free: int) -> tuple[int, str]:
    """The device's budget in bytes and where it comes from: `device_memory` (bytes or "8GB") where
    given, else `DEVICE_BUDGET_FRACTION` of the `free` bytes the card has."""
    if device_memory is not None:
        budget = parse_size(device_memory)
        return budget, f"{format_bytes(budget)} (--device-memory)"
    budget = int(free * DEVICE_BUDGET_FRACTION)
    return (
        budget,
        f"{format_bytes(budget)} ({DEVICE_BUDGET_FRACTION:.0%} of the card's {format_bytes(free)} free)",
    )


def _slots_within(budget: int, fixed: int, slot_nbytes: int, moe_layers: int) -> int:
    """Experts per layer a `budget` holds beside `fixed` bytes and the reserve; negative where even the
    fixed bytes do not fit."""
    return int((budget * (1 - BUDGET_RESERVE) - fixed) // (slot_nbytes * moe_layers))


def budget_for(
    slots: int, moe_layers: int, slot_nbytes: int, non_expert_nbytes: int, working_nbytes: int = 0
) -> int:
    """The smallest memory budget that `resolve_capacity` turns into `slots` experts per layer."""
    fixed = non_expert_nbytes + working_nbytes
    budget = math.ceil((fixed + slot_nbytes * moe_layers * slots) / (1 - BUDGET_RESERVE))
    while budget * (1 - BUDGET_RESERVE) - fixed < slot_nbytes * moe_layers * slots:
        budget += 1  # float rounding: the budget must buy the slots back exactly
    return budget


def card_nbytes(mlx_nbytes: int, context_nbytes: int) -> int:
    """What the card holds for a process decoding with `mlx_nbytes` of MLX memory (`budget_for` its slots
    with the device context's working memory): its CUDA context, the runtime's libraries, and those."""
    return context_nbytes + DEVICE_LIBRARY_NBYTES + mlx_nbytes


def device_slots(
    capacity,
    budget: tuple[int, str],
    num_experts: int,
    moe_layers: int,
    slot_nbytes: int,
    non_expert_nbytes: int,
    working: tuple[int, str],
    none_allowed: bool,
) -> tuple[int, str]:
    """Slots per MoE layer on a device with memory of its own, and one line saying what was chosen and why:
    `capacity` where given (refused where the device `budget` (bytes, where it comes from) cannot hold it),
    else the most the budget holds beside the runtime's libraries, the non-expert weights, the `working`
    memory (bytes, what it holds) and the reserve; 0 where `none_allowed` (two-tier mode reads every expert
    in place) and not even one expert a layer fits. Nothing fitting is a UserError saying what would."""
    nbytes, where = budget
    fixed = non_expert_nbytes + working[0]
    fit = _slots_within(nbytes - DEVICE_LIBRARY_NBYTES, fixed, slot_nbytes, moe_layers)
    held = (
        f"the device budget {where} holds the CUDA runtime's libraries "
        f"({format_bytes(DEVICE_LIBRARY_NBYTES)}), the non-expert weights "
        f"({format_bytes(non_expert_nbytes)}), "
        f"working memory for {working[1]} ({format_bytes(working[0])}) and a {BUDGET_RESERVE:.0%} reserve"
    )

    def needs(slots: int) -> int:
        return budget_for(slots, moe_layers, slot_nbytes, non_expert_nbytes, working[0])

    if capacity is not None:  # 0: none (two-tier mode, `no_slots`)
        slots = capacity and resolve_capacity(
            capacity, None, num_experts, moe_layers, slot_nbytes, non_expert_nbytes
        )
        if slots > max(fit, 0):
            room = f"give --capacity {fit} or less" if fit >= 1 else "nothing fits beside them"
            raise UserError(
                f"{slots} experts per layer need a device budget of "
                f"{format_bytes(needs(slots) + DEVICE_LIBRARY_NBYTES)}, and {held}: {room}, or "
                "--device-memory to let od-moe use more of the card"
            )
        return slots, f"capacity {slots}/{num_experts} experts per layer on the device: {held}"
    if fit >= 1 or (none_allowed and fit >= 0):
        slots = min(max(fit, 0), num_experts)
        return (
            slots,
            f"capacity {slots}/{num_experts} experts per layer ({slots / num_experts:.1%}), the most " + held,
        )
    need = needs(0 if none_allowed else 1) + DEVICE_LIBRARY_NBYTES
    raise UserError(
        f"the device budget {where} is too small for this model: it needs at least {format_bytes(need)} for "
        f"the CUDA runtime's libraries ({format_bytes(DEVICE_LIBRARY_NBYTES)}), the non-expert weights "
        f"({format_bytes(non_expert_nbytes)}), working memory for {working[1]} ({format_bytes(working[0])})"
        + ("" if none_allowed else f", one {format_bytes(slot_nbytes)} expert in each of {moe_layers} layers")
        + f" and a {BUDGET_RESERVE:.0%} reserve: free device memory, or a shorter context (context_tokens)"
    )
