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

    def row(label, d):
        return [
            label,
            d["lookups"],
            d["hits"],
            d["misses"],
            d["hit_rate"],
            d["decode"]["hit_rate"],
            mib(d["bytes_read"]),
            d["stall_s"] * 1e3,
        ]

    rows = [row(layer["layer"], layer) for layer in stats["layers"]] + [row("all", stats["total"])]
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
    out.append(prefetch_line(stats["prefetch"]))
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


def prefetch_line(p: dict) -> str:
    """One line on prefetch: the policy, reads issued, used before eviction (precision), late, wasted."""
    if p.get("policy", "none") == "none" and not p.get("issued"):
        return "prefetch off (--prefetch none)"
    precision = "-" if p.get("precision") is None else f"{p['precision']:.3f}"
    return (
        f"prefetch {p.get('policy')}: {p.get('issued', 0)} experts read ahead "
        f"({mib(p.get('bytes_read', 0)):.1f} MiB), {p.get('useful', 0)} used before eviction "
        f"(precision {precision}), {p.get('late', 0)} late, {p.get('wasted', 0)} wasted, "
        f"{p.get('backoffs', 0)} back-offs"
    )
