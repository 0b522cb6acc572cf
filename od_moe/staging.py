"""Staged passes in two-tier mode: a layer pass with many lanes computes on a device copy of the experts it
routes to, so that each expert missing from the slots crosses PCIe once per pass, not once per lane.

mlx-lm's switch computes every routed lane apart: CUDA's `gather_qmm` runs one product per lane, each
reading its expert's rows. Read in place from host memory (`two_tier.py`), a miss therefore crosses PCIe
once for every lane routed to it, and a prompt of 512 tokens reads each of a layer's missing experts
dozens of times (H200, widened x128 copy, 25% of experts in slots: prefill ran at 0.08x stock,
`docs/two-tier-h100.md`). A staged pass first copies, on the device, every expert the pass routes to from
the row that holds it (a slot, or its host row read once) into an array of E rows in device memory; an
expert not routed gets a copy of a device row instead (no PCIe bytes). Every lane is then computed on
that array at its expert's id: the same kernel on the same bytes, so stock's output bit for bit, and the
union of routed experts is found on the device, so nothing waits for the host.

A decode token's lanes route to distinct experts, which staging would only copy once more; staging pays
where a layer pass has many lanes (prefill, batches): `STAGE_LANES`. The array lives until the layer's
products are computed: one layer's experts of device memory at a time, beyond the slots.
Not here: the tables and slots the rows come from (`two_tier.py`), the kernels' own reads (mlx-lm).
"""

import mlx.core as mx
import mlx.nn as nn

from .switch import switch_on

# lanes of a layer pass (positions x routed experts) from which a pass is staged: a batch of 8 at top-8,
# or a prompt of 8 tokens. Measured on an H200 (`docs/two-tier-h100.md`, "Staged passes")
STAGE_LANES = 64


def staged_switch(
    stacked: nn.Module, stack: dict, table: mx.array, indices: mx.array, device_row: int
) -> tuple[nn.Module, mx.array]:
    """(`stacked` computing on device copies of the experts `indices` route to, to be called with
    `indices` themselves; the union's counts (3,) int32: distinct experts routed, those in device rows by
    `table`, and 1 (this layer pass)). `table`: each expert's row in `stack` (E + slot on the device, else
    its host row); `device_row`: a row in device memory, copied for the experts not routed."""
    E = table.shape[0]
    used = mx.zeros((E,), mx.int32).at[indices.reshape(-1)].add(1) > 0
    rows = mx.where(used, table, mx.array(device_row, table.dtype))
    on_device = {key: mx.take(array, rows, axis=0) for key, array in stack.items()}
    counts = mx.stack([used.sum(), (used & (table >= E)).sum(), mx.array(1)]).astype(mx.int32)
    return switch_on(stacked, on_device), counts
