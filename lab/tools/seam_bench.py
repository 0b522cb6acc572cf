"""Prediction across the seam (issue #39, `od_moe/distributed/seams.py`), measured on two loopback ranks.

Rank 1 runs the first MoE layers, rank 0 the last; with next-gate prefetch rank 1 also predicts rank 0's
first MoE layer and sends the prediction ahead of the hidden state. Per run: of the reads rank 0 was asked
for its first MoE layer, the fraction started before the hidden state came (the goal: >= 0.8), and, with
the seam's prediction on and off, rank 0's decode hit rate at that layer and in all, MB read per decode
pass and rank 0's decode tok/s. Exact mode, next-gate prefetch (the governor's precision check only, so
that prefetch runs where it would not pay: this measures the seam), `--capacity` of each rank's own layers'
experts, reads cold (past the page cache) unless `--warm`, greedy, 3 prompts; the tokens are compared with
the seam's prediction off. Each mode loads its own engine (on first, then off), cold caches.

    python lab/tools/seam_bench.py [--widen 32] [--max-tokens 24] [--capacity 0.5] [--warm]

Run by hand; CI checks the seam's counts and exactness in `tests/test_pipeline.py`.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):"]


def rank_run(model: str, capacity: float, max_tokens: int, warm: bool) -> dict:
    """Both modes on this rank (every rank runs it under mlx.launch), each on a freshly loaded engine."""
    return {
        "runs": {mode: _one_mode(model, capacity, max_tokens, warm, mode == "on") for mode in ("on", "off")}
    }


def _one_mode(model: str, capacity: float, max_tokens: int, warm: bool, seam: bool) -> dict:
    import od_moe
    from od_moe.distributed import seams
    from od_moe.prefetch.governor import PrefetchSettings

    engine = od_moe.load(model, capacity=capacity)
    # the governor's precision check only: its timed checks pause prefetch where it does not pay
    engine.configure_prefetch("next-gate", settings=PrefetchSettings(timed_checks=False))
    store, stage, policy = engine.runtime.store, engine.stage, engine.runtime.policy
    store.drop_pages_after_read(not warm)
    sender = policy if isinstance(policy, seams.SeamSender) else None
    if sender is not None:
        sender.send_predictions(seam)
    seams.watch(engine)
    tokens, tps = [], []
    for prompt in PROMPTS:
        if not warm:
            store.drop_page_cache()
        responses = list(engine.stream_generate(prompt, max_tokens=max_tokens))
        tokens.append([r.token for r in responses])
        tps.append(responses[-1].generation_tps)
    stats, receiver = engine.stats(), engine.seam_receiver
    passes = max(stats["positions"]["decode"], 1)
    engine.close()
    return {
        "rank": stage.rank,
        "layers": [stage.start, stage.end - 1],
        "tokens": tokens,
        "tok_s": sum(tps) / len(tps),
        "first_layer_hit": stats["layers"][0]["decode"]["hit_rate"],
        "hit": stats["total"]["decode"]["hit_rate"],
        "mb_per_pass": stats["io"]["decode"]["bytes_read"] / passes / 1e6,
        "prefetch": {k: stats["prefetch"][k] for k in ("issued", "useful", "wasted", "late")},
        "seam": dict(receiver.counts) if receiver is not None else None,
        "sent": sender.sent if sender is not None else None,
    }


def report(model: str, capacity: float, max_tokens: int, warm: bool, label: str) -> list[str]:
    from od_moe.distributed.local_ranks import launch

    with tempfile.TemporaryDirectory() as out:
        args = ["--rank-run", model, capacity, max_tokens, int(warm), out]
        done = launch(Path(__file__).resolve(), args, timeout=1800)
        if done.returncode != 0:
            raise SystemExit(f"the ranks failed:\n{done.stderr[-3000:]}")
        ranks = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(2)]
    lines = []
    for mode in ("off", "on"):
        r0 = ranks[0]["runs"][mode]
        seam = r0["seam"]
        started = seam["started_before_hidden_state"] / seam["reads"] if seam["reads"] else float("nan")
        lines.append(
            f"{label}, seam prediction {mode:>3}: rank 0 {r0['tok_s']:.2f} tok/s, first-layer hit "
            f"{r0['first_layer_hit']:.3f}, hit {r0['hit']:.3f}, {r0['mb_per_pass']:.2f} MB/pass; rank 1 sent "
            f"{ranks[1]['runs'][mode]['sent']} predictions; rank 0 asked {seam['reads']} reads, "
            f"{seam['started_before_hidden_state']} started before the hidden state came ({started:.3f}), "
            f"{seam['late']} predictions late; prefetch {r0['prefetch']}"
        )
    same = ranks[0]["runs"]["on"]["tokens"] == ranks[0]["runs"]["off"]["tokens"]
    lines.append(f"{label}: tokens with the seam's prediction equal those without: {same}")
    return lines


def main():
    if sys.argv[1:2] == ["--rank-run"]:  # one rank of the two
        model, capacity, max_tokens, warm, out = sys.argv[2:7]
        result = rank_run(model, float(capacity), int(max_tokens), warm == "1")
        (Path(out) / f"rank{result['runs']['on']['rank']}.json").write_text(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--widen", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=24)
    parser.add_argument("--capacity", type=float, default=0.5)
    parser.add_argument("--warm", action="store_true")
    parser.add_argument("--workdir", default="/tmp/od-moe-bench")
    args = parser.parse_args()
    from od_moe.bench.widen import widen_model
    from od_moe.storage.model_files import DEFAULT_MODEL

    model, label = str(DEFAULT_MODEL), "bundled"
    if args.widen:
        model = str(widen_model(DEFAULT_MODEL, Path(args.workdir) / f"widened-x{args.widen}", args.widen))
        label = f"widened x{args.widen}"
    print("\n".join(report(model, args.capacity, args.max_tokens, args.warm, label)), flush=True)


if __name__ == "__main__":
    main()
