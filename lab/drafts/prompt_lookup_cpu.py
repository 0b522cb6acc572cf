"""Lab: prompt lookup on this CPU (not product code): a code-editing prompt (a file, then the start of its
rewrite), 64 greedy tokens at 12.5, 25 and 50% on both paths, undrafted and drafted by `PromptLookup` (k=3):
acceptance, verify passes, and experts read (two tiers: in place plus copied) per generated token.

  python3 lab/drafts/prompt_lookup_cpu.py [SHORTEST]   (the shortest run drafted from; default od-moe's)
"""

import sys

import od_moe

LOOKUP = {"shortest": int(sys.argv[1])} if len(sys.argv) > 1 else {}

FILE = (
    "import json\n\n\ndef load_config(path):\n    with open(path) as f:\n        return json.load(f)\n\n\n"
    "def save_config(path, config):\n    with open(path, 'w') as f:\n        json.dump(config, f)\n\n\n"
)
PROMPT = FILE + "# the same module, with indent=2 when saving\nimport json\n\n\ndef load_config(path):\n"

for two_tier in (False, True):
    for capacity in (0.125, 0.25, 0.5):
        row = {}
        for drafted in (False, True):
            engine = od_moe.load(capacity=capacity, two_tier=two_tier)
            extra = dict(draft_model=od_moe.PromptLookup(**LOOKUP), num_draft_tokens=3) if drafted else {}
            tokens = [r.token for r in engine.stream_generate(PROMPT, max_tokens=64, **extra)]
            stats = engine.stats()
            row[drafted] = (tokens, stats["experts_per_token"], stats["drafts"])
            engine.close()
        same = row[False][0] == row[True][0]
        d, path = row[True][2], "two-tier" if two_tier else "per-layer"
        print(
            f"{path} {capacity:.1%}: acceptance {d['acceptance_rate']:.3f} "
            f"({d['accepted']}/{d['drafted']} in {d['verify_passes']} verify passes), experts a token "
            f"{row[False][1]:.2f} -> {row[True][1]:.2f} ({row[True][1] / row[False][1]:.2f}x), "
            f"same text as undrafted: {same}"
        )
