"""The house rules (issues #37, #55 and #71): no import circle, folders
by concept in a declared layer order, each path reached through one interface, no object configured by writes
from outside, and docs that are guides.

In `od_moe/`, `predictor/` and `training/`: no circle among the package's imports (those inside functions
included: a deferred import hides a circle, it does not remove it), and no import against the layer order
between folders (`LAYERS`: a folder imports only folders below it). Only `assembly` and a path's own folder
import that path's runtime; nothing outside a path's folder probes a runtime by name. No code writes into
another object's state (`foreign_writes`: `od_moe/`, `predictor/`, `training/`, `benchmarks/`, `lab/`), but
where `WRITES_ALLOWED` says why. Every folder of `od_moe/` that holds code is a package whose `__init__.py`
opens with what the folder holds and what it does not ("Not here"). Read from the source with `ast`; nothing
is imported. No machine figures in the code (issue #55): a docstring says why, the number lives in the docs,
and the code points to the section that holds it, which exists. There are no line or word caps: a module is
split where it holds two concepts, never to meet a count.
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the package it installs as (`pyproject.toml`'s package-dir)
PACKAGES = {"od_moe": "od_moe", "predictor": "od_moe.predictor", "training": "od_moe.training"}


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, whether it is a package's __init__)."""
    found = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            found[".".join([package] + parts[:-1] if is_package else [package] + parts)] = (path, is_package)
    return found


def _imported(name: str, is_package: bool, node: ast.Import | ast.ImportFrom, modules) -> set[str]:
    """The package's modules an import statement in module `name` loads (a name imported from a module
    is that module; a submodule imported from a package is the submodule)."""
    if isinstance(node, ast.Import):
        targets = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            package = name.split(".") if is_package else name.split(".")[:-1]
            base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
        targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = set()
    for target in targets:
        while target and target not in modules:  # a name inside a module: the module
            target = target.rpartition(".")[0]
        if target and target != name:
            out.add(target)
    return out


def import_graph(modules: dict[str, tuple[Path, bool]]) -> dict[str, set[str]]:
    graph = {}
    for name, (path, is_package) in modules.items():
        nodes = ast.walk(ast.parse(path.read_text()))
        imports = [n for n in nodes if isinstance(n, ast.Import | ast.ImportFrom)]
        graph[name] = set().union(*(_imported(name, is_package, n, modules) for n in imports))
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], 0
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter = counter + 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter = counter + 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_every_folder_says_what_it_holds():
    """Each folder of `od_moe/` with modules in it is a package whose `__init__.py` opens with a docstring
    that says what the folder holds and, in a "Not here" sentence, what it does not."""
    folders = {path.parent for path in (ROOT / "od_moe").rglob("*.py")}
    assert {"per_layer", "two_tier", "distributed", "server", "bench"} <= {f.name for f in folders}
    silent = []
    for folder in sorted(folders - {ROOT / "od_moe"}):
        init = folder / "__init__.py"
        doc = ast.get_docstring(ast.parse(init.read_text())) if init.exists() else None
        if not doc or "Not here" not in doc:
            silent.append(str(folder.relative_to(ROOT)))
    assert silent == []


def test_no_import_circle():
    modules = _modules()
    assert len(modules) > 50  # the walk found the package
    graph = import_graph(modules)
    assert (
        "od_moe.per_layer.per_layer_runtime" in graph["od_moe.engine"]
        or "od_moe.per_layer.per_layer_runtime" in graph["od_moe.assembly"]
    )
    assert circles(graph) == []


def test_the_checks_can_fail():
    """The check sees what it is for: a circle of two."""
    assert circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_nothing_in_the_product_imports_the_lab():
    """`lab/` holds investigations and raw outputs: the package never imports from it."""
    offenders = []
    for name, (path, _) in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            imported = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                imported = [node.module or ""]
            offenders += [(name, m) for m in imported if m.split(".")[0] in ("lab", "tools")]
    assert offenders == []


# Machine figures: what a measurement on some machine gave. Sizes, constants, API limits and model facts
# ("2**63 - 1", "256 tokens", "x128", "8 of 128") match none of these; f-strings that print a measured
# value ("{tok_s:.1f} tok/s") neither, as no digit comes right before the unit.
MACHINE_FIGURES = [
    r"\bH[12]00s?\b",  # a named GPU: the sentence reports what ran on it
    r"\b\d[\d,]*(\.\d+)?\s*(tok/s|GB/s|MB/s)",  # a measured rate
    r"\b\d[\d,]*(\.\d+)?\s*(ms|us|µs)\b",  # a measured time
    r"\b\d+\.\d+(-\d+\.\d+)?x\b",  # a measured ratio (0.87x, 0.82-0.88x)
    r'\bthis (\d+-core )?CPU\b(?!")',  # the project's machine ("Prefetch on this CPU", a doc section, is not)
]
# (path, text on the line): figures that are not measurements, each with its reason
FIGURES_ALLOWED = {
    ("od_moe/server/app.py", "Python's default: 5 ms"): "Python's documented default switch interval",
}


def machine_figures(root: Path = ROOT) -> list[str]:
    """Every line of the package's .py files that states a machine figure, as 'path:line: text'."""
    found = []
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            name = path.relative_to(root).as_posix()
            for number, line in enumerate(path.read_text().splitlines(), 1):
                allowed = any(name == p and text in line for p, text in FIGURES_ALLOWED)
                if not allowed and any(re.search(pattern, line) for pattern in MACHINE_FIGURES):
                    found.append(f"{name}:{number}: {line.strip()}")
    return found


def test_no_machine_figures_in_the_code():
    """A docstring or comment says why; the figure a measurement gave lives in the docs (docs/GPU.md,
    docs/BENCHMARKS.md, docs/DISTRIBUTED.md), and the code names the section that holds it."""
    found = machine_figures()
    assert found == [], "machine figures in the code; move them to the docs:\n" + "\n".join(found)


def test_the_figure_patterns_catch_measurements_only(tmp_path):
    """The patterns flag figures a machine gave and pass sizes, limits, shapes and printed values."""
    measured = [
        "# (H100, widened x128 at 25%)",
        "# ran at 108-110 tok/s against 176-179",
        "# read at 1.38 -> 1.91 GB/s",
        "# about 0.4 ms of a 4-5 ms token",
        "# took 1,089 + 1,422 us",
        "# 0.82-0.88x on the CPU backend",
        "# on this 2-core CPU: 0.20-0.26x",
    ]
    legitimate = [
        "LIMIT = 2**63 - 1  # the largest seed",
        "# 256 tokens of a 4,096-token prompt; a 768 x 2048 matrix; Qwen3-30B-A3B: 8 of 128",
        "# the widened x128 copy's 2.65 MB experts, 20 KB rows, 32 MiB in flight",
        'say(f"{tok_s:.1f} tok/s, {ms:.2f} ms, {bw / 1e9:.2f} GB/s")',
        '# (docs/BENCHMARKS.md, "Prefetch on this CPU")',
    ]
    (tmp_path / "od_moe").mkdir()
    (tmp_path / "od_moe" / "m.py").write_text("\n".join(measured + legitimate) + "\n")
    found = machine_figures(tmp_path)
    assert [f.split(": ", 1)[1] for f in found] == measured


def test_the_doc_sections_the_code_cites_exist():
    """A pointer such as (docs/GPU.md, "Staged passes") names a heading of that file (its start)."""
    headings = {
        path.name: [
            line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")
        ]
        for path in (ROOT / "docs").glob("*.md")
    }
    cited = re.compile(r'docs/(\w+\.md)`?,?\s*\(?"([^"]+)"')
    missing, seen = [], 0
    for path, _ in _modules().values():
        flat = re.sub(r"\n\s*#?\s*", " ", path.read_text())  # a citation may run over comment lines
        for doc, section in cited.findall(flat):
            seen += 1
            if not any(h.startswith(section) for h in headings.get(doc, [])):
                missing.append(f"{path.relative_to(ROOT)}: {doc}, {section!r}")
    assert seen > 20  # the pattern finds the citations
    assert missing == []


# the folders whose code may look into their own runtime by name
RUNTIME_FOLDERS = ("od_moe/per_layer/", "od_moe/two_tier/")
PROBES = ("getattr", "hasattr", "setattr", "delattr")


def _names_runtime(node: ast.AST) -> bool:
    """Whether an expression names a runtime: `runtime`, `x.runtime` or anything reached through them."""
    return any(
        isinstance(n, ast.Name) and n.id == "runtime" or isinstance(n, ast.Attribute) and n.attr == "runtime"
        for n in ast.walk(node)
    )


def runtime_probes(source: str) -> list[int]:
    """The lines of `source` that call `getattr`, `hasattr`, `setattr` or `delattr` on a runtime (or ask
    any object for its attribute "runtime")."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in PROBES):
            continue
        target, name = (node.args + [None, None])[:2]
        asks_runtime = isinstance(name, ast.Constant) and name.value == "runtime"
        if target is not None and (_names_runtime(target) or asks_runtime):
            found.append(node.lineno)
    return found


def test_no_code_probes_a_runtime_from_outside():
    """Outside each runtime's own folder, code uses a runtime through the interface both give
    (`od_moe.runtime.Runtime`) and nothing else: never by probing its attributes by name (a probe hides
    which runtime it expects, and a stub would answer it), nor by `isinstance` (`path_imports`)."""
    found, seen = [], 0
    for folder in ("od_moe", "benchmarks", "tests"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            name = path.relative_to(ROOT).as_posix()
            if name.startswith(RUNTIME_FOLDERS):
                continue
            seen += 1
            found += [f"{name}:{line}" for line in runtime_probes(path.read_text())]
    assert seen > 100  # the walk found the code
    assert found == []


def test_the_probe_check_can_fail():
    source = (
        'a = getattr(engine.runtime, "lookahead", None)\n'
        'b = hasattr(runtime.policy, "sent")\n'
        "setattr(engine.runtime, name, 1)\n"
        'c = getattr(self, "runtime", None)\n'
        'd = getattr(engine.model, "args", None)\n'
        "e = isinstance(engine.runtime, object) and engine.runtime.caches\n"
    )
    assert runtime_probes(source) == [1, 2, 3, 4]


# The layer order between the package's folders and root modules, lowest first: a unit imports only units of
# a lower layer (never one beside it or above). `predictor` and `training` are od_moe.predictor and
# od_moe.training; `od_moe` is the package's own `__init__` (the public API).
LAYERS = [
    {"errors", "units"},
    {"progress"},
    {"model_surgery"},  # what od-moe reads from and does to an mlx-lm model
    {"memory"},  # the backend, the device and what a budget buys
    {"storage"},  # where the bytes are
    {"caching", "accounting"},  # which expert sits in which slot; the ledger
    {"predictor"},  # the shadow network
    {"prefetch"},  # what to read ahead, and how much
    {"runtime"},  # the interface every path gives
    {"per_layer", "two_tier"},  # the paths: neither imports the other
    {"distributed", "generation"},
    {"assembly"},  # the only unit above the paths that imports their runtimes
    {"engine"},
    {"od_moe"},
    {"training"},
    {"preflight"},  # what a load would do, before any weight is read
    {"server"},
    {"bench"},
    {"arguments"},
    {"cli"},
    {"__main__"},
]


def unit_of(module: str) -> str:
    """The folder or root module a dotted module belongs to (`od_moe.per_layer.loader` -> "per_layer")."""
    parts = module.split(".")
    if module == "od_moe.preflight" or module == "od_moe.preflight":
        return "preflight"  # what a load would do: above the engine, whatever folder holds it
    return parts[1] if len(parts) > 1 else parts[0]


def layer_breaches(graph: dict[str, set[str]], layers=None) -> list[str]:
    """Every import from one unit into another of the same or a higher layer, as 'module -> module'."""
    rank = {unit: i for i, group in enumerate(layers or LAYERS) for unit in group}
    found = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            a, b = unit_of(module), unit_of(target)
            if a != b and rank[b] >= rank[a]:
                found.append(f"{module} -> {target}")
    return found


def test_folders_import_in_their_layer_order():
    graph = import_graph(_modules())
    units = {unit_of(m) for m in graph}
    assert units == set().union(*LAYERS)  # every folder and root module has its layer, and no other is named
    assert layer_breaches(graph) == []


def test_the_layer_check_can_fail():
    graph = {"od_moe.per_layer.a": {"od_moe.two_tier.b"}, "od_moe.engine": {"od_moe.per_layer.a"}}
    assert layer_breaches(graph) == ["od_moe.per_layer.a -> od_moe.two_tier.b"]
    assert layer_breaches({"od_moe.storage.x": {"od_moe.engine"}}) == ["od_moe.storage.x -> od_moe.engine"]


# each path's runtime, and the package that builds it (`build`): what only `assembly` and the path's own
# folder import
PATH_RUNTIMES = {
    "od_moe.per_layer.per_layer_runtime": "per_layer",
    "od_moe.per_layer": "per_layer",
    "od_moe.two_tier.two_tier_runtime": "two_tier",
    "od_moe.two_tier": "two_tier",
}


def path_imports(graph: dict[str, set[str]]) -> list[str]:
    """Imports of a path's runtime (or its package) from outside that path's folder and `assembly`."""
    return [
        f"{module} -> {target}"
        for module, imported in sorted(graph.items())
        for target in sorted(imported & set(PATH_RUNTIMES))
        if unit_of(module) not in (PATH_RUNTIMES[target], "assembly")
    ]


def test_only_assembly_and_its_own_folder_import_a_path():
    """The engine, server, bench, drafts and distributed code hold a `Runtime` and never ask which: they do
    not import either path's runtime, so they cannot `isinstance` it either."""
    graph = import_graph(_modules())
    assert "od_moe.per_layer" in graph["od_moe.assembly"] and "od_moe.two_tier" in graph["od_moe.assembly"]
    assert path_imports(graph) == []
    assert path_imports({"od_moe.engine": {"od_moe.two_tier.two_tier_runtime"}}) == [
        "od_moe.engine -> od_moe.two_tier.two_tier_runtime"
    ]


# Methods that change the list, dict or set they are called on.
MUTATORS = {"append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add"}
MUTATORS |= {"discard", "sort", "reverse"}
WRITE_FOLDERS = ("od_moe", "predictor", "training", "benchmarks", "lab")
# (path, the target as `ast.unparse` writes it): writes into another object that stay, each with its reason
WRITES_ALLOWED: dict[tuple[str, str], str] = {
    # lab scripts import helpers from benchmarks/ or tests/: Python leaves sys.path to the program that runs
    ("lab/drafts/cpu_equality.py", "sys.path.insert"): "imports benchmarks/code_edits.py",
    ("lab/drafts/lookup_ceiling.py", "sys.path.insert"): "imports benchmarks/code_edits.py",
    ("lab/tools/pipeline_families.py", "sys.path.insert"): "imports tests/tiny_models.py on each rank",
    ("lab/drafts/held_out_loss.py", "layer.mlp.gate"): "surgery: an mlx-lm router wrapped to record logits",
    ("lab/drafts/train_draft.py", "optimizer.learning_rate"): "MLX's own setter: the rate follows the clock",
    ("lab/tools/nvrtc_check.py", "nvrtc.nvrtcGetErrorString.restype"): "ctypes: a C return type",
    ("od_moe/distributed/rank_split.py", "cache.keys"): "mlx-lm's KV cache tied to a send: it has no method",
    ("od_moe/memory/backend.py", "os.environ[CUDNN_ATTENTION]"): "MLX takes the setting from the environment",
    # ctypes is told a C function's signature by setting it on the function
    ("od_moe/memory/cuda.py", "runtime.cudaDeviceSynchronize.argtypes"): "ctypes: a C signature",
    ("od_moe/memory/cuda.py", "runtime.cudaHostRegister.argtypes"): "ctypes: a C signature",
    ("od_moe/memory/cuda.py", "runtime.cudaHostUnregister.argtypes"): "ctypes: a C signature",
    ("od_moe/memory/cuda.py", "runtime.cudaMemAdvise.argtypes"): "ctypes: a C signature",
    ("od_moe/memory/cuda.py", "runtime.cudaMemPrefetchAsync.argtypes"): "ctypes: a C signature",
    ("od_moe/memory/cuda.py", "runtime.cudaMemcpyAsync.argtypes"): "ctypes: a C signature",
    ("od_moe/memory/cuda.py", "runtime.cudaStreamSynchronize.argtypes"): "ctypes: a C signature",
    # model surgery: swapping an mlx-lm model's modules for od-moe's is what surgery is
    ("od_moe/model_surgery/moe_blocks.py", "holder.self.attr"): "surgery: mlx-lm's switch swapped",
    ("od_moe/model_surgery/moe_blocks.py", "self.owner.self.owner_attr"): "surgery: an mlx-lm block swapped",
    ("od_moe/model_surgery/routing.py", "block.name"): "surgery: an mlx-lm router wrapped in a tap",
    ("od_moe/model_surgery/switch_over.py", "module.__class__"): "a copy it made a line before, subclassed",
    ("od_moe/storage/store.py", "self._bounce.buffer"): "its own threading.local, set by attribute (its API)",
    ("training/record.py", "parent.attr"): "surgery: taps before the MoE switches, taken off after",
    ("od_moe/two_tier/two_tier_runtime.py", "block.switch[part.proj][part.name]"): (
        "surgery: mlx-lm's expert arrays given back empty; the slots are the stacks' rows"
    ),
    # Flask: `g` is its per-request namespace, and an after_request hook is handed the response to finish
    ("od_moe/server/app.py", "g.arrival"): "Flask's per-request namespace",
    ("od_moe/server/guard.py", "g.cors_origin"): "Flask's per-request namespace",
    (
        "od_moe/server/guard.py",
        "response.headers['Access-Control-Allow-Headers']",
    ): "Flask's after_request hook",
    (
        "od_moe/server/guard.py",
        "response.headers['Access-Control-Allow-Methods']",
    ): "Flask's after_request hook",
    (
        "od_moe/server/guard.py",
        "response.headers['Access-Control-Allow-Origin']",
    ): "Flask's after_request hook",
    ("od_moe/server/guard.py", "response.headers['Vary']"): "Flask's after_request hook",
    # lab probes that time or count what mlx-lm's loop does: they wrap its calls, in their own process only
    ("lab/tools/ab_host_time.py", "engine.forward"): "probe: the engine's forward wrapped to time it",
    ("lab/tools/forward_host_cpu.py", "engine.forward"): "probe: the engine's forward wrapped to time it",
    ("lab/tools/host_time.py", "engine.forward"): "probe: the engine's forward wrapped to time it",
    ("lab/tools/ab_host_time.py", "sys.modules['mlx_lm.generate'].mx"): "probe: mlx-lm's async_eval counted",
    ("lab/tools/host_time.py", "sys.modules['mlx_lm.generate'].mx"): "probe: mlx-lm's async_eval timed",
    (
        "lab/tools/op_count.py",
        "sys.modules['mlx_lm.generate'].mx",
    ): "probe: the graph mlx-lm evaluates counted",
    ("lab/tools/ab_host_time.py", "switch._ROWS_GIVEN.clear"): "A/B in one process: traced constants off",
    ("lab/tools/ab_host_time.py", "switch._ROWS_GIVEN.update"): "A/B in one process: traced constants on",
    ("lab/tools/kept_rows_check.py", "sys.path.insert"): "imports tests/cuda_emulation.py",
    ("lab/tools/precompiled_probe.py", "nvrtc.nvrtcGetErrorString.restype"): "ctypes: a C return type",
}


def _own(node: ast.AST) -> bool:
    """Whether an expression is the code's own to change: a local name, `self.x` (or `cls.x`), or an item
    or a method's result reached from them (`self.rows[i]`, `buffer.setdefault(k, [])`)."""
    if isinstance(node, ast.Name):
        return True
    if isinstance(node, ast.Attribute):
        return isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
    if isinstance(node, ast.Subscript | ast.Starred):
        return _own(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        return _own(node.func.value)
    return False


def _functional(node: ast.AST) -> bool:
    """MLX's functional update, `x.at[ids].add(y)`: it returns a new array and changes nothing."""
    return (
        isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "at"
    )


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign | ast.Delete):
        found = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        found = [node.target]
    else:
        return []
    flat = []
    while found:
        target = found.pop()
        found.extend(target.elts) if isinstance(target, ast.Tuple | ast.List) else flat.append(target)
    return flat


def foreign_writes(source: str) -> list[tuple[int, str]]:
    """(line, target) of every write into another object's state: an assignment, `del` or augmented
    assignment to `x.attr` (but `self.attr`) or to an item of something not the code's own (`_own`),
    `setattr`/`delattr`/`object.__setattr__` on anything but `self`, and a mutating method (`MUTATORS`)
    called on a list, dict or set not the code's own (`other.items.append(...)`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        for target in _targets(node):
            if isinstance(target, ast.Attribute) and not _own(target):
                found.append((node.lineno, ast.unparse(target)))
            elif isinstance(target, ast.Subscript) and not _own(target.value):
                found.append((node.lineno, ast.unparse(target)))
        if not isinstance(node, ast.Call):
            continue
        func, first = node.func, node.args[0] if node.args else None
        on_other = first is not None and not (isinstance(first, ast.Name) and first.id in ("self", "cls"))
        named = isinstance(func, ast.Name) and func.id in ("setattr", "delattr")
        dunder = isinstance(func, ast.Attribute) and func.attr == "__setattr__"
        if (named or dunder) and on_other:
            found.append((node.lineno, ast.unparse(first) + "." + ast.unparse(node.args[1])))
        elif isinstance(func, ast.Attribute) and func.attr in MUTATORS and not _own(func.value):
            if not _functional(func.value):
                found.append((node.lineno, ast.unparse(func)))
    return found


def all_foreign_writes(root: Path = ROOT) -> dict[tuple[str, str], list[int]]:
    """(path, target) -> lines, over the package, `benchmarks/` and `lab/` (its raw runs left out)."""
    found: dict[tuple[str, str], list[int]] = {}
    for folder in WRITE_FOLDERS:
        for path in sorted((root / folder).rglob("*.py")):
            name = path.relative_to(root).as_posix()
            if name.startswith("lab/runs/"):
                continue
            for line, target in foreign_writes(path.read_text()):
                found.setdefault((name, target), []).append(line)
    return found


def test_nothing_writes_into_another_objects_state():
    """Objects are configured by what their constructors take (a path's settings, the worker's) and changed
    by their own methods: no code writes into another object's attributes, lists, dicts or counters, but
    where `WRITES_ALLOWED` says why (model surgery on mlx-lm's modules, ctypes' signatures, ...)."""
    found = all_foreign_writes()
    assert len({path for path, _ in found} | {path for path, _ in WRITES_ALLOWED}) > 10  # the walk found code
    unexplained = sorted(
        f"{path}:{lines[0]}: {target}"
        for (path, target), lines in found.items()
        if (path, target) not in WRITES_ALLOWED
    )
    assert unexplained == []
    assert sorted(set(WRITES_ALLOWED) - set(found)) == []  # an entry for a write that is gone goes too


def test_the_write_check_can_fail():
    source = (
        "engine.runtime.optimistic = True\n"
        "self.loader.governor = None\n"
        "setattr(runtime, 'taps', [])\n"
        "worker.counts['done'] += 1\n"
        "other.items.append(1)\n"
        "self.rows[0] = 1\n"
        "self.ready = True\n"
        "local = {}\n"
        "local['a'] = 1\n"
        "buffer.setdefault(key, []).append(value)\n"
        "counts = counts.at[ids].add(1)\n"
    )
    assert sorted(line for line, _ in foreign_writes(source)) == [1, 2, 3, 4, 5]
