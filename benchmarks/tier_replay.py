"""Three tiers replayed on a model's own decode routing, against a clock: what demand-only reads, the shadow
predictor, next-gate and an oracle would read from disk, waste and wait for, and the modelled time a token.

Deterministic (greedy decoding, the replay's own clock), so it runs anywhere; its clock is measured
elsewhere: `--layer-ms` (the all-in-host token's ms over the model's MoE layers) and `--disk-gbs` (the
disk's rate with the reader threads' reads in flight, `benchmarks/two_tier.py --disk-probe`). The
defaults are the device machine's: one H200's all-in-host token of the bundled model at real widths
(4.42 ms a token over 8 layers: the lru 25% row's median token, `lab/runs/q30-a6fe9b9-h200/`) and its
disk's cold reads (0.92-1.28 GB/s, docs/GPU.md, the grid at a328f8c). For the Qwen3-30B-A3B shape pass
`--layer-ms 0.333` (62.5 tok/s all in host memory over 48 layers, H200, docs/GPU.md "Past the host's
memory").

    python benchmarks/tier_replay.py [--model PATH] [--expert-bytes N|SHAPE] [--tiers 16+8,16+16]
        [--distances 1,2,3] [--tokens 64] [--lag 2] [--live-tables] [--demand-first] [--routed]
        [--slots recency|admitted [--admit-every 8] [--half-life 32] [--margin 2]] [--floor F]
        [--json out.json]

`--expert-bytes bundled-real-widths`: an expert's bytes at the shape's widths (the bundled model carried
to real widths routes as the bundled model does, `od_moe/bench/real_widths.py`). The shadow predictor
runs where the model has one (the bundled model's, or `--predictor DIR`). `--floor F`: forecasts read
ahead only the experts whose top-k x probability is at least F (`ForecastSettings.floor`). `--slots
admitted` admits as the product does past the host's memory (`SlotAdmission`: its cadence, its counts'
half-life in passes and a newcomer's margin, by default the product's). Per row: disk
reads a token (demand + ahead) and their MB, host lanes, reads ahead used late, wasted (evicted unused) over
all reads, passes stopped at a miss, stall (ms waited for reads) and the modelled ms a token, its speed over
all in host memory and over the disk roofline (max(all in host, the demand row's disk bytes a token / the
disk's rate)), and the stall hidden: (T_demand - T) / (T_demand - T_oracle), the oracle at the same distance.
See `od_moe/caching/tier_replay.py` for what is modelled and what is not.
"""

import argparse
import gzip
import json
import subprocess
import sys
from pathlib import Path

import od_moe
from od_moe.accounting.report import table
from od_moe.bench.foundation import PROMPTS
from od_moe.bench.real_shapes import expert_nbytes
from od_moe.bench.tier_replay import forecasts, next_use_distances, record_decode, replay_rows
from od_moe.caching.tier_replay import SlotAdmission, TierClock
from od_moe.storage.model_files import DEFAULT_PREDICTOR
from od_moe.training.bundled import BUNDLED_TEXT
from od_moe.training.data import Documents, split_documents

HELD_OUT_PROMPTS, PROMPT_CHARS = 3, 160


def prompts() -> list[str]:
    """The bench's three prompts and the openings of three held-out documents of the bundled text."""
    with gzip.open(BUNDLED_TEXT, "rt") as f:
        texts = [json.loads(line)["text"] for line in f]
    _, held = split_documents(Documents(texts, "bundled:python_source", "text"))
    return list(PROMPTS) + [t[:PROMPT_CHARS] for t in held.texts[:HELD_OUT_PROMPTS]]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=str(od_moe.DEFAULT_MODEL))
    parser.add_argument("--predictor", help="a trained predictor's folder (the bundled model has its own)")
    parser.add_argument("--expert-bytes", default="bundled-real-widths", help="bytes, or a shape's name")
    parser.add_argument("--tiers", default="16+8,16+16", help="device+host experts a layer, comma-separated")
    parser.add_argument("--distances", default="1,2,3")
    parser.add_argument("--tokens", type=int, default=64, help="decoded a prompt")
    parser.add_argument("--warm", type=int, default=64, help="passes replayed before counting")
    parser.add_argument("--layer-ms", type=float, default=4.42 / 8)
    parser.add_argument("--disk-gbs", type=float, default=1.0)
    parser.add_argument("--lag", type=int, default=2, help="layers a flagged pass runs past its first miss")
    parser.add_argument("--live-tables", action="store_true", help="flagged passes see reads landed in them")
    parser.add_argument("--demand-first", action="store_true", help="a layer's reads go before reads ahead")
    parser.add_argument(
        "--routed", action="store_true", help="a stopped pass reads what it routed past its miss"
    )
    parser.add_argument(
        "--slots", default="recency", help="recency (every use into a slot) or admitted (counts)"
    )
    product = SlotAdmission()
    parser.add_argument(
        "--admit-every", type=int, default=product.every, help="passes between admissions (admitted)"
    )
    parser.add_argument(
        "--half-life", type=float, default=product.half_life, help="passes a count takes to halve (admitted)"
    )
    parser.add_argument(
        "--margin", type=float, default=product.margin, help="a newcomer's count over a holder's (admitted)"
    )
    parser.add_argument(
        "--floor",
        type=float,
        default=0.0,
        help="read ahead only experts whose top-k x probability reaches it",
    )
    parser.add_argument("--json")
    args = parser.parse_args()

    size = args.expert_bytes
    bytes_ = int(size) if size.isdigit() else expert_nbytes(size)
    bundled = Path(args.model).resolve() == Path(od_moe.DEFAULT_MODEL).resolve()
    predictor_dir = args.predictor or (DEFAULT_PREDICTOR if bundled else None)
    engine = od_moe.load(args.model, capacity=1.0, two_tier=False, predictor=predictor_dir)
    texts = prompts()
    recording = record_decode(engine, texts, args.tokens)
    routers, k = engine.routers(), engine.top_k
    distances = [int(d) for d in args.distances.split(",")]
    policies = []
    for d in distances:
        if engine.predictor is not None and d <= engine.predictor.config.lookahead:
            policies.append(forecasts(recording, routers, k, k, d, engine.predictor, args.floor))
        policies.append(forecasts(recording, routers, k, k, d, floor=args.floor))
    tiers = [tuple(int(x) for x in pair.split("+")) for pair in args.tiers.split(",")]
    clock = TierClock(args.layer_ms, args.disk_gbs * 1e9, bytes_, args.lag)
    options = dict(
        live_tables=args.live_tables,
        demand_first=args.demand_first,
        routed_ahead=args.routed,
        slots=args.slots,
        admission=SlotAdmission(args.admit_every, args.half_life, args.margin),
    )
    head = next_use_distances(recording, engine.predictor) if engine.predictor is not None else None
    rows = replay_rows(recording.routing, tiers, clock, policies, distances, args.warm, head, **options)

    E, L = engine.num_experts, len(recording.routing[0])
    passes = rows[0].figures.passes
    agree, compared = recording.agreement
    admitted = f" every {args.admit_every} passes (half-life {args.half_life:g}, margin {args.margin:g})"
    title = (
        f"Three tiers replayed: {Path(args.model).name}, {len(texts)} prompts x {args.tokens} greedy tokens, "
        f"{passes} decode passes counted after {args.warm}; {L} MoE layers, {E} experts, top-{k}; an expert "
        f"{bytes_ / 1e6:.2f} MB, disk {args.disk_gbs:g} GB/s, {args.layer_ms:.3f} ms a layer, lag {args.lag}"
        f"{', live tables' if args.live_tables else ''}{', demand first' if args.demand_first else ''}"
        f"{', routed read-ahead' if args.routed else ''}, slots by {args.slots}"
        f"{admitted if args.slots == 'admitted' else ''}"
        f"{f', forecasts read from top-k x probability {args.floor:g}' if args.floor else ''}"
        f"; teacher-forced routing equals the decode's at "
        f"{agree}/{compared} layer passes; per decoded token:"
    )
    headers = [
        "tiers",
        "policy",
        "host evicts",
        "disk reads",
        "disk MB",
        "host lanes",
        "late",
        "wasted/reads",
        "stopped",
        "stall ms",
        "ms",
        "x all-in-host",
        "x disk roofline",
        "hidden",
    ]
    out = []
    for r in rows:
        f = r.figures
        out.append(
            [
                f"{r.device}+{r.host} of {E}",
                r.policy,
                r.eviction,
                f"{f.per_token('reads'):.2f}",
                f"{f.per_token('reads') * bytes_ / 1e6:.1f}",
                f"{f.per_token('host_lanes'):.2f}",
                f"{f.per_token('ahead_late'):.2f}",
                f"{f.wasted_of_reads:.2f}",
                f"{f.per_token('stopped'):.2f}",
                f"{f.stall_ms / f.passes:.2f}",
                f"{f.token_ms:.2f}",
                f"{r.all_in_host_ms / f.token_ms:.3f}",
                f"{r.roofline_ms / f.token_ms:.3f}",
                "-" if r.hidden is None else f"{r.hidden:.2f}",
            ]
        )
    print(table(headers, out, title))
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        rows_out = [r.as_dict() for r in rows]
        record = dict(argv=sys.argv, commit=commit, title=title, prompts=texts, rows=rows_out)
        Path(args.json).write_text(json.dumps(record, indent=1, default=float))


if __name__ == "__main__":
    main()
