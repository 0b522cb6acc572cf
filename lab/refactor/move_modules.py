"""Move od-moe modules and rewrite every import and dotted name that names them (issue #71's pure moves).

    python3 lab/refactor/move_modules.py OLD=NEW [OLD=NEW ...]

OLD and NEW are dotted module names (od_moe.stats=od_moe.accounting.ledger). Files are moved with `git mv`;
import statements in od_moe/, predictor/, training/, tests/, benchmarks/ and lab/ are regenerated from the
import graph (a relative import stays relative to the module's new place); dotted names in strings and
Markdown, and paths (`od_moe/stats.py`, `per_layer/runtime.py`), are rewritten as text. Run `ruff format`
after it.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {"od_moe": "od_moe", "predictor": "od_moe.predictor", "training": "od_moe.training"}
SCAN = ["od_moe", "predictor", "training", "tests", "benchmarks", "lab", "docs", ".ci"]


def package_modules() -> dict[str, tuple[Path, bool]]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join([package] + (parts[:-1] if is_package else parts))] = (path, is_package)
    return found


def module_path(name: str, is_package: bool = False) -> Path:
    for folder, package in sorted(PACKAGES.items(), key=lambda kv: -len(kv[1])):
        if name == package or name.startswith(package + "."):
            rest = name[len(package) :].lstrip(".").split(".") if name != package else []
            base = ROOT / folder / Path(*rest) if rest else ROOT / folder
            return base / "__init__.py" if is_package else base.with_suffix(".py")
    raise KeyError(name)


def renamed(name: str, moves: dict[str, str]) -> str:
    for old, new in moves.items():
        if name == old or name.startswith(old + "."):
            return new + name[len(old) :]
    return name


def relative(from_package: str, target: str) -> str:
    src, dst = from_package.split("."), target.split(".")
    common = 0
    while common < min(len(src), len(dst)) and src[common] == dst[common]:
        common += 1
    return "." * (len(src) - common + 1) + ".".join(dst[common:])


def render(node, own_old: str, own_new: str, is_package: bool, old_modules: set[str], moves) -> list[str]:
    """The import statement `node` of module `own_old` (now `own_new`), rewritten; [] if unchanged."""
    if isinstance(node, ast.Import):
        names = [renamed(a.name, moves) for a in node.names]
        if names == [a.name for a in node.names]:
            return []
        parts = [n + (f" as {a.asname}" if a.asname else "") for n, a in zip(names, node.names)]
        return [f"import {', '.join(parts)}"]
    base = node.module or ""
    if node.level:
        package = own_old.split(".") if is_package else own_old.split(".")[:-1]
        base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
    if not base.startswith("od_moe"):
        return []
    new_package = own_new if is_package else own_new.rpartition(".")[0]
    groups: dict[str, list[str]] = {}
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        if sub in old_modules:  # a submodule imported from its package
            new = renamed(sub, moves)
            parent, _, last = new.rpartition(".")
            shown = alias.asname or alias.name
            item = last if shown == last else f"{last} as {shown}"
        else:
            parent = renamed(base, moves)
            item = alias.name + (f" as {alias.asname}" if alias.asname else "")
        source = relative(new_package, parent) if node.level else parent
        groups.setdefault(source, []).append(item)
    lines = [f"from {source} import {', '.join(items)}" for source, items in groups.items()]
    old = f"from {'.' * node.level}{node.module or ''} import " + ", ".join(
        a.name + (f" as {a.asname}" if a.asname else "") for a in node.names
    )
    return [] if lines == [old] else lines


def rewrite_imports(path: Path, own_old: str, own_new: str, is_package: bool, old_modules, moves) -> str:
    source = path.read_text()
    lines = source.splitlines(keepends=True)
    edits = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import | ast.ImportFrom):
            new = render(node, own_old, own_new, is_package, old_modules, moves)
            if new:
                edits.append((node, new))
    for node, new in sorted(edits, key=lambda e: -e[0].lineno):
        first, last = node.lineno - 1, node.end_lineno - 1
        indent = re.match(r"\s*", lines[first]).group(0)
        span = "".join(lines[first : last + 1])
        comment = re.search(r"#\s*noqa[^\n]*", span)
        head = lines[first][: node.col_offset] if node.col_offset else indent
        text = [head + new[0] + (f"  {comment.group(0)}" if comment else "")]
        text += [head + line for line in new[1:]]
        tail = lines[last][node.end_col_offset :]
        lines[first : last + 1] = ["\n".join(text) + tail]
    return "".join(lines)


def text_moves(moves: dict[str, str]) -> list[tuple[re.Pattern, str]]:
    """Dotted names and file paths, longest first."""
    pairs = []
    for old, new in moves.items():
        pairs.append((rf"(?<![\w.]){re.escape(old)}\b(?!\.py)", new))
        old_file, new_file = old.replace(".", "/") + ".py", new.replace(".", "/") + ".py"
        pairs.append((rf"(?<![\w/]){re.escape(old_file)}", new_file))
        # a path inside the package, as docs and docstrings write it (`per_layer/runtime.py`, `stats.py`)
        short_old, short_new = old_file.removeprefix("od_moe/"), new_file.removeprefix("od_moe/")
        if short_old != short_new:
            pairs.append((rf"(?<![\w/.]){re.escape(short_old)}", short_new))
    pairs.sort(key=lambda p: -len(p[0]))
    return [(re.compile(p), r) for p, r in pairs]


def main(argv):
    moves = dict(arg.split("=", 1) for arg in argv)
    modules = package_modules()
    old_modules = set(modules)
    for old in moves:
        assert old in modules, old
    # imports first, at the old places
    for name, (path, is_package) in modules.items():
        path.write_text(rewrite_imports(path, name, renamed(name, moves), is_package, old_modules, moves))
    for folder in ["tests", "benchmarks", "lab"]:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if "runs" in path.relative_to(ROOT).parts or path.name == "move_modules.py":
                continue
            path.write_text(rewrite_imports(path, "__main__", "__main__", False, old_modules, moves))
    # then the files
    for old, new in moves.items():
        src, dst = modules[old][0], module_path(new, modules[old][1])
        dst.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["git", "mv", str(src), str(dst)], check=True, cwd=ROOT)
    # then dotted names and paths as text
    patterns = text_moves(moves)
    paths = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in SCAN:
        for path in sorted((ROOT / folder).rglob("*")):
            rel = path.relative_to(ROOT).parts
            if path.is_file() and path.suffix in (".py", ".md", ".sh", ".toml", "") and "runs" not in rel:
                if "models" not in rel and path.name != "move_modules.py":
                    paths.append(path)
    for path in paths:
        try:
            text = path.read_text()
        except UnicodeDecodeError:
            continue
        new = text
        for pattern, replacement in patterns:
            new = pattern.sub(replacement, new)
        if new != text:
            path.write_text(new)


if __name__ == "__main__":
    main(sys.argv[1:])
