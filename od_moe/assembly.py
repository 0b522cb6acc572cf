"""Putting an opened model together for offloading: which path runs, the caches, the runtime, the predictor.

`engine.load` opens a model's files (`storage/model_files.py`) and then, here: decides between the two-tier
mode and the per-layer path (and says why), sizes the caches from a capacity or a memory budget, makes a
`LayerCache` per MoE block, builds the runtime behind every block's new switch, and checks a shadow
predictor against the model. Not here: the files themselves (`storage/model_files.py`), generation
(`engine.py`), what either runtime does per layer (`per_layer/per_layer_runtime.py`,
`two_tier/two_tier_runtime.py`).
"""

import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from . import per_layer, two_tier
from .caching.layer_cache import EVICTION_POLICIES, LayerCache
from .errors import UserError
from .memory import backend
from .memory.capacity import (
    DEVICE_LIBRARY_NBYTES,
    Context,
    device_budget,
    device_slots,
    no_slots,
    parse_size,
    resolve_capacity,
    working_nbytes,
)
from .model_surgery.moe_blocks import MoEBlock, top_k_of, weight_nbytes
from .per_layer.per_layer_runtime import MISS_POLICIES
from .per_layer.reader import read_threads_for
from .per_layer.settings import PerLayerSettings
from .progress import byte_progress
from .runtime import Runtime, TwoTierMode
from .storage.store import ExpertStore
from .two_tier.settings import TwoTierSettings
from .two_tier.staged_passes import positions_to_stage


def check_policies(miss_policy: str, eviction: str):
    """A UserError for a miss or eviction policy that does not exist."""
    if miss_policy not in MISS_POLICIES:
        raise UserError(f"unknown miss policy {miss_policy!r}: use one of {', '.join(MISS_POLICIES)}")
    if eviction not in EVICTION_POLICIES:
        raise UserError(f"unknown eviction policy {eviction!r}: use one of {', '.join(EVICTION_POLICIES)}")


def device_plan(device_memory, context_tokens, sequences: int, max_positions: int):
    """Where the device's memory is its own (CUDA): its budget (bytes, where it comes from) and the
    `Context` it keeps working memory for; None elsewhere, where one budget covers the engine."""
    card = backend.device_memory()
    if card is None:
        if device_memory is not None:
            raise UserError(
                "device_memory (--device-memory) is for a GPU with memory of its own (CUDA); here the "
                "device computes in host memory: give memory_budget (--memory-budget) instead"
            )
        return None
    if isinstance(sequences, bool) or not isinstance(sequences, int) or sequences < 1:
        raise UserError(f"sequences must be a positive integer, got {sequences!r}")
    return device_budget(device_memory, card[0]), Context.for_device(max_positions, sequences, context_tokens)


def host_budget(memory_budget, device) -> int | None:
    """The host's budget in bytes where the device has memory of its own and `memory_budget` is given
    (it then bounds the host: every expert in two-tier mode); None to plan from available memory."""
    if device is None or memory_budget in (None, "auto"):
        return None
    return parse_size(memory_budget)


def expert_slots(
    capacity,
    memory_budget,
    tiered: bool,
    model,
    blocks,
    slot_nbytes: int,
    non_expert: int,
    device=None,
    kv_per_token: int | None = None,
) -> tuple[int, str | None]:
    """Slots per MoE layer (0 only in two-tier mode, where every expert can be read in place), and where
    they were chosen by a device budget, the line saying so (`capacity.device_slots`). `device`
    (`device_plan`): the slots come from the device's budget; None: from `capacity` or `memory_budget` as
    one budget for the whole engine (working memory counted, with two-tier mode's staged copy).
    `kv_per_token`: the caller's `capacity.kv_nbytes_per_token(model)`, where it has it (else measured
    here)."""
    num_experts, staged = blocks[0].num_experts, slot_nbytes if tiered else 0
    if device is not None:
        budget, context = device
        working = working_nbytes(model, len(blocks), num_experts, staged, context, kv_per_token)
        return device_slots(
            0 if no_slots(capacity, tiered) else capacity,
            budget,
            num_experts,
            len(blocks),
            slot_nbytes,
            non_expert,
            (working, context.describe()),
            none_allowed=bool(tiered),
        )
    if no_slots(capacity, tiered):
        return 0, None
    working = working_nbytes(model, len(blocks), num_experts, staged, kv_per_token=kv_per_token)
    slots = resolve_capacity(
        capacity, memory_budget, num_experts, len(blocks), slot_nbytes, non_expert, working
    )
    return slots, None


@dataclass(frozen=True)
class Placement:
    """Where a model's experts live: the path (`mode`) and why, slots per MoE layer, the line saying how a
    device budget chose them (None where it did not), the non-expert bytes beside them, and past the host's
    memory the host tier's experts a layer and whether the predictor given orders its eviction (given with
    no prefetch policy: `eviction_predictor` decides whether it does)."""

    mode: TwoTierMode
    why: str
    slots: int
    choice: str | None
    non_expert_nbytes: int
    host_experts: int | None = (
        None  # past the host's memory: experts a layer in the host tier (`three_tiers`)
    )
    predictor_evicts: bool = False


def place_experts(
    model,
    blocks,
    device,
    kv_per_token,
    *,
    two_tier,
    capacity,
    memory_budget,
    miss_policy,
    prefetch,
    predictor,
) -> Placement:
    """`load`'s decision of where experts live (`two_tier_mode`, `expert_slots`, `auto_tiers`), from its
    arguments, the `device_plan`, whose budget less the runtime's libraries then bounds MLX's memory
    (`backend.limit_device_memory`), and the KV cache a token takes (`capacity.kv_nbytes_per_token`,
    measured before the model changes). The bound is the budget's, not the slots': bounded at what the
    slots need, MLX waited after every operation whenever anything else in the process (stock mlx-lm in the
    bench, a resident draft model) or a prefill's run-ahead held more (docs/GPU.md, "A card smaller than
    the model")."""
    num_experts = blocks[0].num_experts
    slot_nbytes, non_expert = weight_nbytes(model, blocks)
    host = host_budget(memory_budget, device)
    expert_nbytes = slot_nbytes * num_experts * len(blocks)
    # on a GPU with memory of its own a predictor alone (no prefetch policy asked) orders three tiers'
    # eviction (`eviction_predictor`): whether it clashes with two tiers waits for where experts live
    alone = device is not None and prefetch is None and predictor is not None
    predicts = None if alone else predictor  # what two tiers are asked to predict with
    mode, why = two_tier_mode(two_tier, expert_nbytes, miss_policy, prefetch, predicts, host)
    host_experts = None
    if device is not None:  # a GPU with memory of its own: past the host's, three tiers where they fit
        clash = clash_with_two_tiers(miss_policy, prefetch, predicts)
        held = host_held(non_expert)
        mode, why, host_experts = three_tiers(
            two_tier,
            clash is not None,
            mode,
            why,
            host,
            slot_nbytes,
            len(blocks),
            num_experts,
            top_k_of(blocks[0].block),
            held,
        )
    if alone and host_experts is None:  # every expert in host memory: the predictor is for prefetch
        mode, why = two_tier_mode(two_tier, expert_nbytes, miss_policy, prefetch, predictor, host)
    slots, choice = expert_slots(
        capacity, memory_budget, mode.tiered, model, blocks, slot_nbytes, non_expert, device, kv_per_token
    )
    if host_experts is None:
        mode, why = auto_tiers(two_tier, mode, why, slot_nbytes, slots / num_experts)
    if device is not None:
        backend.limit_device_memory(device[0][0] - DEVICE_LIBRARY_NBYTES)
    evicts = alone and host_experts is not None
    return Placement(mode, why, slots, choice, non_expert, host_experts, evicts)


def host_held(non_expert: int) -> int:
    """What a process holds in host memory besides the experts' host tier, which a host budget must leave
    room for: its resident set before the experts are read (the interpreter, MLX and the device's runtime,
    the tokenizer; in `inspect`, its own process stands for the engine's) and the non-expert weights, read
    through host memory. A cgroup with `memory.max` at the budget killed a load that took the whole budget
    for the host tier (docs/GPU.md, "Within the budget")."""
    return backend.resident_bytes() + non_expert


def three_tiers(
    asked,
    clash: bool,
    mode: TwoTierMode,
    why: str,
    host_bytes: int | None,
    slot_nbytes: int,
    layers: int,
    num_experts: int,
    top_k: int,
    held: int = 0,
) -> tuple[TwoTierMode, str, int | None]:
    """(mode, why, experts a layer in the host tier) where the device has memory of its own and the host
    cannot hold every expert (its budget `host_bytes` less `held`, what the process holds in host memory
    besides the experts; else `backend.host_room`): two tiers with a host tier of what the room holds, the
    rest read from disk (`two_tier/host_tier.py`), unless the path was asked off or for what two tiers do not
    run (`clash`: predictive prefetch, skip), or the room holds fewer than a position's `top_k` experts a
    layer (the per-layer path then). Else as given, None."""
    room = backend.host_room(host_bytes, held)
    fits = slot_nbytes * num_experts * layers <= room
    if asked not in ("auto", True) or fits or clash:
        return mode, why, None
    rows = min(num_experts - 1, room // (slot_nbytes * layers))
    where = (
        f"{room / 1e9:.2f} GB of host memory for experts of {slot_nbytes * num_experts * layers / 1e9:.2f} GB"
        + (
            f": the budget less {held / 1e9:.2f} GB the process holds besides"
            if host_bytes is not None
            else ""
        )
    )
    if rows < max(1, top_k):
        return TwoTierMode.OFF, f"per-layer path: {where} holds fewer than {top_k} experts a layer", None
    return (
        TwoTierMode.ON,
        f"three tiers: {rows} of {num_experts} experts a layer in host memory ({where}), the rest read from "
        "disk, the slots admitted by routing counts",
        rows,
    )


def read_threads_of(read_threads, caches: list[LayerCache]) -> int:
    """`read_threads` checked, or the default for the experts' size (`reader.read_threads_for`)."""
    if read_threads is None:
        read_threads = read_threads_for(max(c.layout.expert_nbytes for c in caches))
    if isinstance(read_threads, bool) or not isinstance(read_threads, int) or read_threads < 1:
        raise UserError(f"read_threads must be a positive integer, got {read_threads!r}")
    return read_threads


# In two-tier mode by "auto", experts this large get slots kept by the device (least recently used, every miss
# copied in: `two_tier/kept_rows.py`) instead of slots admitted by routing counts. Large experts (the widened
# copy's 2.65 MB) decode faster with them at small capacities and level at 50%, with fewer bytes across PCIe;
# for small ones (the bundled model's 20 KB) admission stays ahead, the row kernel costing more than the bytes
# it saves (docs/GPU.md, "Device-kept rows").
LRU_EXPERT_NBYTES = 1 << 20


def auto_tiers(
    asked, mode: TwoTierMode, why: str, slot_nbytes: int, fraction: float
) -> tuple[TwoTierMode, str]:
    """Where `asked` is "auto", `backend.two_tier_choice`'s answer (`mode`) with the kind of slots: `LRU`
    for experts of `LRU_EXPERT_NBYTES` or more, where two-tier mode is on and some but not all of them
    have slots (`fraction`). With none, large experts are staged at every pass, which `why` then says
    (`staged_passes.positions_to_stage`). Otherwise (mode, why) as they are."""
    if asked == "auto" and mode.tiered and slot_nbytes >= LRU_EXPERT_NBYTES and 0 < fraction < 1:
        return (
            TwoTierMode.LRU,
            f"{why}; slots kept by the device, least recently used ({slot_nbytes / 1e6:.1f} MB experts, "
            f"{fraction:.0%} of them in slots)",
        )
    if mode is TwoTierMode.ON and positions_to_stage(slot_nbytes, device_rows=int(fraction > 0)) == 1:
        return mode, f"{why}; no slots: each pass copies its experts to the device first, once each"
    return mode, why


def two_tier_mode(
    two_tier, expert_nbytes: int, miss_policy: str, prefetch, predictor, host_bytes: int | None = None
) -> tuple[TwoTierMode, str]:
    """(the mode, why) for `engine.load`'s arguments (`backend.two_tier_choice` decides where the host and
    device allow it); `LRU` where "lru" is asked for: its slots kept on the device
    (`two_tier/kept_rows.py`). Which slots "auto" keeps is settled once their number is known
    (`auto_tiers`)."""
    if two_tier not in (True, False, "auto", "lru"):
        raise UserError(f"two_tier must be True, False, 'auto' or 'lru', got {two_tier!r}")
    if two_tier == "lru":
        _, why = two_tier_mode(True, expert_nbytes, miss_policy, prefetch, predictor, host_bytes)
        return (
            TwoTierMode.LRU,
            f"{why}; slots kept by the device where fewer than the experts: least recently used, each "
            "miss copied in",
        )
    on, why = backend.two_tier_choice(two_tier, expert_nbytes, host_bytes)
    clash = clash_with_two_tiers(miss_policy, prefetch, predictor)
    if on and clash:
        if two_tier is True:
            raise UserError(
                f"two-tier mode computes every miss exactly and admits by routing counts: it takes no {clash}"
            )
        return TwoTierMode.OFF, f"per-layer path: {clash} was asked for"
    return (TwoTierMode.ON, why) if on else (TwoTierMode.OFF, f"per-layer path ({why})")


def clash_with_two_tiers(miss_policy: str, prefetch, predictor) -> str | None:
    """What of `load`'s arguments two tiers do not run ("skip mode", "predictive prefetch"), or None."""
    predicts = prefetch in ("next-gate", "predictor", "oracle") or (
        prefetch is None and predictor is not None
    )
    return "skip mode" if miss_policy == "skip" else "predictive prefetch" if predicts else None


def say(line: str):
    """One line on stderr where someone watches (a terminal), as the progress bars do."""
    if sys.stderr.isatty():
        print(f"od-moe: {line}", file=sys.stderr)


def build_runtime(
    store,
    blocks,
    caches,
    mode: TwoTierMode,
    why: str,
    settings: PerLayerSettings | TwoTierSettings,
    across_ranks: bool = False,
) -> Runtime:
    """The runtime behind every MoE block's new switch, built by its path from `settings` (`path_settings`):
    two tiers (`two_tier.build`), or the per-layer path (`per_layer.build`; `across_ranks`: a rank of a
    pipeline over processes, `distributed/`, where a pass run again would send and receive again)."""
    if mode.tiered:
        assert isinstance(settings, TwoTierSettings)
        settings = replace(settings, kept_by_device=mode is TwoTierMode.LRU, mode_reason=why)
        nbytes = sum(c.layout.expert_nbytes * c.num_experts for c in caches)
        with byte_progress("mapping experts", nbytes) as bar:
            return two_tier.build(store, blocks, caches, settings, bar)
    assert isinstance(settings, PerLayerSettings)
    settings = replace(settings, mode_reason=why, optimistic=False if across_ranks else settings.optimistic)
    return per_layer.build(store, blocks, caches, settings)


def settings_for_path(
    mode: TwoTierMode, given, miss_policy: str, read_threads: int, host_experts: int | None = None
) -> PerLayerSettings | TwoTierSettings:
    """The settings of the path `mode` runs: `given` (`load`'s `path_settings`) where it is that path's, with
    `load`'s own miss policy and read threads on the per-layer path, and past the host's memory the host
    tier `place_experts` sized (`host_experts`, where `given` names none; slots are then admitted at
    `AdmissionSettings.cadence`'s past the host's memory); a UserError where they are the other path's."""
    if given is not None and not isinstance(given, PerLayerSettings | TwoTierSettings):
        raise UserError(
            f"path_settings must be PerLayerSettings or TwoTierSettings, got {type(given).__name__}"
        )
    wanted = TwoTierSettings if mode.tiered else PerLayerSettings
    if given is not None and not isinstance(given, wanted):
        raise UserError(
            f"path_settings are {type(given).__name__}, but the {mode.path} path runs: give "
            f"{wanted.__name__}, or two_tier={TwoTierMode.OFF.argument if mode.tiered else True!r}"
        )
    if isinstance(given, TwoTierSettings) or mode.tiered:
        settings = given if isinstance(given, TwoTierSettings) else TwoTierSettings()
        if host_experts is not None and settings.host_experts is None:
            settings = replace(settings, host_experts=host_experts)
        return settings
    return replace(given or PerLayerSettings(), miss_policy=miss_policy, read_threads=read_threads)


def eviction_predictor(predictor, identity: str, resident: float):
    """Past the host's memory, the predictor `load` was given (a folder or a `ShadowPredictor`, for the model
    `identity`) orders the host tier's eviction by its next-use head (`two_tier/host_eviction.py`) where it
    has one and its own report (`report.json` beside a folder, from `od-moe train-predictor`) does not show
    that head reading more than recency at the resident fraction nearest `resident`: (the predictor or None,
    the line saying which order and why). A head can read fewer bytes than recency or more, as its report
    and the replay find (docs/GPU.md, "The predictor's rows on a GPU, and a run within its budget")."""
    from .predictor import ShadowPredictor

    report = None if isinstance(predictor, ShadowPredictor) else Path(predictor).expanduser() / "report.json"
    predictor = _predictor_for_model(predictor, identity)
    if not predictor.config.next_use:
        return None, "the host tier evicts by recency: the predictor has no next-use head"
    table = (
        json.loads(report.read_text()).get("eviction") if report is not None and report.is_file() else None
    )
    if not table:
        return predictor, "the host tier evicts by the predictor's next-use head"
    nearest = min(table, key=lambda fraction: abs(float(fraction) - resident))
    head, recency = (table[nearest][k]["reads_per_token"] for k in ("next-use", "lru"))
    said = (
        f"(its report: {head:.1f} experts read a token against recency's {recency:.1f} at "
        f"{float(nearest):.1%} resident)"
    )
    if head > recency:
        return None, f"the host tier evicts by recency: the predictor's next-use head reads more {said}"
    return predictor, f"the host tier evicts by the predictor's next-use head {said}"


def _predictor_for_model(predictor, identity: str):
    """A shadow predictor (a folder or a `ShadowPredictor`) trained for the model `identity`, else a
    UserError."""
    from .predictor import ShadowPredictor, load_predictor

    if not isinstance(predictor, ShadowPredictor):
        return load_predictor(predictor, identity)
    if predictor.config.model_identity != identity:
        raise UserError(
            f"the predictor was trained for another model (identity {predictor.config.model_identity}, "
            f"this model is {identity}): train one for this model"
        )
    return predictor


def attach_predictor(engine, predictor):
    """A shadow predictor (a folder or a `ShadowPredictor`) checked against this model, with its routers."""
    predictor = _predictor_for_model(predictor, engine.identity)
    if engine.stage is not None:  # a pipeline rank predicts its own layers
        predictor = predictor.for_layers(engine.stage.moe_offset, len(engine.caches))
    hidden = engine.routers()[0].shape[-1]
    wrong = predictor.config.misfits(len(engine.caches), engine.num_experts, hidden)
    if wrong:
        raise UserError(
            f"the predictor does not fit this model: {', '.join(wrong)}; train one for this model with "
            "`od-moe train-predictor`"
        )
    predictor.attach_routers(*engine.routers())
    return predictor


def cache_for(
    block: MoEBlock, index: int, store: ExpertStore, slots: int, eviction: str, own_rows: bool = True
) -> LayerCache:
    """The resident cache of MoE block `block` (the `index`-th), `slots` experts large (`own_rows`: its arrays
    hold them; False where two tiers hold them in their stacks, `LayerCache`)."""
    layout = store.block_layout(block.path, block.expert_parts(), block.num_experts)
    return LayerCache(index, block.projections, layout, slots, eviction, own_rows)
