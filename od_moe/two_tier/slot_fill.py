"""Filling two-tier slots on CUDA with no wait: a kernel on MLX's stream copies experts from their host rows
into slot rows of the same stack.

Two-tier mode (`two_tier_runtime.py`) keeps a layer's slots as the last rows of its stack. MLX writes an array
in place only when nothing else holds it, so its own slice update must first wait for the passes in flight
(`mx.synchronize`) and then costs two operations per weight array. Here one custom kernel per weight array
(`mx.fast.cuda_kernel`, its source in `kernels.py`) reads each expert's host row over PCIe and writes its slot
row, through the stack's own pointer, where MLX would not write. What makes that safe is the order MLX's CUDA
backend keeps, which follows data: each kernel takes the hidden state entering the pass's first MoE layer as
an input, so it runs after every earlier pass (whose readers of the slot being overwritten came before that
state), and the layer's expert-to-row table for this pass is made from the kernels' outputs, so no computation
reads a slot before its copy landed. Only where MLX runs on CUDA (`AdmissionSettings.by_kernel`); elsewhere
(and before the first pass) MLX writes the stacks after a wait (`write_after_wait`).
Not here: which experts to copy (`admission.py`), the tables and the caches' bookkeeping
(`two_tier_runtime.py`).
"""

import mlx.core as mx
import numpy as np

from ..memory import backend
from .host_ring import HostRing
from .kernels import THREADS, Kernel, cuda_kernel, slot_fill_source, slot_fill_unit

MAX_BLOCKS = 64  # per expert row: enough loads in flight to keep PCIe busy


def available() -> bool:
    """Whether fills can run as kernels here: MLX on CUDA, arrays not host memory."""
    return mx.cuda.is_available() and not backend.arrays_in_host_memory()


def write_after_wait(stacks: list[dict], moves: list[tuple[int, np.ndarray, np.ndarray]]):
    """For each (layer, source rows, slot rows) of `moves`: copy the source rows (experts' host rows) of
    that layer's stack into its slot rows, with MLX writes made once no pass in flight holds a stack (so
    MLX writes each in place). A layer at a time, every source of the layer gathered before it writes (a
    move may swap two of its rows): every layer's copies gathered at once held all the rows a fill moves
    beside the stacks (on a Mac, memory beyond the budget)."""
    for layer, sources, targets in moves:
        source: int | mx.array
        to: int | mx.array
        if len(sources) == 1:
            source, to = int(sources[0]), int(targets[0])
        else:
            source, to = mx.array(sources.astype(np.int32)), mx.array(targets.astype(np.int32))
        copies = [(rows, rows[source]) for rows in stacks[layer].values()]
        mx.eval([copied for _, copied in copies])
        # every kernel that read the stack done and let go of it, the gathers' too: on CUDA a stack still
        # held is copied, not written in place (docs/GPU.md, "Runs again from the first miss")
        mx.synchronize()
        for rows, copied in copies:
            rows[to] = copied
        mx.eval([rows for rows, _ in copies])


class KernelFills:
    """The copy kernels, one per row unit (16, 4 or 1 bytes), compiled on first use."""

    def __init__(self):
        self._kernels: dict[int, Kernel] = {}
        self._moves_ring: HostRing | None = None  # (layer, 2 x slot rows) int32, made at the first fill

    def fill_layers(self, stacks: list[dict], moves: list, first_slot: int, after: mx.array) -> dict:
        """`write_after_wait` with no wait: the copies of each layer of `moves` run on MLX's stream after
        `after`; per layer filled, a scalar computed once its copies landed (`fill`). `first_slot`: the
        stacks' first slot row."""
        if self._moves_ring is None:  # room for a move into every row from the first slot's
            most = max(next(iter(stack.values())).shape[0] for stack in stacks) - first_slot
            self._moves_ring = HostRing((len(stacks), 2 * most), np.int32)
        pairs = np.zeros(self._moves_ring.arrays[0].shape, np.int32)
        for layer, sources, targets in moves:
            pairs[layer, : 2 * len(sources)] = np.stack([sources, targets], axis=1).reshape(-1)
        staged = self._moves_ring.write(pairs)
        landed = {
            layer: self.fill(stacks[layer], staged[layer], len(sources), after) for layer, sources, _ in moves
        }
        self._moves_ring.used_by(mx.stack(list(landed.values())))
        return landed

    def _kernel(self, unit: int):
        if unit not in self._kernels:
            self._kernels[unit] = cuda_kernel(
                name=f"od_moe_slot_fill_{unit}",
                input_names=["stack", "moves", "after"],
                output_names=["done"],
                source=slot_fill_source(unit),
            )
        return self._kernels[unit]

    def fill(self, stack: dict, moves: mx.array, count: int, after: mx.array) -> mx.array:
        """Copy, for each of the first `count` pairs (source row, slot row) in `moves` (int32, flat), the
        source row of every array of `stack` into the slot row, after `after` is computed; the returned
        scalar is computed once every copy has landed (make what reads the rows depend on it)."""
        dones = []
        for array in stack.values():
            row_bytes = array.nbytes // array.shape[0]
            unit = slot_fill_unit(row_bytes)
            units = row_bytes // unit
            threads = min(units, THREADS * MAX_BLOCKS)
            (done,) = self._kernel(unit)(
                inputs=[array, moves, after],
                template=[("UNITS", units)],
                grid=(threads, count, 1),
                threadgroup=(min(THREADS, threads), 1, 1),
                output_shapes=[(1,)],
                output_dtypes=[mx.uint32],
            )
            dones.append(done)
        return mx.concatenate(dones).sum()
