"""Compare two `od-moe bench --deterministic --widen 0 --max-tokens 32 --json` outputs on every value that is
not a timing (issue #71: a refactor must leave hit counts, bytes, tokens and reads exactly as they were).

    python3 lab/refactor/compare_deterministic.py BEFORE.json AFTER.json

Timing keys (seconds, milliseconds, rates and the ratios made from them) are listed apart and not compared.
Exit 1 where a non-timing value differs.
"""

import json
import re
import sys

# `roofline_bound` names the larger of two measured times (compute or read): a timing too
TIMING = re.compile(r"(_s$|_ms|ms_|tok_s|ratio|seconds|per_s|stall|bandwidth|_bw|wall|elapsed|time|bound)")


def walk(before, after, path, out):
    if isinstance(before, dict) and isinstance(after, dict):
        for key in sorted(set(before) | set(after)):
            if key not in before or key not in after:
                out.append((f"{path}/{key}", "missing on one side", None))
            else:
                walk(before[key], after[key], f"{path}/{key}", out)
    elif isinstance(before, list) and isinstance(after, list) and len(before) == len(after):
        for i, (b, a) in enumerate(zip(before, after)):
            walk(b, a, f"{path}[{i}]", out)
    elif before != after:
        out.append((path, before, after))


def main(before_path, after_path):
    differ = []
    walk(json.load(open(before_path)), json.load(open(after_path)), "", differ)
    timing = [d for d in differ if TIMING.search(d[0].rsplit("/", 1)[-1])]
    other = [d for d in differ if d not in timing]
    keys = sorted({d[0].rsplit("/", 1)[-1] for d in timing})
    print(f"timing values that differ: {len(timing)} (keys: {', '.join(keys)})")
    print(f"other values that differ: {len(other)}")
    for path, b, a in other:
        print(f"  {path}: {b!r} -> {a!r}")
    return 1 if other else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
