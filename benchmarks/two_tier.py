"""Two-tier mode against stock mlx-lm, in one process: how close to stock does decoding get when misses are
read in place from host memory, at 0 / 25 / 50 / 100% of experts in device slots, and what did the exact
per-layer path (`od_moe.load` with two_tier=False) give at 25% (the before row)?

Every row loads an engine, warms it on a prompt of its own (kernels, admission), then alternates prompt by
prompt with stock mlx-lm for `--rounds` rounds of the 3 prompts x `--tokens` greedy tokens: the row's x-stock
is the median of the rounds' ratios (machines drift: the ratio within a round is the figure). Tokens must
equal stock's. The median decoded token's ms, stock's over the row's, shows a typical token apart from slow
ones (an admission, a compile, a stall). Also per row: decode hit rate, mapped lanes (misses) and slot copies
per decoded token, the bytes that crossed the bus per token and the row's speed over its roofline (max of
stock's step and those bytes at the faster of the two bus bandwidths measured on the process's first two-tier
engine, as in `od-moe bench --two-tier`). `static` rows stop admission after the warm-up (its slots are that
prompt's profile), to compare with learned admission on the same slots count.

    python benchmarks/two_tier.py [--model PATH | --widen 128 | --shape NAME] [--rows tt:0,tt:0.25,...]
        [--rounds 4] [--tokens 48] [--prefill 512] [--direct-io on] [--disk-probe 20] [--json out.json]

`--prefill N`: per row also prompt tok/s of an N-token prompt (od-moe's own Python source) against stock,
alternating, median of `--rounds` ratios (`stage=P` sets the positions from which a pass is staged,
`two_tier/staged_passes.py`; `stage=0` stages nothing). Past the host's memory also its first token's ms, the
disk MB a prompt read, and with a probe the bound over the first token: 1.2 x the prompt's touched experts
read once at the probe's rate + the all-in-host row's first token (>= 1 meets it). The touched experts are
the prompt's routing recorded on the all-in-host row; per layer those beyond what the row's tiers hold
(device + host) count, fewer than the touched experts the tiers did not hold, so the bound is the stricter.

Rows: `tt:F` two-tier at fraction F; `lru:F` two-tier with its slots kept by the device (`two_tier="lru"`;
`lru:F:decay=D`: by decayed routing counts, not recency);
`static:F` the same as `tt` with admission frozen after the warm-up (a second engine, from the first's
snapshot, admission off); `exact:F` the per-layer path (today's default off CUDA). Settings may follow
(`two_tier/settings.py`'s `TwoTierSettings`, given to `load` as `path_settings`), e.g.
`tt:0.25:margin=8:admit_every=16` (`AdmissionSettings`' margin, max_swaps, half_life and every, by
default its `cadence`, as `load` admits: every 8 positions where a row has `host=H`, past the host's
memory, else 64; `fills=mlx`:
slots filled by MLX writes after a wait, not by kernels, on CUDA; `stage=P`: its stage_positions). Forecasts
into device-kept rows (`KeptRowsSettings`, `ForecastSettings`): `ahead=S` rows more a layer (0 with `lru`:
into its own rows), `forecast=shadow|gate|none`, `distance=D` layers ahead, `per=P` experts predicted a layer
(default S, or all of `lru`'s rows), `nocopy` (decide, copy nothing), `demand=0` (no copies of a layer's own
misses), `blocks=B` (thread blocks a copy). Past the host's memory (`two_tier/host_tier.py`): `host=H` experts
a layer in the host tier, the rest read from disk (`--direct-io` on: past the page cache), `disk=routed|none`
what a pass that met an expert on disk reads ahead before it runs again (`disk_passes.py`),
`rerun=flagged|exact` how it runs again, `forecast=shadow|gate` with `distance=D`: the layers that wait for
their routing read the forecast's experts of the layer D on from disk ahead (`floor=F`: those whose top-k x
probability reaches F, `ForecastSettings.floor`), `lag=L` how many layers after a layer its flags are read
(0: with the logits only), `stop=0` a flagged pass runs on past its first miss, reading each missing layer's
experts as found (`TwoTierSettings.flag_stop`), `head=N` its first N MoE layers learn their routing first
(`TwoTierSettings.exact_layers`), `threads=N` its reader threads, `span=B` the most bytes of a request of an
expert's read (0: one thread an expert, one request a part), `evict=next-use` the host tier evicts by the
bundled shadow network's next-use head (`two_tier/host_eviction.py`; on the bundled model at real widths
`forecast=shadow` and `evict=next-use` use that network carried to its widths, `real_widths.pad_predictor`);
such a row also gives its disk MB (the decode passes' reads; with the prompts' in the JSON's
`disk_mb_per_token_with_prompts`), reads waited for and passes run again per decoded token, and its speed
over the all-in-host row's (the first
two-tier row without `host=`, e.g. `tt:0.25`, the same slots).
`--disk-probe S`: the disk's rate (`od_moe.bench.roofline.disk_rate`, O_DIRECT, S seconds at each of 1-16
reads in flight) in the same run, and each disk row's roofline: max(the all-in-host row's ms a token, the
demand row's (`disk=none`) disk bytes a token / that rate). On the CPU backend every two-tier row runs on host
memory: tokens and counts are meaningful there, the speeds are the CPU's.
"""

import argparse
import functools
import gc
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx_lm
import numpy as np

import od_moe
from od_moe.accounting.report import table
from od_moe.bench.foundation import PROMPTS
from od_moe.bench.prefetch import _predictor_for
from od_moe.bench.real_widths import PADDED, pad_predictor
from od_moe.bench.roofline import disk_rate, roofline_ms
from od_moe.bench.shards import RECORD
from od_moe.bench.two_tier_grid import WARM_PROMPT, alternate, load_stock, moved_per_token
from od_moe.two_tier import kept_rows
from od_moe.two_tier.settings import (
    BLOCKS,
    DEMAND_BLOCKS,
    DISK_FLOOR,
    DISK_SPAN,
    DISK_THREADS,
    HALF_LIFE,
    MARGIN,
    MAX_SWAPS,
    AdmissionSettings,
    ForecastSettings,
    KeptRowsSettings,
    TwoTierSettings,
)

BUS: dict = {}  # the bus's transfer rates (`Runtime.transfer_rates`), measured once a process


def model_path(args) -> Path:
    if args.shape:  # built once into --workdir (`od-moe bench --shape` finds it there too)
        from od_moe.bench.real_shapes import build_shape, default_dest

        return build_shape(args.shape, default_dest(args.workdir, args.shape))
    if not args.widen:
        return Path(args.model)
    from od_moe.bench.widen import widen_model

    return widen_model(args.model, Path(args.workdir) / f"widened-x{args.widen}", args.widen)


@functools.cache
def bench_predictor(model: Path | None = None):
    """The bundled shadow network, carried to hidden 2048 where `model` is the bundled model at real widths
    (`od_moe.bench.real_widths.pad_predictor`)."""
    predictor = _predictor_for("benchmark")
    config = json.loads((model / "config.json").read_text()) if model is not None else {}
    if config.get(RECORD, {}).get("shape") == PADDED:
        predictor = pad_predictor(predictor, config["hidden_size"])
    return predictor


def settings_for(knobs: list[str], model: Path | None = None) -> TwoTierSettings:
    """The two-tier settings a row's knobs ask for (see the module's docstring) on `model`."""
    given = dict(k.split("=") if "=" in k else (k, "1") for k in knobs)
    admission = AdmissionSettings(
        every=int(given["admit_every"]) if "admit_every" in given else None,  # None: as `load` admits
        margin=float(given.get("margin", MARGIN)),
        max_swaps=int(given.get("max_swaps", MAX_SWAPS)),
        half_life=float(given.get("half_life", HALF_LIFE)),
        by_kernel=False if given.get("fills") == "mlx" else None,
    )
    rows = KeptRowsSettings(
        rows=int(given.get("ahead", 0)),
        predicted=int(given["per"]) if "per" in given else None,
        copy="nocopy" not in given,
        demand=given.get("demand", "1") == "1",
        decay=float(given["decay"]) if "decay" in given else None,
        blocks=int(given.get("blocks", BLOCKS)),
        # over a top-8 layer's candidates
        demand_blocks=int(given["blocks"]) * 8 if "blocks" in given else DEMAND_BLOCKS,
    )
    forecast = ForecastSettings()
    kind = {"shadow": "shadow", "gate": "next-gate", "none": "none"}[given.get("forecast", "shadow")]
    if ("ahead" in given or "host" in given and "forecast" in given) and kind != "none":
        predictor = bench_predictor(model) if kind == "shadow" else None
        forecast = ForecastSettings(
            kind=kind,
            distance=int(given.get("distance", 1)),
            predictor=predictor,
            floor=float(given.get("floor", DISK_FLOOR)),
        )
    stage = int(given["stage"]) or 2**31 if "stage" in given else None  # 0: nothing staged
    disk = dict(
        host_experts=int(given["host"]) if "host" in given else None,
        disk_prefetch=given.get("disk", TwoTierSettings.disk_prefetch),
        disk_threads=int(given.get("threads", DISK_THREADS)),
        disk_span=int(given.get("span", DISK_SPAN)),
        disk_rerun=given.get("rerun", TwoTierSettings.disk_rerun),
        flag_lag=int(given.get("lag", TwoTierSettings.flag_lag)),
        flag_stop=bool(int(given.get("stop", int(TwoTierSettings.flag_stop)))),
        exact_layers=int(given.get("head", TwoTierSettings.exact_layers)),
        host_next_use=bench_predictor(model) if given.get("evict") == "next-use" else None,
    )
    return TwoTierSettings(
        stage_positions=stage, admission=admission, kept_rows=rows, forecast=forecast, **disk
    )


def run_row(spec: str, path: Path, stock, tokenizer, reference, args) -> dict:
    kind, fraction, *knobs = spec.split(":")
    label = " ".join([kind, f"{float(fraction):.1%}", *knobs])
    fraction = float(fraction)
    settings = None if kind == "exact" else settings_for(knobs, path)
    two_tier = {"exact": False, "lru": "lru"}.get(kind, True)
    t0 = time.perf_counter()
    engine = od_moe.load(
        str(path), capacity=fraction, two_tier=two_tier, path_settings=settings, direct_io=args.direct_io
    )
    load_s = time.perf_counter() - t0
    two_tier = engine.mode.tiered
    if two_tier and not BUS:  # once a process, on its first two-tier engine
        BUS.update(engine.runtime.transfer_rates())
    for _ in range(2):  # kernels, then admission settles on the warm prompt's experts
        list(engine.stream_generate(WARM_PROMPT, max_tokens=args.tokens))
    if kind == "static":  # the slots as the warm-up left them, admission off from now on
        engine = frozen(engine, path, fraction, settings, args.tokens)
    engine.reset_stats()
    gaps: dict = {}
    ratios, speeds, same = alternate(engine, stock, tokenizer, reference, args.tokens, args.rounds, gaps)
    stats = engine.stats()
    bounded = settings is not None and settings.host_experts is not None  # past the host's memory
    prefill = prefill_ratios(engine, stock, tokenizer, args.prefill, args.rounds) if args.prefill else None
    touched = (
        touched_experts(engine, tokenizer, args.prefill) if prefill and not bounded and two_tier else None
    )
    decode = stats["total"]["decode"]
    tokens = max(1, stats["positions"]["decode"])  # decode passes
    row = {
        "row": label,
        "mode": engine.mode.path,
        "capacity": engine.capacity,
        "stock_tok_s": statistics.median(s for s, _ in speeds),
        "tok_s": statistics.median(t for _, t in speeds),
        "x_stock": statistics.median(ratios),
        "x_stock_rounds": [round(r, 3) for r in ratios],
        # each decoded token's ms, as the loop saw them: a typical token apart from the slow ones
        "ms_token_median": [statistics.median(gaps[k]) * 1e3 for k in ("stock", "row")],
        "ms_token_p90": [statistics.quantiles(gaps[k], n=10)[-1] * 1e3 for k in ("stock", "row")],
        "decode_hit_rate": decode["hit_rate"],
        "mapped_per_token": decode["misses"] / tokens / stats["moe_layers"],
        "copies_per_token": stats["total"]["experts_loaded"] / tokens,
        "same_tokens": f"{same}/{args.rounds * len(PROMPTS)}",
        "load_s": load_s,
        "stack_moves": engine.runtime.figures().stack_moves,
        "wrong_lookahead_rows": kept_rows.wrong_rows(engine.runtime.kept_rows)
        if settings_ahead(knobs)
        else 0,
        # MLX past its limit waits after every operation, stock's too (docs/GPU.md, "MLX's memory limit")
        "mlx_active_gb": mx.get_active_memory() / 1e9,
        "mlx_limit_gb": mx.get_memory_limit() / 1e9,
    }
    row["x_stock_median_token"] = row["ms_token_median"][0] / row["ms_token_median"][1]
    if two_tier:  # the roofline: max(stock's step, moved bytes / the faster measured way across the bus)
        moved = moved_per_token(engine) * engine.caches[0].layout.expert_nbytes
        floor_ms = roofline_ms(1e3 / row["stock_tok_s"], moved, BUS["best"], 0, 1)[0]
        row.update(
            moved_bytes_per_token=moved, roofline_ms=floor_ms, x_roofline=floor_ms * row["tok_s"] / 1e3
        )
    if bounded:
        tiers = stats["tiers"]
        disk = tiers["disk"]
        row.update(
            tiers=tiers["experts_per_layer"],
            # nothing read ahead: the demand row a disk roofline is taken from
            demand_only=settings.disk_prefetch == "none" and settings.forecast.kind == "none",
            direct_io=stats["direct_io"],
            direct_io_refused=stats["direct_io_refused"],
            # the decode passes' reads (decoded tokens' speed is what the disk roofline bounds), and with
            # the prompts' too
            disk_mb_per_token=stats["io"]["decode"]["bytes_read"] / tokens / 1e6,
            disk_mb_per_token_with_prompts=disk["bytes_read"] / tokens / 1e6,
            disk_lanes_per_token=tiers["lanes"]["disk"] / tokens,
            reruns_per_token=disk["reruns"] / tokens,
            wait_ms_per_token=disk["wait_s"] / tokens * 1e3,
            prefetch=[
                disk[k] for k in ("prefetch_reads", "prefetch_useful", "prefetch_wasted", "prefetch_late")
            ],
        )
    if touched is not None:
        row.update(prefill_touched=touched, expert_bytes=engine.caches[0].layout.expert_nbytes)
    if prefill:
        row["prefill_stock_tok_s"] = statistics.median(s for s, _ in prefill)
        row["prefill_tok_s"] = statistics.median(t for _, t in prefill)
        row["prefill_x_stock"] = statistics.median(t / s for s, t in prefill)
        row["first_token_ms"] = args.prefill / row["prefill_tok_s"] * 1e3
        if bounded:  # what the prompts read from disk (the warm-up's and each round's)
            read = engine.stats()["tiers"]["disk"]["bytes_read"] - stats["tiers"]["disk"]["bytes_read"]
            row["prefill_disk_mb"] = read / (len(prefill) + 1) / 1e6
    del engine
    gc.collect()
    mx.clear_cache()
    return row


def settings_ahead(knobs: list[str]) -> bool:
    return any(k.startswith("ahead=") for k in knobs)


def frozen(engine, path: Path, fraction: float, settings: TwoTierSettings, tokens: int):
    """A second engine whose slots are `engine`'s (through a snapshot) and whose admission is off, warmed up
    as `engine` was (its kernels)."""
    with tempfile.TemporaryDirectory() as folder:
        engine.save_snapshot(folder)
        off = replace(settings, admission=replace(settings.admission, enabled=False))
        engine = od_moe.load(str(path), capacity=fraction, two_tier=True, snapshot=folder, path_settings=off)
    for _ in range(2):
        list(engine.stream_generate(WARM_PROMPT, max_tokens=tokens))
    return engine


def prefill_prompt(tokenizer, length: int) -> list[int]:
    """A `length`-token prompt: od-moe's own source, real Python."""
    text = "".join(path.read_text() for path in sorted(Path(od_moe.__file__).parent.glob("*.py")))
    return tokenizer.encode(text)[:length]


def touched_experts(engine, tokenizer, length: int) -> list[int]:
    """How many distinct experts each MoE layer's routing touches over the `length`-token prompt and its
    first token (the engine's routing, recorded)."""
    passes = engine.record_routing(prefill_prompt(tokenizer, length), max_tokens=1)
    layers = sorted({j for p in passes for j in p})
    return [len(np.unique(np.concatenate([np.ravel(p[j]) for p in passes if j in p]))) for j in layers]


def prefill_ratios(engine, stock, tokenizer, length: int, rounds: int) -> list[tuple[float, float]]:
    """(stock's, the engine's) prompt tok/s on a `length`-token prompt (`prefill_prompt`), alternating, after
    one of each to warm up."""
    prompt = prefill_prompt(tokenizer, length)

    def tps(generate) -> float:
        return [r for r in generate(prompt, max_tokens=1)][-1].prompt_tps

    stock_run = functools.partial(mlx_lm.stream_generate, stock, tokenizer)
    tps(engine.stream_generate), tps(stock_run)  # od-moe first: it refuses what is too long
    return [(tps(stock_run), tps(engine.stream_generate)) for _ in range(rounds)]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(od_moe.DEFAULT_MODEL))
    parser.add_argument(
        "--widen", type=int, default=0, help="widen the model's experts this many times first"
    )
    parser.add_argument("--workdir", default="/tmp/odb")
    parser.add_argument("--shape", help="a real model's shape (`od-moe bench --shape`'s names), built first")
    parser.add_argument("--rows", default="exact:0.25,tt:0,tt:0.25,static:0.25,tt:0.5,tt:1")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prefill", type=int, default=0, help="also prompt tok/s of a prompt this long")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument(
        "--direct-io",
        default="auto",
        type=lambda v: {"on": True, "off": False}.get(v, v),
        help="on, off, auto",
    )
    parser.add_argument("--disk-probe", type=float, default=0, help="seconds a count of reads in flight")
    parser.add_argument("--probe-threads", default="1,2,4,8,16", help="counts of reads in flight to probe")
    parser.add_argument(
        "--cpu", action="store_true", help="run on MLX's CPU backend (a GPU machine's CPU as unified memory)"
    )
    args = parser.parse_args()
    if args.cpu:
        mx.set_default_device(mx.cpu)
    path = model_path(args)
    stock, tokenizer, reference = load_stock(path, args.tokens)
    rows = []
    for spec in args.rows.split(","):
        row = run_row(spec, path, stock, tokenizer, reference, args)
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    threads = tuple(int(n) for n in args.probe_threads.split(","))
    probe = disk_rate(path, seconds=args.disk_probe, threads=threads) if args.disk_probe else None
    past_memory(rows, probe)
    headers = [
        "row",
        "mode",
        "stock tok/s",
        "tok/s",
        "x stock",
        "x stock, median token",
        "decode hit",
        "mapped/layer/tok",
        "copies/tok",
        "MB moved/tok",
        "x roofline",
    ]
    cells = [
        [
            r["row"],
            r["mode"],
            r["stock_tok_s"],
            r["tok_s"],
            r["x_stock"],
            r["x_stock_median_token"],
            r["decode_hit_rate"],
            r["mapped_per_token"],
            r["copies_per_token"],
            r.get("moved_bytes_per_token", 0) / 1e6 if "x_roofline" in r else "-",
            r.get("x_roofline", "-"),
        ]
        + [r["same_tokens"]]
        + ([r["prefill_tok_s"], r["prefill_x_stock"]] if args.prefill else [])
        for r in rows
    ]
    disk_rows = [r for r in rows if "tiers" in r]
    if disk_rows:
        headers_disk = [
            "row",
            "tiers d/h/disk",
            "x all-in-host",
            "disk MB/tok",
            "disk lanes/tok",
            "reruns/tok",
        ]
        headers_disk += ["wait ms/tok", "ahead read/useful/wasted/late", "x disk roofline", "direct I/O"]
        if args.prefill:
            headers_disk += ["first token ms", "prompt disk MB", "read once MB", "bound / first token"]
        disk_cells = [
            [
                r["row"],
                "/".join(str(r["tiers"][k]) for k in ("device", "host", "disk")),
                r.get("x_all_in_host", "-"),
                r["disk_mb_per_token"],
                r["disk_lanes_per_token"],
                r["reruns_per_token"],
                r["wait_ms_per_token"],
                "/".join(map(str, r["prefetch"])),
                r.get("x_disk_roofline", "-"),
                "on" if r["direct_io"] else f"off: {r['direct_io_refused'] or 'asked off'}",
            ]
            + (
                [
                    r["first_token_ms"],
                    r["prefill_disk_mb"],
                    r.get("prefill_read_once_mb", "-"),
                    r.get("x_first_token_bound", "-"),
                ]
                if args.prefill
                else []
            )
            for r in disk_rows
        ]
        probe_line = (
            f"; disk probe {probe['bytes_per_s'] / 1e9:.2f} GB/s at {probe['threads']} reads in flight"
            f" ({probe['seconds']:.0f} s each of {sorted(probe['by_threads'])})"
            if probe
            else "; no disk probe (--disk-probe S)"
        )
        print(table(headers_disk, disk_cells, title="Past the host's memory" + probe_line))
    title = (
        f"{path.name} on {mx.default_device()} (MLX {mx.__version__}), {len(PROMPTS)} prompts x "
        f"{args.tokens} tokens, {args.rounds} rounds alternating with stock; x stock: median of the "
        "rounds' ratios; median token: stock's median ms a decoded token over the row's"
    )
    if BUS:
        title += (
            f"; roofline: max(stock's step, moved bytes / {BUS['best'] / 1e9:.2f} GB/s, the faster of read "
            f"in place {BUS['in_place'] / 1e9:.2f} and copied {BUS['copied'] / 1e9:.2f})"
        )
    prefill = [f"prefill {args.prefill} tok/s", "prefill x stock"] if args.prefill else []
    print(table(headers + ["same tokens"] + prefill, cells, title=title))
    if args.json:
        Path(args.json).write_text(json.dumps({"title": title, "rows": rows, "disk_probe": probe}, indent=1))


def past_memory(rows: list[dict], probe: dict | None):
    """Each disk row's speed over the all-in-host row's (the first row without a host tier of its own) and,
    with the disk's `probe`, over its roofline: max(the all-in-host row's ms a token, the demand row's
    (`disk=none` and no forecast, the same tiers; else this row's) disk bytes a token / the probe's rate)."""
    in_host = next((r for r in rows if "tiers" not in r and r["mode"] == "two-tier"), None)
    tiers = lambda r: tuple(r["tiers"].values())  # noqa: E731
    demand = {tiers(r): r for r in reversed(rows) if r.get("demand_only")}  # the first of each tiers
    for r in rows:
        if "tiers" not in r or in_host is None:
            continue
        r["x_all_in_host"] = r["x_stock"] / in_host["x_stock"]
        if probe:
            disk_mb = demand.get(tiers(r), r)["disk_mb_per_token"]
            floor_ms = max(1e3 / in_host["tok_s"], disk_mb * 1e6 / probe["bytes_per_s"] * 1e3)
            r["disk_roofline_ms"] = floor_ms
            r["x_disk_roofline"] = floor_ms * r["tok_s"] / 1e3
            if "prefill_disk_mb" in r and "prefill_touched" in in_host:  # the first token's bound over its ms
                held = r["tiers"]["device"] + r["tiers"]["host"]
                once = sum(max(0, n - held) for n in in_host["prefill_touched"]) * in_host["expert_bytes"]
                r["prefill_read_once_mb"] = once / 1e6
                read_ms = once / probe["bytes_per_s"] * 1e3
                r["first_token_bound_ms"] = 1.2 * read_ms + in_host["first_token_ms"]
                r["x_first_token_bound"] = r["first_token_bound_ms"] / r["first_token_ms"]


if __name__ == "__main__":
    main()
