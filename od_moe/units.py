"""Byte counts as people read them, one convention everywhere od-moe prints a size: decimal units (kB, MB,
GB: powers of 1000), as mlx-lm prints memory and as disks and bandwidths (GB/s) are quoted. Sizes given
to od-moe may still be written either way (`--memory-budget 8GB` or `512MiB`: `capacity.parse_size`).
The live page's script formats its figures with the same units (`server/static/dashboard.js`)."""

KB, MB, GB = 10**3, 10**6, 10**9


def format_bytes(n: float) -> str:
    """`n` bytes in the largest unit it reaches: '2.65 MB', '512 B'."""
    for unit, scale in (("GB", GB), ("MB", MB), ("kB", KB)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"
