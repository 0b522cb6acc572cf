"""Two loopback ranks against one process, each with the same expert budget B (issue #39's measure).

B is `--fraction` (default 25%) of the whole model's expert bytes. One process holds all the layers, so B
buys that fraction of every layer's experts; two ranks each hold half the layers, so the same B buys each
rank twice the fraction of its own layers' experts. Exact mode, on-demand reads, cold (every read past the
page cache: `drop_pages_after_read`, the page cache dropped before each prompt), greedy, the same prompts.
Rows: decode tok/s (mean over prompts of mlx-lm's generation tok/s) and, per rank, decode hit rate and MB
read per decode pass; and whether the tokens equal the one process's.

    python lab/tools/pipeline_bench.py [--widen 32] [--max-tokens 24] [--fraction 0.25] [--backend nccl]

The bundled model, and a copy widened `--widen` times (`od_moe.bench.widen`, 0: none) written to
`--workdir`. Run by hand; CI runs the exactness tests instead (`tests/test_pipeline.py`).
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):"]


def run_here(model: str, capacity: float, max_tokens: int) -> dict:
    """Generate the prompts cold with this process's engine (split over the ranks under mlx.launch)."""
    import od_moe

    engine = od_moe.load(model, capacity=capacity, prefetch="none", two_tier=False)  # the exact SSD path
    store = engine.runtime.store
    store.drop_pages_after_read()
    tokens, tps = [], []
    for prompt in PROMPTS:
        store.drop_page_cache()
        responses = list(engine.stream_generate(prompt, max_tokens=max_tokens))
        tokens.append([r.token for r in responses])
        tps.append(responses[-1].generation_tps)
    stats = engine.stats()
    passes = max(stats["positions"]["decode"], 1)
    decode = stats["total"]["decode"]
    mine = [decode["hit_rate"], stats["io"]["decode"]["bytes_read"] / passes / 1e6, len(engine.caches)]
    rows = engine.stage.gather_numbers(mine) if engine.stage is not None else [mine]
    return {"tokens": tokens, "tok_s": sum(tps) / len(tps), "ranks": rows}


def _row(name: str, result: dict, reference) -> str:
    ranks = "; ".join(
        f"rank {r}: {int(layers)} MoE layers, hit {hit:.3f}, {mb:.2f} MB/pass"
        for r, (hit, mb, layers) in enumerate(result["ranks"])
    )
    same = "" if reference is None else f", tokens equal: {result['tokens'] == reference}"
    return f"{name:<34} {result['tok_s']:6.2f} tok/s  ({ranks}{same})"


def compare(model: str, fraction: float, max_tokens: int, label: str, backend: str = "ring") -> list[str]:
    from od_moe.distributed.local_ranks import launch

    one = run_here(model, fraction, max_tokens)
    with tempfile.TemporaryDirectory() as out:
        args = ["--rank-run", model, str(2 * fraction), str(max_tokens), out]
        done = launch(Path(__file__).resolve(), args, timeout=1800, backend=backend)
        if done.returncode != 0 or not (Path(out) / "rank0.json").exists():
            raise SystemExit(f"the ranks failed:\n{done.stderr[-3000:]}")
        two = json.loads((Path(out) / "rank0.json").read_text())
    return [
        _row(f"{label}, 1 process at {fraction:.0%}", one, None),
        _row(f"{label}, 2 ranks at {2 * fraction:.0%} each", two, one["tokens"]),
        f"{'':<34} 2 ranks / 1 process: {two['tok_s'] / one['tok_s']:.2f}x",
    ]


def main():
    if sys.argv[1:2] == ["--rank-run"]:  # one rank of the two-rank run
        model, capacity, max_tokens, out = sys.argv[2:6]
        result = run_here(model, float(capacity), int(max_tokens))
        import mlx.core as mx

        if mx.distributed.init().rank() == 0:
            (Path(out) / "rank0.json").write_text(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widen", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--fraction", type=float, default=0.25)
    parser.add_argument("--workdir", default="/tmp/od-moe-bench")
    parser.add_argument("--backend", default="ring", help="ring (loopback) or nccl (this machine's GPUs)")
    parser.add_argument("--skip-bundled", action="store_true", help="only the widened copy")
    args = parser.parse_args()
    from od_moe.bench.widen import widen_model
    from od_moe.storage.model_files import DEFAULT_MODEL

    if not args.skip_bundled:
        lines = compare(str(DEFAULT_MODEL), args.fraction, args.max_tokens, "bundled", args.backend)
        print("\n".join(lines), flush=True)
    if args.widen:
        wide = widen_model(DEFAULT_MODEL, Path(args.workdir) / f"widened-x{args.widen}", args.widen)
        lines = compare(str(wide), args.fraction, args.max_tokens, f"widened x{args.widen}", args.backend)
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
