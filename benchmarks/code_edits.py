"""Drafting on code edits (issue #57's goal rows), by hand: a committed set of code-editing prompts (a file,
an instruction, the start of the rewrite), each generated greedy without drafting and with prompt lookup
(`od_moe.PromptLookup`, at most k tokens a pass, only what a lookup finds) at one capacity, both in one
process and alternating, with stock mlx-lm's model run through the same lookup loop as the reference (every
expert resident, where it fits). Per prompt and in all: whether the tokens equal the reference and the
undrafted ones, the acceptance rate (in all, apart for drafts found in the prompt and in the answer so far),
experts read (two tiers: in place plus copied) per generated token drafted over undrafted, and tok/s drafted
over undrafted (the median of `--rounds`).
With `--draft-model PATH` a draft model drafts instead (k tokens every pass, mlx-lm's loop), the reference
is stock mlx-lm's `stream_generate` with the same draft, and stock's own gain from that draft (every expert
resident, tok/s drafted over undrafted, alternating in the same rounds) is printed beside od-moe's.

    python benchmarks/code_edits.py [--model PATH] [--capacity 0.25] [--two-tier auto|on|off|lru]
        [--tokens 96] [--k 3] [--rounds 3] [--no-stock] [--draft-model PATH]

On this CPU the model and its lookup share two cores: the experts a token are the figure, tok/s is noise.
"""

import argparse
import statistics
import sys
import time

import od_moe
from od_moe.accounting.report import table

FILE = '''import json
import os


def load_config(path):
    """Read a JSON config file and return it as a dict."""
    with open(path) as f:
        return json.load(f)


def save_config(path, config):
    """Write a config dict to a JSON file."""
    with open(path, "w") as f:
        json.dump(config, f)


def config_path(name):
    return os.path.join(os.path.expanduser("~"), ".config", name + ".json")
'''

# (instruction, the start of the rewrite): the answer repeats most of FILE, as code edits do
EDITS = [
    ("Save the config with indent=2.", "import json\nimport os\n\n\ndef load_config(path):\n"),
    ("Rename load_config to read_config.", "import json\nimport os\n\n\ndef read_config(path):\n"),
    (
        "Add a default argument to load_config.",
        "import json\nimport os\n\n\ndef load_config(path, default=None):\n",
    ),
    (
        "Use pathlib in config_path.",
        "import json\nimport os\nfrom pathlib import Path\n\n\ndef load_config(path):\n",
    ),
    ("Add type hints.", "import json\nimport os\n\n\ndef load_config(path: str) -> dict:\n"),
    ("Sort the keys when saving.", "import json\nimport os\n\n\ndef load_config(path):\n"),
]


def prompts() -> list[str]:
    return [f"{FILE}\n# {instruction}\n{start}" for instruction, start in EDITS]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model")
    parser.add_argument("--capacity", default="0.25")
    parser.add_argument("--two-tier", default="auto")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--shortest", type=int, default=None, help="the shortest run a lookup drafts from")
    parser.add_argument(
        "--no-stock", action="store_true", help="skip the reference (a model stock cannot hold)"
    )
    parser.add_argument("--draft-model", help="a draft model's folder, drafting instead of prompt lookup")
    args = parser.parse_args(argv)
    two_tier = {"on": True, "off": False}.get(args.two_tier, args.two_tier)
    engine = od_moe.load(args.model, capacity=args.capacity, two_tier=two_tier)
    shortest = {} if args.shortest is None else {"shortest": args.shortest}
    reference, stock_gain = None, None
    if not args.no_stock:
        reference, stock_gain = stock_reference(engine, args, shortest)
    rows, by_source = [], {"prompt": [0, 0], "output": [0, 0]}  # source -> [accepted, drafted]
    totals = [0, 0]  # [accepted, drafted], from the engine's statistics
    for i, prompt in enumerate(prompts()):
        speed, result = {"plain": [], "drafted": []}, {}
        for _ in range(args.rounds):
            for kind in speed:
                lookup = od_moe.PromptLookup(**shortest)  # a fresh one each generation
                drafter = args.draft_model or lookup
                extra = dict(draft_model=drafter, num_draft_tokens=args.k) if kind == "drafted" else {}
                engine.reset_stats()
                start = time.perf_counter()
                tokens = [r.token for r in engine.stream_generate(prompt, max_tokens=args.tokens, **extra)]
                speed[kind].append(len(tokens) / (time.perf_counter() - start))
                stats = engine.stats()
                result[kind] = (tokens, stats["experts_per_token"], stats["drafts"], lookup.counts)
        plain, drafted = result["plain"], result["drafted"]
        same = reference is None or drafted[0] == reference[i]
        ratio = statistics.median(d / p for d, p in zip(speed["drafted"], speed["plain"]))
        for source, counts in by_source.items():
            counts[0] += drafted[3].accepted[source]
            counts[1] += drafted[3].drafted[source]
        totals[0] += drafted[2]["accepted"]
        totals[1] += drafted[2]["drafted"]
        rows.append(
            [
                i,
                "yes" if same else "NO",
                "yes" if drafted[0] == plain[0] else "no",
                f"{drafted[2]['accepted']}/{drafted[2]['drafted']}",
                f"{plain[1]:.2f}",
                f"{drafted[1]:.2f}",
                f"{drafted[1] / plain[1]:.2f}",
                f"{ratio:.2f}",
                "-" if stock_gain is None else f"{stock_gain[i]:.2f}",
            ]
        )
    print(
        table(
            [
                "prompt",
                "= stock, same loop",
                "= undrafted",
                "accepted",
                "experts/tok plain",
                "experts/tok drafted",
                "x experts",
                "x tok/s",
                "stock x tok/s",
            ],
            rows,
            title=f"{engine.model_path.name} at {args.capacity}, {engine.mode.path}, {args.tokens} tokens, "
            f"k = {args.k}, {args.rounds} rounds, drafts from "
            f"{args.draft_model or 'prompt lookup'}",
        )
    )
    if args.draft_model:
        print(f"acceptance in all: {totals[0]}/{totals[1]}")
    else:
        accepted, drafted = (sum(c[j] for c in by_source.values()) for j in (0, 1))
        found = ", ".join(f"found in the {s} {a}/{d}" for s, (a, d) in by_source.items())
        print(f"acceptance in all: {accepted}/{drafted} ({found})")
    return 0 if all(r[1] == "yes" for r in rows) else 1


def stock_reference(engine, args, shortest: dict) -> tuple[list[list[int]], list[float] | None]:
    """Stock mlx-lm's tokens for each prompt, drafted as od-moe drafts them (prompt lookup's loop fed the
    same lookups, or mlx-lm's own loop with the same draft model); with a draft model also stock's gain,
    tok/s drafted over undrafted, the median of `--rounds` alternating."""
    import mlx_lm

    from od_moe.generation.prompt_lookup import LookupCounts, stream_lookup
    from od_moe.memory import backend

    model, tokenizer = mlx_lm.load(str(engine.model_path))
    if (dtype := backend.compute_dtype()) is not None:
        model.set_dtype(dtype)
    if not args.draft_model:
        reference = [
            [
                r.token
                for r in stream_lookup(
                    model,
                    tokenizer,
                    engine.encode(p),
                    args.tokens,
                    LookupCounts(),
                    num_draft_tokens=args.k,
                    **shortest,
                )
            ]
            for p in prompts()
        ]
        return reference, None
    draft, _ = mlx_lm.load(args.draft_model)
    if dtype is not None:
        draft.set_dtype(dtype)
    reference, gain = [], []
    for p in prompts():
        ids, speed = engine.encode(p), {"plain": [], "drafted": []}
        for _ in range(args.rounds):
            for kind in speed:
                extra = dict(draft_model=draft, num_draft_tokens=args.k) if kind == "drafted" else {}
                start = time.perf_counter()
                stream = mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=args.tokens, **extra)
                tokens = [r.token for r in stream]
                speed[kind].append(len(tokens) / (time.perf_counter() - start))
        reference.append(tokens)
        gain.append(statistics.median(d / p for d, p in zip(speed["drafted"], speed["plain"])))
    return reference, gain


if __name__ == "__main__":
    sys.exit(main())
