"""Split the lines ruff finds too long (E501) in comments and docstrings at the last space that fits, the
rest carried to a line of its own with the same indent (and `# ` in a comment). After a move lengthened a
path. It does not tell a docstring from a string literal: a long string in code comes out broken, so check
ruff's parse afterwards and join such lines by hand.

    python3 lab/refactor/wrap_long_lines.py
"""

import re
import subprocess

LIMIT = 110
out = subprocess.run(
    ["ruff", "check", ".", "--output-format", "concise"], capture_output=True, text=True
).stdout
hits: dict[str, list[int]] = {}
for line in out.splitlines():
    if m := re.match(r"(\S+):(\d+):\d+: E501", line):
        hits.setdefault(m[1], []).append(int(m[2]))
for name, numbers in hits.items():
    lines = open(name).read().split("\n")
    for number in sorted(numbers, reverse=True):
        line = lines[number - 1]
        indent = re.match(r"\s*", line).group(0)
        prefix = indent + "# " if line[len(indent) :].startswith("# ") else indent
        parts, rest = [], line
        while len(rest) > LIMIT:
            cut = rest.rfind(" ", len(prefix) + 1, LIMIT + 1)
            if cut <= len(prefix):
                break
            parts.append(rest[:cut])
            rest = prefix + rest[cut + 1 :]
        lines[number - 1 : number] = parts + [rest]
    open(name, "w").write("\n".join(lines))
