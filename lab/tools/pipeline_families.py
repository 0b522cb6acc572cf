"""Every family's tiny model (`tests/tiny_models.py`) split over two loopback ranks: greedy tokens against
stock mlx-lm's, at 25% of the experts with next-gate prefetch. CI runs two families
(`tests/test_pipeline.py`); this runs them all, by hand (a few minutes on 2 cores):

    python lab/tools/pipeline_families.py [--ranks 2] [--workdir DIR]

Prints one line per family: equal or not, and each rank's decoder layers.
"""

import argparse
import json
import sys
import tempfile
from pathlib import Path

TESTS = Path(__file__).resolve().parents[2] / "tests"
PROMPTS = [[1, 17, 300, 42, 9, 88], [5, 600, 23, 23, 7]]
NEW_TOKENS = 10


def rank_run(workdir: Path):
    """On each rank: every family split over the ranks, compared with stock mlx-lm in this process."""
    import od_moe
    from conftest import reference_tokens
    from tiny_models import FAMILIES

    rows = {}
    for name in sorted(FAMILIES):
        path = workdir / name
        reference = reference_tokens(path, PROMPTS, NEW_TOKENS)
        engine = od_moe.load(str(path), capacity=0.25, prefetch="next-gate")
        tokens = [[r.token for r in engine.stream_generate(p, max_tokens=NEW_TOKENS)] for p in PROMPTS]
        rows[name] = {"equal": tokens == reference, "layers": [engine.stage.start, engine.stage.end]}
        engine.close()
    (workdir / f"rank{engine.stage.rank}.json").write_text(json.dumps(rows))


def main():
    sys.path.insert(0, str(TESTS))
    if sys.argv[1:2] == ["--rank-run"]:
        return rank_run(Path(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    from od_moe.distributed.local_ranks import launch
    from tiny_models import FAMILIES, write_mlx_model

    with tempfile.TemporaryDirectory() as scratch:
        workdir = Path(args.workdir or scratch)
        for name, config in FAMILIES.items():
            write_mlx_model(workdir / name, config)
        done = launch(Path(__file__).resolve(), ["--rank-run", workdir], args.ranks, 1800, [TESTS])
        if done.returncode != 0:
            raise SystemExit(f"the ranks failed:\n{done.stderr[-3000:]}")
        ranks = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(args.ranks)]
    for name in sorted(ranks[0]):
        equal = all(r[name]["equal"] for r in ranks)
        layers = ", ".join(f"rank {i}: {r[name]['layers']}" for i, r in enumerate(ranks))
        print(f"{name:<14} {'equal' if equal else 'DIFFERENT'} to stock mlx-lm ({layers})")


if __name__ == "__main__":
    main()
