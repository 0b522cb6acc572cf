"""Preflight: what loading a model would do, without loading any weight.

`inspect_model` (behind `od-moe inspect` and the server's `/v1/capabilities`) reads config.json and
the safetensors headers (`storage/store.py`) and builds mlx-lm's model lazily (no array is evaluated, so no
weight is read), then reports what `od_moe.load` would find: the family, the MoE layers, experts per
layer and routed per token, the checkpoint layout, bytes per expert on disk and in memory, the
non-expert bytes, the working memory generation needs, the capacity a memory budget buys and the budget
a capacity needs (the same arithmetic as `load`: `surgery.weight_nbytes` and `memory/capacity.py`), whether a
trained predictor is there and fits, and whether exact mode is supported (or the one-line reason it is not).
`format_inspection` renders the report for the terminal. Not here: loading, generation or the server.
"""

import json
import re
import threading
import weakref
from pathlib import Path
from typing import cast

import mlx.core as mx
import mlx_lm.utils
from mlx.utils import tree_flatten

from .assembly import auto_tiers
from .distributed.rank_split import layers_of, stage_ranges
from .errors import UserError
from .memory import backend
from .memory.capacity import (
    AUTO_BUDGET_FRACTION,
    DEVICE_LIBRARY_NBYTES,
    RESERVED_CONTEXT,
    budget_for,
    card_nbytes,
    kv_nbytes_per_token,
    no_slots,
    parse_capacity,
    parse_size,
    resolve_capacity,
    working_nbytes,
)
from .model_surgery.moe_blocks import offloadable_blocks, top_k_of, weight_nbytes
from .predictor.model import CONFIG_FILE, WEIGHTS_FILE
from .runtime import TwoTierMode
from .storage.store import ExpertStore
from .units import format_bytes as _size

FRACTIONS = (0.125, 0.25, 0.5, 1.0)  # the capacities whose budgets every report lists


def _predictor_candidates(path: Path, predictor) -> list[Path]:
    from .engine import DEFAULT_MODEL, DEFAULT_PREDICTOR

    if predictor is not None:
        return [Path(predictor).expanduser()]
    if path.resolve() == DEFAULT_MODEL.resolve():
        return [DEFAULT_PREDICTOR]
    return [path.parent / f"{path.name}-predictor", path / "predictor"]


def _predictor_report(path: Path, predictor, identity: str, moe_layers: int, num_experts: int) -> dict:
    """Whether a predictor folder is there and fits this model (its config only: no weights are read)."""
    for folder in _predictor_candidates(path, predictor):
        config_file = folder / CONFIG_FILE
        if not config_file.is_file() or not (folder / WEIGHTS_FILE).is_file():
            continue
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError:
            return {
                "path": str(folder),
                "present": True,
                "fits": False,
                "reason": f"unreadable {config_file}",
            }
        dims = (config.get("num_layers"), config.get("num_experts"))
        reason = None
        if config.get("model_identity") != identity:
            reason = (
                f"trained for another model (identity {config.get('model_identity')}, this is {identity})"
            )
        elif dims != (moe_layers, num_experts):
            reason = f"shaped for {dims[0]} MoE layers x {dims[1]} experts"
        return {"path": str(folder), "present": True, "fits": reason is None, "reason": reason}
    return {"path": None, "present": False, "fits": False, "reason": "none found: `od-moe train-predictor`"}


def inspect_model(
    model=None,
    memory_budget=None,
    capacity=None,
    predictor=None,
    dtype="auto",
    ranks=1,
    packed="auto",
    **device,
) -> dict:
    """What `od_moe.load(model, ...)` would find and use, from config.json and the safetensors headers.
    memory_budget, packed, `device` (device_memory, context_tokens): as `load` takes them; capacity: a
    count, fraction or "25%" whose budget to report; predictor: a folder to check (None: `<model>-predictor`
    beside it, or the bundled one); ranks: processes to split the layers over (each rank's memory)."""
    from .storage.model_files import model_identity, resolve_model_path

    path = resolve_model_path(model)
    config = json.loads((path / "config.json").read_text())
    store = ExpertStore(path)
    report = {
        "model": str(path),
        "family": config.get("model_type"),
        "file_bytes": store.nbytes,
        "model_identity": model_identity(path, store),
    }
    try:
        mlx_model, _ = mlx_lm.utils.load_model(path, lazy=True)
    except (ValueError, FileNotFoundError, KeyError, RuntimeError) as e:
        return {**report, "exact": False, "reason": f"mlx-lm cannot build this model: {e}"}
    target = backend.compute_dtype(dtype)
    if target is not None:
        mlx_model.set_dtype(target)  # lazy: counts the bytes `load` will hold, reads nothing
    try:
        blocks = offloadable_blocks(mlx_model, path)
        layouts = [store.block_layout(b.path, b.expert_parts(), b.num_experts) for b in blocks]
    except UserError as e:
        return {**report, "exact": False, "reason": str(e)}
    num_experts, moe_layers = blocks[0].num_experts, len(blocks)
    slot_nbytes, non_expert = weight_nbytes(mlx_model, blocks)
    top_k = top_k_of(blocks[0].block)
    tiers = _two_tier_report(slot_nbytes, num_experts, moe_layers, top_k, memory_budget, non_expert)
    kv, staged = kv_nbytes_per_token(mlx_model), slot_nbytes if tiers["auto"] else 0
    working = working_nbytes(mlx_model, moe_layers, num_experts, staged, kv_per_token=kv)
    bought = _budget_report(memory_budget, num_experts, moe_layers, slot_nbytes, non_expert, working)

    def budget(count: int) -> int:
        return budget_for(count, moe_layers, slot_nbytes, non_expert, working)

    report.update(
        exact=True,
        reason=None,
        moe_layers=moe_layers,
        moe_layer_paths=[b.path for b in blocks],
        experts_per_layer=num_experts,
        routed_per_token=top_k,
        layout=layouts[0].layout,
        expert_bytes_on_disk=layouts[0].expert_nbytes,
        expert_bytes=slot_nbytes,
        all_experts_bytes=slot_nbytes * num_experts * moe_layers,
        non_expert_bytes=non_expert,
        working_bytes=working,
        kv_bytes_per_token=kv,
        dtype=str(target or "model").removeprefix("mlx.core."),
        memory_budget=bought,
        device=_device_report(mlx_model, blocks, slot_nbytes, non_expert, kv, tiers["auto"], path, **device),
        budgets={f"{f:g}": budget(max(1, round(f * num_experts))) for f in FRACTIONS},
        predictor=_predictor_report(path, predictor, report["model_identity"], moe_layers, num_experts),
        packed=_packed_file(path, store, packed),
    )
    if ranks > 1:
        try:
            report["ranks"] = _rank_rows(mlx_model, blocks, slot_nbytes, kv, ranks)
        except UserError as e:
            report["ranks"] = {"error": str(e)}
    if capacity is not None:
        report["capacity"] = _capacity_report(capacity, tiers["auto"], report, budget)
    fraction = report["capacity"]["capacity"] / num_experts if "capacity" in report else bought["fraction"]
    report["two_tier"] = _slots_report(tiers, slot_nbytes, fraction, num_experts)
    return report


def _budget_report(memory_budget, num_experts, moe_layers, slot_nbytes, non_expert, working) -> dict:
    """The memory budget (given, or 70% of available memory) and the slots it buys, as `load` counts it
    (where the device has memory of its own, the host's: it holds the experts of two-tier mode)."""
    auto = memory_budget is None or memory_budget == "auto"
    given = (
        int(backend.available_memory_bytes() * AUTO_BUDGET_FRACTION) if auto else parse_size(memory_budget)
    )
    try:
        slots = resolve_capacity(None, given, num_experts, moe_layers, slot_nbytes, non_expert, working)
        return {"bytes": given, "auto": auto, "capacity": slots, "fraction": slots / num_experts}
    except UserError as e:  # too small: say so in the report
        return {"bytes": given, "auto": auto, "capacity": 0, "fraction": 0.0, "error": str(e)}


def _device_report(
    mlx_model, blocks, slot_nbytes, non_expert, kv, tiered, path, device_memory=None, context_tokens=None
) -> dict | None:
    """Where the device has memory of its own (CUDA): what the card has free, the device budget and the
    slots `load` would give with no capacity (`assembly.expert_slots`), or why none fit, and what the card
    holds for the process at each of `FRACTIONS` (`card_bytes`: `capacity.card_nbytes`); None elsewhere."""
    from .assembly import device_plan, expert_slots
    from .storage.model_files import max_positions

    plan = device_plan(device_memory, context_tokens, 1, max_positions(path))
    if plan is None:
        return None
    (budget, where), context = plan
    card = backend.device_memory()
    assert card is not None  # a plan is made only where the device has memory of its own
    free, total = card
    num_experts, moe_layers = blocks[0].num_experts, len(blocks)
    staged = slot_nbytes if tiered else 0
    working = working_nbytes(mlx_model, moe_layers, num_experts, staged, context, kv)
    report = {"free_bytes": free, "total_bytes": total, "budget_bytes": budget, "budget_from": where}
    report["context"] = {"tokens": context.tokens, "sequences": context.sequences, "working_bytes": working}
    report["context_bytes"], report["library_bytes"] = backend.context_bytes(), DEVICE_LIBRARY_NBYTES
    report["card_bytes"] = {
        f"{f:g}": _card_bytes(max(1, round(f * num_experts)), report, moe_layers, slot_nbytes, non_expert)
        for f in FRACTIONS
    }
    try:
        slots, choice = expert_slots(None, None, tiered, mlx_model, blocks, slot_nbytes, non_expert, plan, kv)
        return {**report, "capacity": slots, "choice": choice}
    except UserError as e:
        return {**report, "capacity": None, "choice": str(e)}


def _card_bytes(slots: int, device: dict, moe_layers: int, slot_nbytes: int, non_expert: int) -> int:
    """What the card holds for a process with `slots` experts per layer: its context, the libraries and
    the bound on MLX's memory (`budget_for` with the device context's working memory)."""
    mlx_bytes = budget_for(slots, moe_layers, slot_nbytes, non_expert, device["context"]["working_bytes"])
    return card_nbytes(mlx_bytes, device["context_bytes"])


def _capacity_report(capacity, tiered: bool, report: dict, budget) -> dict:
    """The slots `capacity` gives and the budget (`budget(count)`) they need, with what the card holds for
    them where the device has memory of its own; 0 allowed where two-tier mode is on by default, as `load`
    takes it (every expert then read in place)."""
    num_experts, moe_layers, slot_nbytes = (
        report["experts_per_layer"],
        report["moe_layers"],
        report["expert_bytes"],
    )
    if no_slots(capacity, tiered):
        count = 0
    else:
        count = resolve_capacity(parse_capacity(capacity), None, num_experts, moe_layers, slot_nbytes, 0)
    found = {"given": capacity, "capacity": count, "budget_bytes": budget(count)}
    if report["device"]:
        found["card_bytes"] = _card_bytes(
            count, report["device"], moe_layers, slot_nbytes, report["non_expert_bytes"]
        )
    return found


def _two_tier_report(
    slot_nbytes: int, num_experts: int, layers: int, top_k: int, memory_budget, non_expert: int
) -> dict:
    """Two-tier mode by "auto" (every expert in host memory, the budget's slots on the device:
    `two_tier/two_tier_runtime.py`; past the host's memory three tiers, `assembly.three_tiers`): whether it
    is on, and why, and the experts a layer the host tier holds (None: all, or no host tier); where the
    device has memory of its own, a memory budget is the host's, as `load` takes it
    (`assembly.host_budget`)."""
    from .assembly import host_budget, host_held, three_tiers

    host_bytes = slot_nbytes * num_experts * layers
    device = backend.device_memory()
    budget = host_budget(memory_budget, device)
    on, why = backend.two_tier_choice("auto", host_bytes, budget)
    mode, host_experts = TwoTierMode.ON if on else TwoTierMode.OFF, None
    if device is not None:
        held = host_held(non_expert)
        mode, why, host_experts = three_tiers(
            "auto", False, mode, why, budget, slot_nbytes, layers, num_experts, top_k, held
        )
    return {"auto": mode.tiered, "reason": why, "host_bytes": host_bytes, "host_experts": host_experts}


def _slots_report(tiers: dict, slot_nbytes: int, fraction: float, num_experts: int) -> dict:
    """`tiers` with the slots "auto" keeps at `fraction` of the experts in slots (the capacity asked, else
    the budget's), and why; the experts a layer each tier holds ("tiers": device, host, disk)."""
    asked = TwoTierMode.ON if tiers["auto"] else TwoTierMode.OFF
    three = tiers["host_experts"] is not None
    mode, why = (
        (asked, tiers["reason"])
        if three
        else auto_tiers("auto", asked, tiers["reason"], slot_nbytes, fraction)
    )
    slots = "device-kept (least recently used)" if mode is TwoTierMode.LRU else "admitted by routing counts"
    device = round(fraction * num_experts)
    host = tiers["host_experts"] if three else num_experts if tiers["auto"] else 0
    disk = max(0, num_experts - device - host) if three else 0 if tiers["auto"] else num_experts - device
    return {**tiers, "slots": slots, "reason": why, "tiers": {"device": device, "host": host, "disk": disk}}


def _rank_rows(mlx_model, blocks, slot_nbytes: int, kv: int, ranks: int) -> list[dict]:
    """Per rank of a pipeline over `ranks` processes: its decoder layers, MoE layers, the bytes of its
    experts and of its other weights (its layers' and those every rank holds: embeddings, final norm, head),
    and the budget each listed capacity needs there (the arithmetic `load` does on that rank)."""
    layers_path, moe = layers_of(mlx_model, [b.path for b in blocks])
    num_layers = len((dict(mlx_model.named_modules())[layers_path] if layers_path else mlx_model).layers)
    prefix = re.compile(rf"^{re.escape(layers_path + '.' if layers_path else '')}layers\.(\d+)\.")
    per_layer: dict[int, int] = {}
    shared = 0
    # tree_flatten without a destination gives a list of (name, value) pairs; its type also admits a dict
    for name, value in cast(list[tuple[str, mx.array]], tree_flatten(mlx_model.parameters())):
        m = prefix.match(name)
        if m is None:
            shared += value.nbytes
        else:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + value.nbytes
    num_experts = blocks[0].num_experts
    rows = []
    for rank, (start, end) in enumerate(stage_ranges(moe, num_layers, ranks)):
        count = sum(start <= i < end for i in moe)
        experts = slot_nbytes * num_experts * count
        non_expert = shared + sum(per_layer.get(i, 0) for i in range(start, end)) - experts
        working = working_nbytes(mlx_model, count, num_experts, kv_per_token=kv)
        budgets = {
            f"{f:g}": budget_for(max(1, round(f * num_experts)), count, slot_nbytes, non_expert, working)
            for f in FRACTIONS
        }
        rows.append(
            dict(
                rank=rank,
                layers=[start, end],
                moe_layers=count,
                all_experts_bytes=experts,
                non_expert_bytes=non_expert,
                budgets=budgets,
            )
        )
    return rows


_computed: weakref.WeakKeyDictionary[object, dict] = weakref.WeakKeyDictionary()  # engine -> its capabilities
_lock = threading.Lock()


def _packed_file(path, store, packed) -> str | None:
    """The packed experts `load(packed=packed)` would read, if any (checked as `load` checks them)."""
    from .storage.model_files import use_packed_experts

    use_packed_experts(store, path, packed)
    return str(store.packed) if store.packed else None


def engine_capabilities(engine) -> dict:
    """`inspect_model`'s report for a loaded engine's model at its capacity, with what the engine runs
    (`loaded`): the server's `/v1/capabilities`. Computed once per engine; builds only lazy arrays, never
    evaluated, so any thread may call it."""
    with _lock:
        if engine not in _computed:
            report = inspect_model(engine.model_path, capacity=engine.capacity)
            report["loaded"] = {
                "capacity": engine.capacity,
                "capacity_fraction": engine.capacity / engine.num_experts,
                "miss_policy": engine.miss_policy,
                "exact": engine.miss_policy == "load",
                "prefetch": engine.policy_name,
                "predictor": engine.predictor is not None,
                "expert_bytes": engine.caches[0].slot_nbytes,
                "non_expert_bytes": engine.non_expert_nbytes,
                "packed_experts": engine.runtime.store.packed is not None,
                "mode": engine.mode.path,
                "mode_reason": engine.mode_reason,
            }
            _computed[engine] = report
        return _computed[engine]


def format_inspection(report: dict) -> str:
    """The report as a few lines of text."""
    lines = [f"model      {report['model']} ({report['family']}, {_size(report['file_bytes'])} of files)"]
    if not report["exact"]:
        return "\n".join([*lines, f"supported  no: {report['reason']}"])
    lines += [
        "supported  yes: exact (load) and approximate (skip) modes",
        f"experts    {report['moe_layers']} MoE layers x {report['experts_per_layer']} experts, "
        f"{report['routed_per_token']} routed per token ({report['layout']} layout)",
        f"bytes      {_size(report['expert_bytes'])} per expert in memory "
        f"({_size(report['expert_bytes_on_disk'])} on disk), {_size(report['all_experts_bytes'])} all "
        f"experts, {_size(report['non_expert_bytes'])} non-expert ({report['dtype']}), "
        f"{_size(report['working_bytes'])} working (KV cache and prefill of {RESERVED_CONTEXT} tokens at "
        f"{_size(report['kv_bytes_per_token'])} a token, "
        f"routers{', a staged layer of two-tier mode' if report['two_tier']['auto'] else ''})",
        _budget_line(report),
    ]
    if not report["device"]:  # on a device of its own the card line says what each capacity needs
        lines.append(
            "needs      " + ", ".join(f"{float(f):.1%}: {_size(b)}" for f, b in report["budgets"].items())
        )
    else:
        d = report["device"]
        lines.append(f"device     {_size(d['free_bytes'])} free of {_size(d['total_bytes'])}: {d['choice']}")
        lines.append(
            "card       "
            + ", ".join(f"{float(f):.1%}: {_size(b)}" for f, b in d["card_bytes"].items())
            + f" while decoding (its CUDA context {_size(d['context_bytes'])}, the runtime's libraries "
            f"{_size(d['library_bytes'])}, non-expert weights, slots, working memory for a KV cache of "
            f"{d['context']['tokens']:,} tokens ({_size(d['context']['working_bytes'])}), a 10% reserve); "
            "a prefill may take more, up to the device budget, given back when the engine is idle"
        )
    if "capacity" in report:
        c = report["capacity"]
        lines.append(
            f"capacity   {c['capacity']} experts per layer needs a budget of {_size(c['budget_bytes'])}"
            + (f"; the card holds {_size(c['card_bytes'])} for it" if "card_bytes" in c else "")
        )
    p = report["predictor"]
    state = "fits" if p["fits"] else "does not fit: " + str(p["reason"])
    lines.append(f"predictor  {p['path']}: {state}" if p["present"] else f"predictor  {p['reason']}")
    tiers = report["two_tier"]
    lines.append(
        f"mode       {'two-tier' if tiers['auto'] else 'per-layer'} by default: {tiers['reason']} "
        f"(host memory for every expert: {_size(tiers['host_bytes'])}; --two-tier on, off or lru chooses "
        "for generate and serve)"
    )
    held = tiers["tiers"]
    lines.append(
        f"tiers      of {report['experts_per_layer']} experts a layer: {held['device']} in slots, "
        f"{held['host']} in host memory read in place, {held['disk']} read from disk when routed"
    )
    packed = report["packed"]
    lines.append(f"packed     {packed}" if packed else "packed     none (`od-moe pack`: one read per expert)")
    return "\n".join(lines + _rank_lines(report.get("ranks")))


def _budget_line(report: dict) -> str:
    """The memory budget: the engine's, and the slots it buys; where the device has memory of its own, the
    host's, and whether it holds every expert (two tiers) or some of each layer's (three tiers)."""
    budget = report["memory_budget"]
    given = f"{_size(budget['bytes'])}{' (70% of available memory)' if budget['auto'] else ''}"
    if report["device"]:
        tiers, every = report["two_tier"], _size(report["all_experts_bytes"])
        if tiers["host_experts"] is not None:
            return (
                f"host       {given} holds {tiers['host_experts']} of {report['experts_per_layer']} experts "
                f"a layer of {every} (three tiers: the rest read from disk)"
            )
        holds = "holds" if tiers["auto"] else "does not hold"
        return f"host       {given} {holds} every expert ({every}) for two tiers"
    if not budget["capacity"]:
        return f"budget     {given} holds no expert: too small (the error below says what it needs)"
    return f"budget     {given} holds {budget['capacity']} experts per layer ({budget['fraction']:.1%})"


def _rank_lines(rows) -> list[str]:
    if rows is None:
        return []
    if isinstance(rows, dict):
        return [f"ranks      cannot split: {rows['error']}"]
    why = (
        "ranks      in mlx-lm's pipeline order: rank 0 runs the last layers and prints or serves, the "
        "highest rank the first; hidden states flow down to rank 0, then every rank gets the logits"
    )
    return [why] + [
        f"rank {r['rank']:<5} layers {r['layers'][0]}-{r['layers'][1] - 1} ({r['moe_layers']} MoE), "
        f"{_size(r['all_experts_bytes'])} of experts, {_size(r['non_expert_bytes'])} non-expert; needs "
        + ", ".join(f"{float(f):.1%}: {_size(b)}" for f, b in r["budgets"].items())
        for r in rows
    ]
