"""The small bundled text set: Python source for training a predictor of the embedded default model.

`od-moe train-predictor` with no `--data` uses `BUNDLED_TEXT`, a gzipped JSON-lines file of
`{"path", "text"}` documents cut from CPython 3.11's standard library (PSF license). `build()` is how it
was made; run `python -m od_moe.training.bundled OUT` to rebuild it from this interpreter's stdlib.
Not here: loading or splitting (`data.py`).
"""

import gzip
import hashlib
import json
import sys
import sysconfig
from pathlib import Path

BUNDLED_TEXT = Path(__file__).parent / "data" / "python_source.jsonl.gz"

# Whole packages whose files are mostly data tables or tests, not representative source.
_SKIP_PARTS = {
    "test",
    "tests",
    "idle_test",
    "encodings",
    "pydoc_data",
    "site-packages",
    "lib2to3",
    "turtledemo",
    "__pycache__",
    "ensurepip",
    "config-3.11-x86_64-linux-gnu",
}
_MAX_FILE_BYTES = 24_000  # long modules are cut (at a line end) so that many files are represented


def _documents(stdlib: Path):
    # A fixed pseudo-random order (by path digest) so that the cut keeps modules from the whole library.
    for path in sorted(
        stdlib.rglob("*.py"), key=lambda p: hashlib.sha1(str(p.relative_to(stdlib)).encode()).digest()
    ):
        rel = path.relative_to(stdlib)
        if _SKIP_PARTS & set(rel.parts[:-1]) or rel.name.startswith("_"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text) > _MAX_FILE_BYTES:
            text = text[: text.rfind("\n", 0, _MAX_FILE_BYTES) + 1]
        if len(text) >= 2000:
            yield str(rel), text


def build(out: Path, limit_bytes: int = 1_600_000, stdlib: Path = None):
    """Write the bundled set: stdlib modules in digest order until `limit_bytes` of text."""
    stdlib = Path(stdlib or sysconfig.get_paths()["stdlib"])
    total = 0
    with gzip.open(out, "wt", encoding="utf-8", compresslevel=9) as f:
        for rel, text in _documents(stdlib):
            if total + len(text) > limit_bytes:
                break
            f.write(json.dumps({"path": rel, "text": text}) + "\n")
            total += len(text)
    return total


if __name__ == "__main__":
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else BUNDLED_TEXT
    print(f"{build(out):,} bytes of text -> {out}")
