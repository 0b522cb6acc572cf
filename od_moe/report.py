"""Plain-text tables for people: cache statistics after a generation, benchmark results."""

from collections.abc import Sequence


def table(headers: Sequence[str], rows: list[Sequence], title: str | None = None) -> str:
    """A left-aligned first column, right-aligned others, in a markdown-compatible pipe table."""
    cells = [[_fmt(v) for v in row] for row in rows]
    widths = [
        max(len(str(h)), *(len(r[i]) for r in cells)) if cells else len(str(h)) for i, h in enumerate(headers)
    ]

    def line(values):
        out = [str(values[0]).ljust(widths[0])] + [str(v).rjust(w) for v, w in zip(values[1:], widths[1:])]
        return "| " + " | ".join(out) + " |"

    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    text = [line(headers), sep] + [line(r) for r in cells]
    return "\n".join(([title] if title else []) + text)


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def mib(n: int) -> float:
    return n / 2**20


def format_stats(stats: dict, response=None) -> str:
    """The short table `od-moe generate --stats` prints."""
    rows = []
    for layer in stats["layers"]:
        rows.append(
            [
                layer["layer"],
                layer["lookups"],
                layer["hits"],
                layer["misses"],
                layer["hit_rate"],
                layer["decode"]["hit_rate"],
                mib(layer["bytes_read"]),
                layer["stall_s"] * 1e3,
            ]
        )
    t = stats["total"]
    rows.append(
        [
            "all",
            t["lookups"],
            t["hits"],
            t["misses"],
            t["hit_rate"],
            t["decode"]["hit_rate"],
            mib(t["bytes_read"]),
            t["stall_s"] * 1e3,
        ]
    )
    head = (
        f"capacity {stats['capacity']}/{stats['num_experts']} experts per layer "
        f"({stats['capacity_fraction']:.1%}), miss policy {stats['miss_policy']}, "
        f"eviction {stats['eviction']}, tokens prefill {stats['tokens']['prefill']} decode "
        f"{stats['tokens']['decode']}"
    )
    out = [
        head,
        table(["layer", "lookups", "hits", "misses", "hit rate", "decode hit", "MiB read", "stall ms"], rows),
    ]
    mem = stats["memory"]
    out.append(
        f"peak memory {mib(mem['peak_bytes']):.1f} MiB (expert cache {mib(mem['expert_cache_bytes']):.1f} "
        "MiB, "
        f"non-expert weights {mib(mem['non_expert_bytes']):.1f} MiB)"
    )
    if response is not None:
        out.append(
            f"prompt {response.prompt_tokens} tokens at {response.prompt_tps:.1f} tok/s, "
            f"generation {response.generation_tokens} tokens at {response.generation_tps:.1f} tok/s"
        )
    return "\n".join(out)
