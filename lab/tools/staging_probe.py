"""Prompt tok/s and batched decode tok/s of od-moe against stock mlx-lm in one process, for the staged
passes of two-tier mode (`od_moe/two_tier/staged_passes.py`): what `docs/GPU.md` ("Staged passes") reports.

    python3 lab/tools/staging_probe.py MODEL WIDEN tt:0.25,tt:0.25:stage=1000000,lru:0.25 \
        [--lengths 16,128,512] [--batches 1,2,4,8]

Each spec is `mode:fraction[:stage=P][:admit=N]` (mode tt, lru or exact; `stage`: positions from which a
pass is staged; `admit`: positions between admissions). Per spec a fresh engine; prompts of the given
lengths (od-moe's own source, real Python) through `stream_generate(max_tokens=1)`, one of each to warm
up then 3 alternating with stock, medians; then `batch_generate` of the first B of 8 prompts, 32 tokens,
twice alternating with stock's `batch_generate`. One JSON line a measurement, with `same`: texts equal to
stock's batch. Meant for CUDA: on the CPU stock runs in the checkpoint's dtype while od-moe casts to
float32 (`backend.compute_dtype`), so there speeds and texts differ.
"""

import argparse
import gc
import json
import statistics
from pathlib import Path

import mlx.core as mx
import mlx_lm

import od_moe
from od_moe.accounting import ledger as stats
from od_moe.bench.widen import widen_model
from od_moe.two_tier.settings import ADMIT_EVERY, AdmissionSettings, TwoTierSettings

NAMES = [
    "parse_args",
    "read_config",
    "merge_sorted",
    "flatten",
    "chunked",
    "retry",
    "memoize",
    "to_snake_case",
]


def settings(knobs: list[str]) -> TwoTierSettings:
    """The two-tier settings a spec's knobs (`stage=P`, `admit=N`) ask for."""
    given = dict(knob.split("=") for knob in knobs)
    unknown = set(given) - {"stage", "admit"}
    if unknown:
        raise KeyError(", ".join(sorted(unknown)))
    admission = AdmissionSettings(every=int(given.get("admit", ADMIT_EVERY)))
    stage = int(given["stage"]) if "stage" in given else None
    return TwoTierSettings(stage_positions=stage, admission=admission)


def prompt_tps(generate, prompt) -> float:
    return [r for r in generate(prompt, max_tokens=1)][-1].prompt_tps


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model")
    parser.add_argument("widen", type=int, help="widen the experts this many times first (0: as it is)")
    parser.add_argument("specs")
    parser.add_argument("--lengths", default="16,128,512")
    parser.add_argument("--batches", default="1,8")
    args = parser.parse_args()
    path = Path(args.model)
    if args.widen:
        path = widen_model(args.model, Path("/tmp/odb") / f"widened-x{args.widen}", args.widen)
    stock, tokenizer = mlx_lm.load(str(path))
    ids = tokenizer.encode(
        (Path(od_moe.__file__).parent / "two_tier" / "two_tier_runtime.py").read_text() * 3
    )
    prompts = [f"def {n}(" for n in NAMES]

    def stock_run(prompt, max_tokens):
        return mlx_lm.stream_generate(stock, tokenizer, prompt, max_tokens=max_tokens)

    for spec in args.specs.split(","):
        kind, fraction, *knobs = spec.split(":")
        two_tier = {"lru": "lru", "tt": True, "exact": False}[kind]
        given = settings(knobs) if two_tier is not False else None  # the per-layer path takes none of these
        engine = od_moe.load(str(path), capacity=float(fraction), two_tier=two_tier, path_settings=given)
        for n in [int(n) for n in args.lengths.split(",")]:
            prompt_tps(engine.stream_generate, ids[:n]), prompt_tps(stock_run, ids[:n])
            pairs = [
                (prompt_tps(stock_run, ids[:n]), prompt_tps(engine.stream_generate, ids[:n]))
                for _ in range(3)
            ]
            row = {"mode": spec, "what": f"prefill {n}"}
            row["stock"], row["od"] = (statistics.median(p[k] for p in pairs) for k in (0, 1))
            print(json.dumps(row | {"x": row["od"] / row["stock"]}), flush=True)
        for b in [int(n) for n in args.batches.split(",")]:
            encoded = [tokenizer.encode(p) for p in prompts[:b]]
            engine.batch_generate(prompts[:b], max_tokens=8)
            mlx_lm.batch_generate(stock, tokenizer, encoded, max_tokens=8)
            engine.reset_stats()
            pairs, same = [], True
            for _ in range(2):
                theirs = mlx_lm.batch_generate(stock, tokenizer, encoded, max_tokens=32)
                ours = engine.batch_generate(prompts[:b], max_tokens=32)
                pairs.append((theirs.stats.generation_tps, ours.stats.generation_tps))
                same = same and theirs.texts == ours.texts
            decode = engine.stats()["total"]["decode"]
            staged = stats.per_pass(engine.runtime.ledger, "decode")
            row = {"mode": spec, "what": f"batch {b}", "hit": decode["hit_rate"], "same": same}
            row["stock"], row["od"] = (statistics.median(p[k] for p in pairs) for k in (0, 1))
            row |= {k: staged[k] for k in ("experts", "expert_hits", "routings_read")}
            print(json.dumps(row | {"x": row["od"] / row["stock"]}), flush=True)
        del engine
        gc.collect()
        mx.clear_cache()


if __name__ == "__main__":
    main()
