"""Lab: how the slots' admission past the host's memory (cadence, counts' half-life, a newcomer's margin)
changes what demand-only three tiers read from disk, against slots kept by recency: replayed
(`caching/tier_replay.py`) on a model's recorded decode routing, recorded once and kept in `--routing`
(a pickle) for the next sweep.

    python lab/three_tiers/admission_sweep.py --model M --expert-bytes qwen3-30b-a3b --layer-ms 0.333 \
        --tiers 32+8,32+32 --routing /tmp/q30-8.pkl --grid 8:32:2,8:4:2,8:4:0.5,1:2:0
"""

import argparse
import pickle
import runpy
from pathlib import Path

import od_moe
from od_moe.bench.real_shapes import expert_nbytes
from od_moe.bench.tier_replay import record_decode
from od_moe.caching.tier_replay import SlotAdmission, TierClock, replay_tiers


def routing_of(model: str, path: Path, tokens: int):
    if path.exists():
        return pickle.loads(path.read_bytes())
    bench = runpy.run_path(str(Path(__file__).parents[2] / "benchmarks" / "tier_replay.py"))
    engine = od_moe.load(model, capacity=1.0, two_tier=False)
    routing = record_decode(engine, bench["prompts"](), tokens).routing
    path.write_bytes(pickle.dumps(routing))
    return routing


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=str(od_moe.DEFAULT_MODEL))
    parser.add_argument("--expert-bytes", default="bundled-real-widths")
    parser.add_argument("--layer-ms", type=float, default=4.42 / 8)
    parser.add_argument("--disk-gbs", type=float, default=1.0)
    parser.add_argument("--tiers", default="16+8,16+16")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--warm", type=int, default=64)
    parser.add_argument("--routing", type=Path, required=True)
    parser.add_argument("--grid", default="64:32:2,8:32:2", help="every:half-life:margin, comma-separated")
    args = parser.parse_args()
    size = args.expert_bytes
    clock = TierClock(
        args.layer_ms, args.disk_gbs * 1e9, int(size) if size.isdigit() else expert_nbytes(size)
    )
    routing = routing_of(args.model, args.routing, args.tokens)
    print(f"{args.model}: {len(routing)} passes, {len(routing[0])} layers; per decoded token, demand only:")
    print("| tiers | slots | disk reads | disk MB | device lanes | host lanes | stall ms | ms |")
    print("|---|---|---|---|---|---|---|---|")
    for pair in args.tiers.split(","):
        device, host = (int(x) for x in pair.split("+"))
        runs = [("recency", "recency", SlotAdmission())]
        for cell in args.grid.split(","):
            every, half_life, margin = cell.split(":")
            runs.append((cell, "admitted", SlotAdmission(int(every), float(half_life), float(margin))))
        for name, slots, admission in runs:
            f = replay_tiers(
                routing,
                device,
                host,
                clock,
                warm=args.warm,
                demand_first=True,
                slots=slots,
                admission=admission,
            )
            print(
                f"| {pair} | {name} | {f.per_token('reads'):.2f} | "
                f"{f.per_token('reads') * clock.expert_bytes / 1e6:.2f} | "
                f"{f.per_token('device_lanes'):.2f} | "
                f"{f.per_token('host_lanes'):.2f} | {f.per_token('stall_ms'):.2f} | {f.token_ms:.2f} |"
            )


if __name__ == "__main__":
    main()
