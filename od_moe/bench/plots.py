"""`od-moe bench --plot PATH`: the prefetch grid's rows drawn, and written beside them as JSON.

One row of panels per (model, read temperature, miss policy) of the grid, each with one line per prefetch
policy against capacity: decode hit rate, decode tok/s (stock mlx-lm fully resident as a dashed line)
and kB read per decoded token (Belady's MIN for the same routing as a dashed line). PNG or SVG, from the
file name. matplotlib is a benchmark extra (`pip install 'od-moe[bench]'`), imported only here and only
when asked for. Not here: running the grid (`prefetch.py`).
"""

import json
from pathlib import Path

from ..errors import UserError
from ..units import KB

FORMATS = (".png", ".svg")
PANELS = (
    ("hit_rate", "decode hit rate"),
    ("tok_s", "decode tok/s"),
    ("kb_per_token", "kB read per token"),
)


def require_matplotlib():
    """The pyplot module (on a file-only backend), or a one-line UserError saying how to get it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UserError("--plot needs matplotlib: pip install 'od-moe[bench]' (or pip install matplotlib)")
    return plt


def check_path(path) -> Path:
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise UserError(f"--plot writes {' or '.join(FORMATS)} files, not {path.name!r}")
    return path


def series(rows: list[dict]) -> dict:
    """{(model, reads, miss policy): {"lines": {panel: {policy: [(capacity, value), ...]}}, "stock": tok/s,
    "min": [(capacity, kB)]}} from the grid's rows, capacities in increasing order."""
    groups: dict[tuple[str, str, str], dict[str, dict]] = {}
    stock: dict[str, float] = {}
    for r in rows:
        if r.get("policy") == "stock mlx-lm":
            stock[r["model"]] = r["tok_s"]
            continue
        if "decode_hits" not in r:
            continue
        group = groups.setdefault(
            (r["model"], r["reads"], r["miss_policy"]), {"lines": {k: {} for k, _ in PANELS}, "min": {}}
        )
        values = {
            "hit_rate": r["hit_rate"],
            "tok_s": r["tok_s"],
            "kb_per_token": r["bytes_per_token"] / KB,
        }
        for panel, value in values.items():
            if value is not None:
                group["lines"][panel].setdefault(r["policy"], []).append((r["capacity"], value))
        if r["experts_read_per_token"]:  # MIN's experts in bytes: the bytes of one expert read
            expert_kb = r["bytes_per_token"] / KB / r["experts_read_per_token"]
            group["min"].setdefault(r["capacity"], r["min_experts_read_per_token"] * expert_kb)
    out = {}
    for key, group in groups.items():
        lines = {k: {p: sorted(v) for p, v in by_policy.items()} for k, by_policy in group["lines"].items()}
        out[key] = {"lines": lines, "stock": stock.get(key[0]), "min": sorted(group["min"].items())}
    return out


def plot_rows(rows: list[dict], path, title: str = "od-moe bench") -> dict:
    """Draw the grid's rows into `path` (.png or .svg) and write them to `path` with a .json suffix;
    returns what was drawn (`series`)."""
    path = check_path(path)
    plt = require_matplotlib()
    drawn = series(rows)
    if not drawn:
        raise UserError("the bench produced no rows to plot")
    fig, axes = plt.subplots(
        len(drawn), len(PANELS), figsize=(4.2 * len(PANELS), 3.2 * len(drawn)), squeeze=False
    )
    for (model, reads, miss), group, row in zip(drawn, drawn.values(), axes):
        for (key, label), ax in zip(PANELS, row):
            for policy, points in group["lines"][key].items():
                xs, ys = zip(*points)
                ax.plot(xs, ys, marker="o", label=policy)
            if key == "tok_s" and group["stock"]:
                ax.axhline(group["stock"], color="black", linestyle="--", linewidth=1, label="resident")
            if key == "kb_per_token" and group["min"]:
                xs, ys = zip(*group["min"])
                ax.plot(xs, ys, color="black", linestyle="--", linewidth=1, label="Belady MIN")
            if key == "hit_rate":
                ax.set_ylim(0, 1.02)
            else:
                ax.set_ylim(bottom=0)
            ax.set_xscale("log", base=2)
            capacities = sorted({x for points in group["lines"][key].values() for x, _ in points})
            ax.set_xticks(capacities, [f"{c:.1%}".replace(".0%", "%") for c in capacities])
            ax.minorticks_off()
            ax.set_xlabel("experts resident (capacity)")
            ax.set_title(f"{model}, {reads} reads, {miss}: {label}", fontsize=9)
            ax.grid(alpha=0.3)
        for ax in row:  # the policies once, the dashed references where they are drawn
            handles = [
                h for h in ax.get_legend_handles_labels()[0] if ax is row[0] or h.get_linestyle() == "--"
            ]
            if handles:
                ax.legend(handles=handles, fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    path.with_suffix(".json").write_text(json.dumps({"rows": rows}, indent=1))
    return drawn
