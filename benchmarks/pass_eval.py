"""Where an optimistic decode pass's time goes, by how many experts were installed during it.

The oracle prefetches in optimistic passes (`OffloadRuntime.optimistic_prefetch`, prefetch never paused)
on one engine per prompt; for every decode pass that stood (nothing missed), the host's time building
the pass and the time of its one evaluation (the flags' sync, `end_optimistic`) are grouped by the
experts installed during the pass. On a GPU the evaluation is where the device's work shows; on the CPU
backend the MLX install path can be forced with `--mlx-writes` (CUDA's path, as a check of the tool).
`--start-installs off` leaves the installs in the pass's graph (`OffloadRuntime.start_installs`).

    python benchmarks/pass_eval.py [--model PATH] [--capacity 0.25] [--tokens 48] [--prompts 2]
        [--start-installs on|off] [--mlx-writes]
"""

import argparse
import time

import numpy as np

import od_moe
from od_moe import runtime as runtime_module
from od_moe.bench.foundation import PROMPTS
from od_moe.governor import PrefetchSettings
from od_moe.report import table

BINS = ((0, 1), (1, 4), (4, 10**9))  # experts installed during a pass


def _timed_passes(log: list):
    """Wrap the runtime's optimistic pass hooks to log (build s, evaluation s, installs, stood)."""
    runtime_cls = runtime_module.OffloadRuntime
    begin, end = runtime_cls.begin_optimistic, runtime_cls.end_optimistic

    def installed(runtime):
        return runtime.ledger.total("prefetch_installed") + runtime.ledger.total("installed")

    def timed_begin(self):
        self._timing = (time.perf_counter(), installed(self))
        return begin(self)

    def timed_end(self, logits):
        t1 = time.perf_counter()
        first_miss = end(self, logits)
        t0, before = self._timing
        log.append((t1 - t0, time.perf_counter() - t1, installed(self) - before, first_miss is None))
        return first_miss

    runtime_cls.begin_optimistic, runtime_cls.end_optimistic = timed_begin, timed_end


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(od_moe.DEFAULT_MODEL))
    parser.add_argument("--capacity", type=float, default=0.25)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--start-installs", choices=("on", "off"), default="on")
    parser.add_argument("--mlx-writes", action="store_true", help="install with MLX writes (CUDA's path)")
    args = parser.parse_args()
    log: list = []
    _timed_passes(log)
    tps = []
    for prompt in PROMPTS[: args.prompts]:
        trace = od_moe.load(args.model, capacity=args.capacity).record_routing(prompt, args.tokens)
        engine = od_moe.load(args.model, capacity=args.capacity)
        engine.configure_prefetch("oracle", oracle_trace=trace, settings=PrefetchSettings(timed_checks=False))
        runtime = engine.runtime
        runtime.optimistic = runtime.optimistic_prefetch = True
        runtime.start_installs = args.start_installs == "on"
        runtime.token_miss_rate = 0.0
        if args.mlx_writes:
            runtime.copy_installs = False
        first = len(log)
        out = list(engine.stream_generate(prompt, max_tokens=args.tokens))
        tps.append(out[-1].generation_tps)
        del log[first : first + len(log[first:]) // 3]  # the prompt's first third: kernels, the cache filling
        engine.close()
    stood = np.array([entry[:3] for entry in log if entry[3]], dtype=float).reshape(-1, 3)
    rows = []
    for low, high in BINS:
        group = stood[(stood[:, 2] >= low) & (stood[:, 2] < high)]
        if len(group):
            label = f"{low}-{high - 1}" if high < 10**9 else f"{low}+"
            build_ms, evaluation_ms = 1e3 * group[:, 0].mean(), 1e3 * group[:, 1].mean()
            rows.append([label, len(group), group[:, 2].mean(), build_ms, evaluation_ms])
    title = (
        f"{args.model} at {args.capacity:.1%}, oracle prefetch in optimistic passes, {len(tps)} prompts x "
        f"{args.tokens} tokens, installs started at once: {args.start_installs}; decode "
        f"{sum(tps) / len(tps):.1f} tok/s; passes that stood, after each prompt's first third"
    )
    columns = ["installs in pass", "passes", "mean installs", "build ms", "evaluation ms"]
    print(table(columns, rows, title=title))


if __name__ == "__main__":
    main()
