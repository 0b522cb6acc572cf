"""The per-layer sync path with one of the runtime's switches off and on: the same partly resident engine
twice, in one process, alternating prompt by prompt (machines are noisy: the ratio is the figure).
Greedy tokens must agree; host syncs per decoded token are deterministic.

- `--switch optimistic`: optimistic decode passes (`optimistic.py`) against a sync per layer;
- `--switch launch_early`: a layer the host synced at starts computing at once (`mx.async_eval`), against
  leaving it to the next sync;
- `--switch split_on_miss`: a decode layer that misses computes its resident experts while the missing
  ones are read, against reading them first (on by default on the CPU backend);
- `--switch copy_installs`: installs copy the read bytes into the slots (numpy views of host memory;
  on CUDA the runtime's copies from pinned staging), against MLX writes from arrays the reader threads
  make (CUDA's path without the runtime's copies).
`--policy oracle` records each prompt's routing once and replays it in both engines. `--with SWITCH`
turns another switch on in both; `--no-self-checks` keeps prefetch from pausing itself.
`--cold` reads every expert from the device (direct I/O, the page cache dropped before each prompt).

    python benchmarks/sync_path.py
        [--switch optimistic|launch_early|split_on_miss|copy_installs]
        [--policy none|predictor|oracle] [--model PATH] [--capacities 0.75,0.875] [--rounds 3] [--tokens 64]
        [--cold] [--with SWITCH] [--no-self-checks]
"""

import argparse

import od_moe
from od_moe.bench.foundation import PROMPTS
from od_moe.bench.prefetch import _predictor_for
from od_moe.governor import PrefetchSettings
from od_moe.report import table

SWITCHES = ("optimistic", "launch_early", "split_on_miss", "copy_installs")


def _generate(engine, prompt, max_tokens, cold=False, trace=None, settings=None):
    """Decode tok/s of one greedy generation, and its tokens; `trace`: the oracle's routing of `prompt`."""
    if trace is not None:
        engine.configure_prefetch("oracle", oracle_trace=trace, settings=settings)
    if cold:
        engine.runtime.store.drop_page_cache()
    out = list(engine.stream_generate(prompt, max_tokens=max_tokens))
    return out[-1].generation_tps, [r.token for r in out]


def _per_token(engine) -> tuple[float, int, int]:
    stats = engine.stats()
    ran = stats["optimistic"]
    return ran["host_syncs"] / max(stats["positions"]["decode"], 1), ran["passes"], ran["missed"]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--switch", choices=SWITCHES, default="optimistic")
    parser.add_argument("--policy", choices=("none", "predictor", "oracle"), default="none")
    parser.add_argument(
        "--model", default=str(od_moe.DEFAULT_MODEL), help="an MLX model folder (default: embedded)"
    )
    parser.add_argument("--capacities", default="0.75,0.875", help="fractions of experts resident")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--cold", action="store_true", help="every read from the device (direct I/O)")
    parser.add_argument(
        "--with",
        dest="also",
        choices=SWITCHES,
        action="append",
        default=[],
        help="another switch, on in both engines (repeatable)",
    )
    parser.add_argument(
        "--no-self-checks",
        action="store_true",
        help="prefetch never pauses itself (the governor's timed checks off)",
    )
    args = parser.parse_args()
    predictor = None
    if args.policy == "predictor":  # the bundled predictor, tied to this model (or its widened copy)
        predictor = _predictor_for(od_moe.load(args.model, capacity=1).identity)
    settings = PrefetchSettings(timed_checks=False) if args.no_self_checks else None
    rows = []
    for capacity in (float(c) for c in args.capacities.split(",")):
        traces = dict.fromkeys(PROMPTS)
        if args.policy == "oracle":  # routing does not depend on what is resident: one recording serves
            recorder = od_moe.load(args.model, capacity=capacity)
            traces = {p: recorder.record_routing(p, max(args.tokens, 8)) for p in PROMPTS}
        engines = []
        for on in (False, True):
            engine = od_moe.load(args.model, capacity=capacity, prefetch="none", predictor=predictor)
            if args.policy == "predictor":  # the oracle is configured per prompt (`_generate`)
                engine.configure_prefetch("predictor", settings=settings)
            if args.cold:
                engine.runtime.store.use_direct_io(True)
                engine.runtime.store.drop_after_read = True
            for other in args.also:
                setattr(engine.runtime, other, True)
            setattr(engine.runtime, args.switch, on)
            _generate(engine, PROMPTS[0], 8, trace=traces[PROMPTS[0]], settings=settings)  # warm-up
            engine.reset_stats()
            engines.append(engine)
        tps = [[], []]
        same = True
        for _ in range(args.rounds):  # alternate prompt by prompt: drifts of the machine hit both alike
            for p in PROMPTS:
                (a, x), (b, y) = (
                    _generate(e, p, args.tokens, args.cold, traces[p], settings) for e in engines
                )
                tps[0].append(a)
                tps[1].append(b)
                same &= x == y
        mean = [sum(t) / len(t) for t in tps]
        (sync_a, _, _), (sync_b, passes, missed) = (_per_token(e) for e in engines)
        rows.append(
            [f"{capacity:.1%}", mean[0], mean[1], mean[1] / mean[0], sync_a, sync_b, passes, missed, same]
        )
    title = (
        f"{args.model}, policy {args.policy}, {len(PROMPTS)} prompts x {args.tokens} tokens x {args.rounds}"
        f" rounds, {'cold' if args.cold else 'warm'} reads: decode with {args.switch} off and on"
    )
    if args.also:
        title += f" ({', '.join(args.also)} on in both)"
    if args.no_self_checks:
        title += ", prefetch never paused"
    columns = ["capacity", "tok/s off", "tok/s on", "ratio", "syncs/token off", "syncs/token on"]
    columns += ["optimistic passes", "ran again", "same tokens"]
    print(table(columns, rows, title=title))


if __name__ == "__main__":
    main()
