"""Plain-text tables for people: cache statistics after a generation, benchmark results."""

from collections.abc import Sequence

from ..units import MB, format_bytes


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


def mb(n: int) -> float:
    return n / MB


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
            mb(d["bytes_read"]),
            d["stall_s"] * 1e3,
        ]

    rows = [row(layer["layer"], layer) for layer in stats["layers"]] + [row("all", stats["total"])]
    head = (
        f"capacity {stats['capacity']}/{stats['num_experts']} experts per layer "
        f"({stats['capacity_fraction']:.1%}), miss policy {stats['miss_policy']}, "
        f"eviction {stats['eviction']}; {passes_line(stats)}"
    )
    out = [
        head,
        table(["layer", "lookups", "hits", "misses", "hit rate", "decode hit", "MB read", "stall ms"], rows),
    ]
    out.append(decode_line(stats))
    out.append(prefetch_line(stats["prefetch"]))
    if (pause := pause_line(stats["prefetch"])) is not None:
        out.append(pause)
    out.append(memory_line(stats["memory"]))
    out.append(tiers_line(stats["tiers"]))
    if stats.get("packed_experts"):
        out.append(f"experts read from the packed copy {stats['packed_experts']}")
    if stats.get("direct_io_refused"):
        out.append(stats["direct_io_refused"])
    if response is not None:
        out.append(
            f"prompt {response.prompt_tokens} tokens at {response.prompt_tps:.1f} tok/s, "
            f"generation {response.generation_tokens} tokens at {response.generation_tps:.1f} tok/s"
        )
    return "\n".join(out)


def tiers_line(tiers: dict) -> str:
    """Where routed lanes found their experts, by tier, and what the disk did."""
    held, lanes, disk = tiers["experts_per_layer"], tiers["lanes"], tiers["disk"]
    total = sum(lanes.values()) or 1
    line = (
        f"tiers: experts a layer device {held['device']} / host {held['host']} / disk {held['disk']}; lanes "
        + ", ".join(f"{k} {v} ({v / total:.1%})" for k, v in lanes.items())
    )
    if disk["experts_read"]:
        line += (
            f"; disk: {disk['experts_read']} experts, {mb(disk['bytes_read']):.1f} MB read in "
            f"{disk['read_s']:.2f} s, waited {disk['wait_s'] * 1e3:.1f} ms"
        )
    if tiers.get("host_eviction"):
        line += f"; host tier evicts by {tiers['host_eviction']}"
    if disk["reruns"]:
        line += (
            f", {disk['reruns']} passes run again, read ahead {disk['prefetch_reads']} (useful "
            f"{disk['prefetch_useful']}, wasted {disk['prefetch_wasted']}, late {disk['prefetch_late']})"
        )
    return line


def prefetch_line(p: dict) -> str:
    """One line on prefetch: the policy, reads issued, used before eviction (precision), late, wasted."""
    if p.get("policy", "none") == "none" and not p.get("issued"):
        return "prefetch off (--prefetch none)"
    precision = "-" if p.get("precision") is None else f"{p['precision']:.3f}"
    return (
        f"prefetch {p.get('policy')}: {p.get('issued', 0)} experts read ahead "
        f"({mb(p.get('bytes_read', 0)):.1f} MB), {p.get('useful', 0)} used before eviction "
        f"(precision {precision}), {p.get('late', 0)} late, {p.get('wasted', 0)} wasted, "
        f"{backoffs_text(p.get('backoffs', 0), p.get('backoff_reason'))}"
    )


def memory_line(mem: dict) -> str:
    """Memory as the driver and the OS count it, device and host apart, then MLX's own peak (which counts
    the host memory a GPU reads in place as its own: two-tier mode's mapped experts)."""
    parts = []
    if mem.get("device_bytes") is not None:
        parts.append(
            f"device {format_bytes(mem['device_bytes'])} (the card's use since load, as the driver counts it)"
        )
    if mem.get("host_bytes") is not None:
        parts.append(f"host {format_bytes(mem['host_bytes'])} resident")
    parts.append(f"host peak {format_bytes(mem['host_peak_bytes'])}")
    return (
        f"memory: {', '.join(parts)}; MLX's peak {format_bytes(mem['peak_bytes'])} (its arrays, mapped host "
        f"memory included: expert cache {format_bytes(mem['expert_cache_bytes'])}, non-expert weights "
        f"{format_bytes(mem['non_expert_bytes'])})"
    )


def pause_line(p: dict) -> str | None:
    """One line when the governor paused prefetch for what it gains or costs: when, why, and when it
    would pay (None where it never did)."""
    pause = p.get("pause")
    if not pause:
        return None
    state = "and stayed paused" if pause["still"] else "and resumed later"
    if pause["kind"] == "gain":
        return (
            f"prefetch paused at decode token {pause['at_token']} {state}: its reads saved "
            f"{pause['hidden_ms']:.2f} ms of demand reads a token and cost {pause['cost_ms']:.2f} ms of a "
            f"{pause['token_ms']:.1f} ms token, as where experts come from the page cache; it pays where "
            f"demand reads are slow (a model larger than memory, read from disk), and resumes by itself "
            f"once they stall a token {pause['resume_stall_ms']:.2f} ms or more"
        )
    return (
        f"prefetch paused at decode token {pause['at_token']} {state} for {pause['tokens']} tokens: tokens "
        f"took {pause['on_ms']:.1f} ms with it and {pause['off_ms']:.1f} ms without; it pays where demand "
        f"reads are slow (a model larger than memory, read from disk), and is tried again after the pause"
    )


def passes_line(stats: dict) -> str:
    """What the model ran, apart from what the caller got: mlx-lm prefills the prompt but its last token,
    which the first decode pass takes, and computes one token ahead of the one it yields, so N generated
    tokens take N + 1 decode passes, and that pass's reads are real."""
    return (
        f"model ran {stats['positions']['prefill']} prefill positions (the prompt but its last token, "
        f"which the first decode pass takes) and {stats['passes']['decode']} decode passes for "
        f"{stats['generated_tokens']} generated tokens"
    )


def decode_line(stats: dict) -> str:
    """Experts the decode passes moved per generated token (`stats.experts_moved`), and with a draft model
    the drafts its verify passes verified and accepted."""
    per_token = stats.get("experts_per_token")
    line = (
        f"decode: {'-' if per_token is None else f'{per_token:.2f}'} experts {stats.get('moved_as', 'read')} "
        "per generated token"
    )
    d = stats.get("drafts") or {}
    if d.get("verify_passes"):
        rate = "-" if d["acceptance_rate"] is None else f"{d['acceptance_rate']:.3f}"
        line += (
            f"; drafts: {d['accepted']} of {d['drafted']} accepted (acceptance rate {rate}) in "
            f"{d['verify_passes']} verify passes, each a decode pass over its last token and its drafts"
        )
        found = d.get("found_in") or {}
        if any(f["drafted"] for f in found.values()):
            line += "; found in " + ", in ".join(
                f"the {'answer' if s == 'output' else s} {f['accepted']} of {f['drafted']}"
                for s, f in found.items()
            )
    return line


def backoffs_text(n: int, reason: str | None) -> str:
    """The governor's back-offs: the times it cut the experts read ahead or paused prefetch."""
    if not n:
        return "no back-offs (the governor never cut or paused prefetch)"
    plural = "back-off" if n == 1 else "back-offs"
    return f"{n} {plural} (the governor cut or paused prefetch; last: {reason})"
