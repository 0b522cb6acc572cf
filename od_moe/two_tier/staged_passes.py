"""Staged passes in two-tier mode: a layer pass of several positions computes on a device copy of the experts
it routes to, so that each expert missing from the slots crosses PCIe once per pass, not once per lane.

mlx-lm's switch computes every routed lane apart: CUDA's `gather_qmm` runs one product per lane, each reading
its expert's rows. Read in place from host memory (`two_tier_runtime.py`), a miss therefore crosses PCIe once
for every lane routed to it, and a prompt of 512 tokens reads each of a layer's missing experts dozens of
times, so prefill ran at a small fraction of stock's speed (`docs/GPU.md`, "Staged passes"). A staged pass
first copies, on the device, every expert the pass routes to from the row that holds it (a slot, or its host
row read once) into a device array of min(E, lanes) rows, in expert order (`union`), and computes every lane
on that array at its expert's place: the same kernel on the same bytes, so stock's output bit for bit. The
union and the places are found on the device, so nothing waits for the host. Rows of the copy no expert needs
(fewer routed than rows) copy a device row: no PCIe bytes. Staging pays where a pass has several positions
(prefill, batches: `STAGE_POSITIONS`), and for a decode pass too where no expert is in a device row and
experts are large (`positions_to_stage`); a pass of one position copies lane i's expert into row i
(`one_position`: its lanes route to distinct experts). Both are a pass's lanes (`layer_step.Lanes`: the copy,
each lane's place in it). The copy lives until the layer's products are computed: min(E, lanes) experts of
device memory at a time, beyond the slots. Not here: the tables and slots the rows come from
(`two_tier_runtime.py`), the copies' CUDA kernels (`kernels.py`), the products' own reads (mlx-lm).
"""

import mlx.core as mx

from . import kernels, slot_fill
from .kernels import copy_rows

BLOCKS = 32  # per (row, array) of the copy: the layer waits for it, so it may take the whole device

# positions of a layer pass from which it is staged: a decode token's lanes route to distinct experts, which
# staging would only copy once more, so batch 1 decodes slower staged; from two positions lanes share
# experts and staging wins, more so the larger the batch (`docs/GPU.md`, "Staged passes")
STAGE_POSITIONS = 2

# Decode passes are staged too where a layer keeps no expert in device rows and its experts are this large:
# every lane then misses, and the staging copy crosses PCIe at about twice the rate of the kernel's reads in
# place. Large experts (the widened copy's 2.65 MB) decode faster staged; small ones (the bundled model's
# 20 KB) slower, the copy costing more than it saves, so they are not staged (`docs/GPU.md`, "Staged
# passes").
STAGE_DECODE_NBYTES = 1 << 20


def positions_to_stage(expert_nbytes: int, device_rows: int) -> int:
    """From how many positions a layer pass is staged: one (every pass) where the layer keeps no expert in
    `device_rows` (slots, or rows the device keeps) and its experts are large, else `STAGE_POSITIONS`."""
    return 1 if device_rows == 0 and expert_nbytes >= STAGE_DECODE_NBYTES else STAGE_POSITIONS


def several(by_kernel: bool, hits: bool, indices: mx.array, table: mx.array, *arrays):
    """The lanes of a staged pass of several positions (`layer_step.Lanes`, op by op): `union`'s copy of the
    experts they route to, each lane reading its expert's place in it; the other outputs: the pass's counts
    ("staged") and, with `hits`, which lanes' experts were in device rows ("hit")."""
    copies, places, outputs = union(indices, table, *arrays, by_kernel=by_kernel)
    return copies, places, {**outputs, "hit": table[indices] >= table.shape[0]} if hits else outputs


def union(indices: mx.array, table: mx.array, *arrays, by_kernel: bool | None = None):
    """(device copies of `arrays`' rows of the experts `indices` route to, min(E, lanes) rows in expert
    order; each lane's place in them, shaped as `indices`; {"staged": the pass's counts (4,) int32: distinct
    experts routed, those in device rows by `table`, 1 (this layer pass), and lanes whose expert is in no
    device row}). `table`: each expert's row in the stack (E + slot on the device, else its host row); rows
    of the copy no expert needs copy row E, a device row. On CUDA the copy is one kernel of 16-byte loads
    (`by_kernel`, None: where it runs), elsewhere `mx.take`."""
    E, flat = table.shape[0], indices.reshape(-1)
    by_kernel = slot_fill.available() if by_kernel is None else by_kernel
    rows = min(E, flat.size)
    used = mx.zeros((E,), mx.int32).at[flat].add(1) > 0
    distinct = used.sum()
    place = mx.cumsum(used.astype(mx.int32)) - 1  # each routed expert's row in the copy
    sources = mx.full((rows + 1,), E, mx.int32)  # the last row takes what is not routed, then goes
    sources = sources.at[mx.where(used, place, rows)].add(mx.where(used, table.astype(mx.int32) - E, 0))
    copies = take_rows(list(arrays), sources[:rows], distinct, by_kernel)
    held = table >= E
    counts = mx.stack([distinct, (used & held).sum(), mx.array(1), flat.size - held[flat].sum()])
    return copies, place[indices].astype(indices.dtype), {"staged": counts.astype(mx.int32)}


def one_position(by_kernel: bool, hits: bool, indices: mx.array, table: mx.array, *arrays):
    """The lanes of a staged pass of one position (`layer_step.Lanes`, traced): its lanes route to distinct
    experts, lane i's copied into row i; the other outputs: the pass's counts ("staged", as `union` gives
    them) and, with `hits`, which lanes' experts were in device rows ("hit")."""
    k, E = indices.size, table.shape[0]
    read = mx.arange(k, dtype=indices.dtype).reshape(indices.shape)
    if by_kernel:  # one kernel: rows, hits and counts
        copies, hit, counts = kernels.staged_lanes(indices, table, list(arrays), BLOCKS)
    else:
        sources = table[indices.reshape(-1)].astype(mx.int32)
        copies = [mx.take(array, sources, axis=0) for array in arrays]
        hit = sources >= E
        held = hit.sum().astype(mx.int32)
        counts = mx.stack([mx.array(k, mx.int32), held, mx.array(1, mx.int32), k - held])
        hit = hit.reshape(indices.shape)
    return copies, read, {"staged": counts, "hit": hit} if hits else {"staged": counts}


def take_rows(arrays: list, sources: mx.array, count: mx.array, by_kernel: bool) -> list:
    """`mx.take(array, sources, axis=0)` of every array of `arrays`: on CUDA (`by_kernel`) as `copy_rows`,
    which leaves rows from `count` on unwritten."""
    if by_kernel:
        return copy_rows(arrays, sources, count, sources.size, BLOCKS)
    return [mx.take(array, sources, axis=0) for array in arrays]
