"""The prefetch benchmark: every policy side by side, on the bundled model and on the widened copy.

For each model, capacity, read temperature (cold: page cache dropped and every read made cold; warm), miss
policy and prefetch policy, one run over the same prompts gives the decode demand hit rate, stall and
bytes read per decoded token (demand and prefetch reads alike) next to what Belady's MIN would read for
the same routing and capacity (`caching/replay.py`, from the routing recorded in that run), decode tok/s and
its ratio to the fully resident model (stock mlx-lm, measured in the same process), prefetch precision and
back-offs, and for skip mode the share of tokens that equal the exact output. The oracle replays the
routing recorded from an exact run of the same prompt. `--deterministic` makes every prefetch read land
before it is needed and turns the timed self-checks off: hit counts, bytes read and tokens are then the
same on every run. The predictor is the bundled one unless another trained on the bundled model is given;
on the widened copy it is used as is, because widening keeps every hidden state and routing decision of
the bundled model (`widen.py`). Skip mode is measured with `none` and `profile` only (predictive prefetch
needs the per-layer sync of load mode).
"""

import functools
import time
from pathlib import Path

import mlx.core as mx

from .. import load
from ..accounting.report import table
from ..caching.replay import Tally, replay_recording
from ..engine import DEFAULT_MODEL, DEFAULT_PREDICTOR, model_layouts
from ..errors import UserError
from ..memory import backend
from ..predictor import load_predictor
from ..prefetch.governor import PrefetchSettings
from ..storage.model_files import use_packed_experts
from ..storage.packed import default_path as default_packed_path
from ..storage.packed import pack as pack_experts
from ..storage.store import ExpertStore
from ..units import KB, format_bytes
from .foundation import PROMPTS, run_stock
from .roofline import install_bandwidth, read_bandwidth, roofline_ms
from .widen import widen_model

POLICY_ORDER = ("none", "profile", "next-gate", "predictor", "oracle")
# Reads always land before the layer that needs them runs (an infinitely fast disk) and no timed check
# pauses prefetch: hit counts, bytes read and tokens are the same on every run and every machine.
DETERMINISTIC = PrefetchSettings(timed_checks=False, synchronous=True)


@functools.lru_cache(maxsize=1)
def _bundled_identity() -> str:
    return load().identity


def _predictor_for(identity, folder=None):
    """The bundled predictor (or the one in `folder`, trained on the bundled model), tied to `identity`
    (the bundled model or its widened copy, whose routing is the bundled model's)."""
    predictor = load_predictor(folder or DEFAULT_PREDICTOR, _bundled_identity())
    predictor.retarget(identity)
    return predictor


def run_policy(
    path,
    prompts,
    max_tokens,
    policy,
    capacity=None,
    cold=False,
    miss_policy="load",
    predictor_dir=None,
    settings: PrefetchSettings | None = None,
):
    """One configuration over all prompts, each from an empty cache: tokens, decode tok/s, statistics.
    `settings`: how prefetch runs (deterministic runs: `DETERMINISTIC`)."""
    # the per-layer path (auto would choose two tiers on CUDA, which the two-tier grid measures)
    options = dict(capacity=capacity, miss_policy=miss_policy, prefetch="none", two_tier=False)
    predictor = (
        _predictor_for(load(str(path), **options).identity, predictor_dir) if policy == "predictor" else None
    )
    tokens, tps, stats, minimum = [], [], [], []
    for prompt in prompts:
        trace = load(str(path), **options).record_routing(prompt, max_tokens) if policy == "oracle" else None
        mx.clear_cache()
        backend.reset_peak_memory()
        engine = load(str(path), predictor=predictor, **options)
        engine.configure_prefetch(policy, oracle_trace=trace, settings=settings)
        expert_bytes = engine.caches[0].layout.expert_nbytes
        slot_bytes = engine.caches[0].slot_nbytes
        store = engine.runtime.store
        store.drop_pages_after_read(cold)
        if cold:
            store.use_direct_io(True)  # cold: every read from the device, as when the model exceeds memory
            store.drop_page_cache()
        slots = engine.caches[0].capacity
        watch = slots < engine.caches[0].num_experts  # a full cache has nothing to compare with MIN
        if watch:
            engine.runtime.start_recording()
        out, last = [], None
        for last in engine.stream_generate(prompt, max_tokens=max_tokens):
            out.append(last.token)
        tokens.append(out)
        assert last is not None  # at least one response: every prompt asks for max_tokens >= 1
        tps.append(last.generation_tps)
        stats.append(engine.stats())
        if watch:
            recording = engine.runtime.stop_recording()
            assert recording is not None  # recording since `start_recording` above
            minimum.append(replay_recording(recording, slots, "min"))
        else:
            minimum.append(Tally())
        engine.close()
    return {
        "tokens": tokens,
        "tok_s": sum(tps) / len(tps),
        "prompt_tok_s": tps,
        "stats": stats,
        "expert_bytes": expert_bytes,
        "slot_bytes": slot_bytes,
        "min_reads": sum(m.reads for m in minimum),  # Belady's MIN on the same routing and capacity
    }


def stats_total(stats, *keys):
    """The sum over engines' `stats()` of the figure at `keys` (None counts 0)."""
    total = 0
    for s in stats:
        v = s
        for k in keys:
            v = v[k]
        total += v or 0
    return total


def _row(model, fraction, reads, miss_policy, policy, result, stock, machine):
    """One row; `machine`: the read bandwidth (for these reads) and install bandwidth measured here."""
    stats = result["stats"]
    decode = stats_total(stats, "positions", "decode") or 1
    lookups, hits = (
        stats_total(stats, "total", "decode", "lookups"),
        stats_total(stats, "total", "decode", "hits"),
    )
    expert_bytes = result["expert_bytes"]
    useful, wasted = stats_total(stats, "prefetch", "useful"), stats_total(stats, "prefetch", "wasted")
    same = [
        sum(a == b for a, b in zip(t, s)) / max(len(s), 1) for t, s in zip(result["tokens"], stock["tokens"])
    ]
    return {
        "model": model,
        "policy": policy,
        "capacity": fraction,
        "reads": reads,
        "miss_policy": miss_policy,
        "hit_rate": hits / lookups if lookups else None,
        "decode_lookups": lookups,
        "decode_hits": hits,
        "stall_ms_per_token": stats_total(stats, "io", "decode", "stall_s") * 1e3 / decode,
        "bytes_per_token": stats_total(stats, "io", "decode", "bytes_read") / decode,
        "experts_read_per_token": stats_total(stats, "io", "decode", "bytes_read") / expert_bytes / decode,
        "min_experts_read_per_token": result["min_reads"] / decode,
        "reads_over_min": (
            stats_total(stats, "io", "decode", "bytes_read") / expert_bytes / result["min_reads"]
            if result["min_reads"]
            else None
        ),
        "tok_s": result["tok_s"],
        "tok_s_ratio_resident": result["tok_s"] / stock["tok_s"],
        "prefetch_precision": useful / (useful + wasted) if useful + wasted else None,
        "prefetch_issued": stats_total(stats, "prefetch", "issued"),
        "prefetch_late": stats_total(stats, "prefetch", "late"),
        "prefetch_backoffs": stats_total(stats, "prefetch", "backoffs"),
        "token_agreement": sum(same) / len(same),
        "exact": result["tokens"] == stock["tokens"],
        "tokens": result["tokens"],
        **_roofline(stats, decode, result, stock, machine),
    }


def _roofline(stats, decode, result, stock, machine) -> dict:
    read_bytes = stats_total(stats, "io", "decode", "bytes_read") / decode
    install_bytes = stats_total(stats, "io", "decode", "experts_loaded") * result["slot_bytes"] / decode
    floor_ms, bound = roofline_ms(
        1e3 / stock["tok_s"], read_bytes, machine["read_bw"], install_bytes, machine["install_bw"]
    )
    return {
        "roofline_ms_per_token": floor_ms,
        "roofline_bound": bound,
        "tok_s_ratio_roofline": floor_ms / (1e3 / result["tok_s"]),
    }


GRIDS = ("quick", "full", "gpu")


def _plan(grid: str, max_tokens: int, wide, widened_tokens: int) -> list[tuple]:
    """(model, path, tokens, capacities, read temperatures, miss policies, prefetch policies) per model.
    quick: warm bundled and cold widened reads at 12.5/25/50%; full: both models x 12.5/25/50% x cold/warm
    x load/skip; gpu: both models x 100/50/25% x warm/cold with none/predictor/oracle (one 10-minute
    command on a fast accelerator)."""
    plan: list[tuple] = []
    temps: tuple[str, ...]
    policies: tuple[str, ...]
    if grid == "gpu":
        temps, policies = ("warm", "cold"), ("none", "predictor", "oracle")
        plan.append(("bundled", DEFAULT_MODEL, max_tokens, (1.0, 0.5, 0.25), temps, ("load",), policies))
        if wide:
            plan.append(("widened", wide, widened_tokens, (1.0, 0.5, 0.25), temps, ("load",), policies))
        return plan
    full = grid == "full"
    capacities, misses = (0.125, 0.25, 0.5), ("load", "skip") if full else ("load",)
    temps = ("cold", "warm") if full else ("warm",)
    plan.append(("bundled", DEFAULT_MODEL, max_tokens, capacities, temps, misses, POLICY_ORDER))
    if wide:
        policies = POLICY_ORDER if full else ("none", "next-gate", "predictor", "oracle")
        temps = ("cold", "warm") if full else ("cold",)
        plan.append(
            ("widened", wide, widened_tokens, capacities if full else (0.125, 0.25), temps, misses, policies)
        )
    return plan


def run_prefetch_grid(
    grid: str,
    max_tokens: int,
    widen: int,
    widened_tokens: int,
    workdir: Path,
    printer=print,
    predictor_dir=None,
    deterministic: bool = False,
    pack: bool | str = False,
):
    """The grid (`GRIDS`); `deterministic`: prefetch with `DETERMINISTIC` settings (its timings then
    mean little); `pack`: the widened model's experts packed (`od-moe pack`) and read from there, or the
    path of a packed file made elsewhere for it."""
    say = printer or (lambda *_: None)
    settings = DETERMINISTIC if deterministic else None
    if predictor_dir is not None:  # a bad folder or another model's predictor fails before any run
        load_predictor(predictor_dir, _bundled_identity())
    plan = _plan(grid, max_tokens, workdir / f"widened-x{widen}" if widen else None, widened_tokens)
    for line in _plan_lines(grid, plan, widen):
        say(line)
    wide = widened_copy(widen, workdir, pack, say) if widen else None
    rows = []
    for model, path, n_tokens, fractions, temps, misses, policy_set in _plan(
        grid, max_tokens, wide, widened_tokens
    ):
        cells = list(_cells(fractions, temps, misses, policy_set))
        started = time.perf_counter()
        stock = run_stock(path, PROMPTS, n_tokens)
        say(
            f"\n{model}: fully resident (stock mlx-lm) {stock['tok_s']:.3f} tok/s, "
            f"{1e3 / stock['tok_s']:.1f} ms/token"
        )
        machine = _machine(path, temps, say)
        model_rows = []
        for i, (fraction, reads, miss_policy, policy) in enumerate(cells):
            where = _progress(model, i, len(cells), time.perf_counter() - started)
            say(f"{where} {fraction:.1%} {reads} {miss_policy} {policy}...")
            result = run_policy(
                path,
                PROMPTS,
                n_tokens,
                policy,
                capacity=fraction,
                cold=reads == "cold",
                miss_policy=miss_policy,
                predictor_dir=predictor_dir,
                settings=settings,
            )
            bandwidths = {
                "read_bw": machine["read"][reads]["bytes_per_s"],
                "install_bw": machine["install_bw"],
            }
            model_rows.append(_row(model, fraction, reads, miss_policy, policy, result, stock, bandwidths))
            say(_line(model_rows[-1]))
        title = f"\n{model} model, {len(PROMPTS)} prompts x {n_tokens} greedy tokens, decode figures"
        say(
            table(
                [c for c, _ in COLUMNS], [[cell(r) for _, cell in COLUMNS] for r in model_rows], title=title
            )
        )
        rows += model_rows
        rows.append(
            {
                "model": model,
                "policy": "stock mlx-lm",
                "capacity": 1.0,
                "tok_s": stock["tok_s"],
                "tok_s_ratio_resident": 1.0,
            }
        )
    return {"rows": rows}


def widened_copy(widen: int, workdir: Path, pack: bool | str, say) -> Path:
    """The widened copy of the bundled model (built or verified), its experts packed if asked (`pack`
    True), or read from a packed file made elsewhere (`pack` its path), linked where `load` finds it."""
    t0 = time.perf_counter()
    wide = widen_model(DEFAULT_MODEL, workdir / f"widened-x{widen}", widen)
    packed = default_packed_path(wide)
    if isinstance(pack, str):
        _link_packed(wide, Path(pack).expanduser().resolve())
    elif pack and not packed.is_file():
        pack_experts(*model_layouts(str(wide)))
    source = f"packed rows ({packed})" if packed.is_file() else "the checkpoint's arrays"
    say(f"widened model x{widen} at {wide} ({time.perf_counter() - t0:.1f}s to build or verify)")
    say(f"widened model experts read from {source}")
    return wide


def _link_packed(wide: Path, file: Path):
    """Have every run of the widened model read the packed experts in `file` (checked as `load` checks
    them) through a link at the folder's default packed path."""
    store = ExpertStore(wide)
    try:
        use_packed_experts(store, wide, file)
    finally:
        store.close()
    link = default_packed_path(wide)
    if link.is_symlink():
        link.unlink()
    elif link.exists() and link.resolve() != file:
        raise UserError(
            f"the widened model already has packed experts at {link}: leave out --packed or delete it"
        )
    link.parent.mkdir(exist_ok=True)
    if not link.exists():
        link.symlink_to(file)


def _plan_lines(grid: str, plan: list[tuple], widen: int) -> list[str]:
    """What the grid will run, said before it starts: rows per model, tokens, what is written to disk."""
    lines = [f"od-moe bench, {grid} grid: each row from an empty cache, beside stock mlx-lm fully resident"]
    for model, _path, n_tokens, fractions, temps, misses, policy_set in plan:
        n = len(list(_cells(fractions, temps, misses, policy_set)))
        lines.append(
            f"  {model}: {n} rows of {len(PROMPTS)} prompts x {n_tokens} tokens "
            f"({'/'.join(temps)} reads, capacities {', '.join(f'{f:.1%}' for f in fractions)})"
        )
    if widen:
        store = ExpertStore(DEFAULT_MODEL)
        experts = sum(e.nbytes for name, e in store.tensors.items() if ".switch_mlp." in name)
        size = store.nbytes + experts * (widen - 1)
        store.close()
        lines.append(
            f"  the widened x{widen} copy ({format_bytes(size)}) is written to {plan[-1][1]} once and "
            "reused; "
            "its rows read cold from disk and take most of the time (the quick grid ran over 14 minutes on "
            "a 2-core x86 CPU); each row says as it starts how far along its model's rows are"
        )
    return lines


def _progress(model: str, done: int, total: int, elapsed: float) -> str:
    """Where a model's rows stand: rows done, time so far and, once a row has run, about how long is left."""
    left = f", about {_minutes(elapsed / done * (total - done))} left" if done else ""
    return f"[{model} row {done + 1}/{total}, {_minutes(elapsed)} so far{left}]"


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def _cells(fractions, temps, misses, policy_set):
    """(capacity, reads, miss policy, prefetch policy) of every row of one model, in the grid's order."""
    for fraction in fractions:
        for reads in temps:
            for miss_policy in misses:
                policies = policy_set if miss_policy == "load" else ("none", "profile")
                if fraction == 1.0:
                    policies = ("none",)  # nothing can miss: no prefetch to compare
                for policy in policies:
                    yield fraction, reads, miss_policy, policy


# the grid's printed columns: (header, the row's figure)
COLUMNS = (
    ("capacity", lambda r: f"{r['capacity']:.1%}"),
    ("reads", lambda r: r["reads"]),
    ("miss", lambda r: r["miss_policy"]),
    ("policy", lambda r: r["policy"]),
    ("decode hit", lambda r: r["hit_rate"]),
    ("stall ms/tok", lambda r: r["stall_ms_per_token"]),
    ("kB read/tok", lambda r: r["bytes_per_token"] / KB),
    ("experts/tok", lambda r: r["experts_read_per_token"]),
    ("MIN", lambda r: r["min_experts_read_per_token"]),
    ("x MIN", lambda r: r["reads_over_min"]),
    ("tok/s", lambda r: r["tok_s"]),
    ("x resident", lambda r: r["tok_s_ratio_resident"]),
    ("precision", lambda r: r["prefetch_precision"]),
    ("late", lambda r: r["prefetch_late"]),
    ("backoffs", lambda r: r["prefetch_backoffs"]),
    ("same tokens", lambda r: r["token_agreement"]),
    ("roofline ms", lambda r: r["roofline_ms_per_token"]),
    ("bound", lambda r: r["roofline_bound"]),
    ("x roofline", lambda r: r["tok_s_ratio_roofline"]),
)


def _machine(path, temps, say) -> dict:
    """This machine's read bandwidth (per read temperature, best depth) and install bandwidth."""
    read = {temp: read_bandwidth(path, cold=temp == "cold") for temp in temps}
    install_bw = install_bandwidth(path)
    machine = {"read": read, "install_bw": install_bw}
    for temp, bw in read.items():
        depths = ", ".join(f"{d}: {b / 1e9:.2f}" for d, b in bw["by_depth"].items())
        say(f"  {temp} reads by the engine's reader, GB/s at depth {depths}")
    say(f"  installs: {install_bw / 1e9:.2f} GB/s")
    return machine


def _line(r) -> str:
    return (
        f"  {r['model']} {r['capacity']:.1%} {r['reads']} {r['miss_policy']} {r['policy']}: hit "
        f"{r['hit_rate']:.3f} "
        f"x resident {r['tok_s_ratio_resident']:.3f}"
    )
