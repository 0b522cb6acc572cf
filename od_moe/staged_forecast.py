"""Staged decode passes that copy the next layer's experts ahead: each layer forecasts the next one's routing
and copies those experts to the device while it computes, so that the next layer copies from host memory
only the experts the forecast missed.

Where no expert has a device row and experts are large, a decode pass is staged (`staging.py`): each layer
copies the experts its lanes route to, then computes on them. Those copies wait for the layer's router,
and the layer's products wait for the copies, so the bus and the layers' own device work take turns (H100,
widened x128 copy, no slots: 170 MB a token moved at 45 GB/s is 3.8 ms; the row took 5.7-6.3 ms,
docs/two-tier-h100.md). Here, in the same compiled call, layer L also scores layer L+1's experts with L+1's
router applied to L's own input (next-gate: on the bundled model it names 0.72 of the next layer's top 8,
`../shared/models/README.md`) and copies the best P into device memory. That copy depends only on the
forecast, so on CUDA it runs beside layer L's products and layer L+1's attention (MLX's CUDA graphs order
kernels by the buffers they read and write, not one after another). Layer L+1 then takes each lane's expert
from the forecast's copy where it is there (device to device), else from its host row, in one kernel
(`staging.copy_rows` with a second source). Nothing waits for the host; a wrong forecast costs bus bytes,
never a wrong token. The forecast's copy lives until the next layer's products are computed: P experts of
device memory beside the staging copy's k.
Booked as prefetch: P experts copied a layer pass (`prefetch_installed`), those routed (`prefetch_useful`,
and their lanes hits: the expert was in device memory when the layer read it), the rest wasted.
Not here: staging itself (`staging.py`), forecasts from several layers back into kept rows (`lookahead.py`).
"""

import functools

import mlx.core as mx
import numpy as np

from . import slot_fill, stage_kernels, staging
from .errors import UserError
from .layer_step import Plan
from .routing import router_matrices
from .staging import staged_lanes

PER_LAYER = 8  # experts forecast and copied for each next layer
BLOCKS = 4  # thread blocks per (expert, array) of a forecast's copy: it shares the device with the layers


class StagedForecast:
    """Forecast copies for the staged decode passes of a runtime's layers: `plan` makes a layer's `Plan`,
    `end_pass` drops what a pass left."""

    def __init__(self, routers: tuple, per_layer: int = PER_LAYER, blocks: int = BLOCKS):
        weights, biases = routers  # (L, E, H), (L, E) float32 (`routing.router_matrices`)
        self.weights = [mx.array(np.ascontiguousarray(w.T)) for w in weights]  # (H, E) each
        self.biases = [mx.array(b) for b in biases]
        mx.eval(self.weights, self.biases)
        self.per_layer = min(per_layer, weights.shape[1])
        self.blocks = blocks
        self.by_kernel = slot_fill.available()
        self._copied: dict[int, tuple] = {}  # layer -> (forecast ids, their copies) for this pass

    def plan(self, layer: int, tables: list, stacks: list, keep) -> Plan:
        """Layer `layer`'s staged pass of one position: its lanes from the copy the layer before made where
        it holds their experts, and (but at the last layer) the next layer's forecast copied.
        `keep(layer, counts, hit)` books the pass's counts and hit lanes."""
        by_kernel, P = self.by_kernel, self.per_layer
        stack = tuple(stacks[layer].values())
        prior = self._copied.pop(layer, None)
        if prior is None:
            lanes, state = staged_lanes(by_kernel), (tables[layer], *stack)
        else:
            lanes, state = functools.partial(_lanes_with_prior, by_kernel), (tables[layer], *prior, *stack)
        ahead, ahead_state = None, ()
        if layer + 1 < len(stacks):
            ahead = functools.partial(_forecast_copy, by_kernel, P, self.blocks)
            nxt = layer + 1
            ahead_state = (self.weights[nxt], self.biases[nxt], tables[nxt], *stacks[nxt].values())
        key = ("staged ahead", by_kernel, prior is not None, ahead is not None, P, self.blocks)
        return Plan(
            key, lanes, state, functools.partial(self._finish, keep, ahead is not None), ahead, ahead_state
        )

    def _finish(self, keep, ahead: bool, layer: int, outputs: tuple):
        if ahead:
            *outputs, self._copied[layer + 1] = outputs
        counts, hit = outputs
        keep(layer, counts, hit)

    def end_pass(self):
        self._copied = {}


def for_blocks(modules) -> StagedForecast | None:
    """Copies ahead for staged decode passes, from the routers of the MoE blocks `modules`; None where a
    router is no linear map of the hidden state (no next-gate forecast)."""
    try:
        return StagedForecast(router_matrices(modules))
    except UserError:
        return None


def _forecast_copy(by_kernel: bool, P: int, blocks: int, x, weights, biases, table, *arrays):
    """(the next layer's P best-scored experts by its router on `x`, int32 (P,); their rows copied to the
    device, one array per stack array)."""
    scores = mx.addmm(biases, x.reshape(-1, x.shape[-1]).astype(mx.float32), weights)
    if by_kernel:
        ids, copies = stage_kernels.forecast_copy(scores, table, list(arrays), P, blocks)
        return (ids, *copies)
    ids = mx.argpartition(-scores, P - 1, axis=-1)[0, :P].astype(mx.int32)
    rows = table[ids].astype(mx.int32)
    return (ids, *(mx.take(a, rows, axis=0) for a in arrays))


def _lanes_with_prior(by_kernel: bool, indices, table, ids, *arrays):
    """A staged pass's lanes (as `staging.staged_lanes`) whose experts come from the forecast's copy
    (`ids`, then its arrays) where it holds them, else from their rows of the stack (the last arrays)."""
    n = len(arrays) // 2
    prior, stack = list(arrays[:n]), list(arrays[n:])
    k = indices.size
    read = mx.arange(k, dtype=indices.dtype).reshape(indices.shape)
    if by_kernel:
        copies, hit, counts = stage_kernels.lanes(indices, table, stack, staging.BLOCKS, ids, prior)
        return copies, read, (counts, hit)
    flat = indices.reshape(-1)
    match = flat[:, None] == ids[None, :]
    found = match.any(axis=1)
    place = mx.argmax(match, axis=1).astype(mx.int32)
    rows = table[flat].astype(mx.int32)
    copies = [
        mx.where(found.reshape(-1, *[1] * (a.ndim - 1)), mx.take(b, place, axis=0), mx.take(a, rows, axis=0))
        for a, b in zip(stack, prior)
    ]
    held = found.sum().astype(mx.int32)
    counts = mx.stack(
        [mx.array(k, mx.int32), held, mx.array(1, mx.int32), k - held, mx.array(ids.size, mx.int32)]
    )
    return copies, read, (counts, found.reshape(indices.shape))
