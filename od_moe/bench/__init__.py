"""Benchmarks run by `od-moe bench`: od-moe against stock mlx-lm on the same model in one process.

`cli.py` takes the arguments; `prefetch.py` runs the default grid (every prefetch policy side by side,
drawn by `plots.py`), `foundation.py` the cache alone, `batch_speed.py` batches, `two_tier_grid.py` the
two-tier path; the grids hold their rows against the machine's roofline (`roofline.py`). `widen.py`,
`real_shapes.py` and `real_widths.py` (written by `shards.py`) build the models they run on; `serving.py`
and `first_token.py` load a server, run by hand (their clients: `clients.py`, `client_process.py`).
Not here: the scripts a user runs to check a machine (`benchmarks/` beside the package), investigations
(`lab/`), the counts themselves (`od_moe/accounting/ledger.py`, the ledger every figure comes from).
"""
