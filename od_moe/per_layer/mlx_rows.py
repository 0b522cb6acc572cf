"""Expert rows (`layout.ExpertRows`) that are already an MLX array: where MLX arrays are not host memory
(CUDA), reads land in the memory the device copies from, with no host copy between.

On CUDA the bytes of an expert reach the cache's slots through an MLX array made from host bytes
(`mx.array`), a copy that holds Python's GIL, so the reader threads made arrays one at a time and
waited for one another. Here the reader reads straight into rows of MLX arrays it keeps (host-preferred,
device-mapped managed memory, `backend.stage_for_device`), written through numpy views of their memory,
and installs copy from those arrays.

When a row may be written again: an install's copy from a row is lazy, and MLX cannot say when it ran.
The engine's decode passes can. A decode pass computes every MoE layer on its slots and ends in the token
the next pass starts from, so a row installed from before decode pass n+1 began has been copied once
that pass is done; and a host sync made after decode pass n+2 began returns only after that (the device
runs in order, and pass n+2 depends on pass n+1's token). So a row given back while decode pass n (or a
prefill after it) ran is handed out again only after a sync made once decode pass n+2 began (`begin_pass`,
`synced`). Prefill passes do not count: a chunk's last layers feed nothing the next chunk's syncs wait
for. Rows given back unused (never installed from) are free at once. Sooner, within one pass: a row a
demand read installed into the layer about to compute is copied once that layer has computed, and a host
sync of a later layer's routing in the same pass waits for that (it depends on the layer's output), so
such a row (`give_back(layer=...)`) is free after that sync (`synced(layer)`); prefill's many reads then
reuse a few rows instead of going to copies. One the pass's later syncs did not free (the last layer's)
waits as above.

Bounded: rows in use or cooling take at most `max_bytes`; past that, reads use numpy staging and a copy,
as before. `release` (the reader closing, or the rows collected) takes back the rows' memory hints, so
MLX recycles their buffers as any other.
Not here: reading (`storage/store.py`), the read queue (`reader.py`), installing (`caching/layer_cache.py`).
"""

import threading
import weakref
from collections import deque
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..memory import backend
from ..storage.layout import BlockLayout, ExpertRows

# about three decode passes of reads at 25% of the widened x128 model; with fewer rows more decode reads
# went to copies and decode slowed (docs/GPU.md, "The per-layer path on CUDA")
MLX_ROW_BYTES = 256 * 2**20
PASSES_APART = 2  # a row given back in decode pass n is written again after a sync in decode pass n + 2


@dataclass
class Row:
    """One expert's bytes as a flat uint8 MLX array, and the staging whose `flat` is its memory."""

    array: mx.array
    staging: ExpertRows


GROW = object()  # `reserve`'s answer where a new row may be made (by the reading thread, `make`)


class MLXRows:
    """The rows of MLX memory the reader threads read into, by expert shape, and those cooling."""

    def __init__(self, max_bytes: int = MLX_ROW_BYTES):
        self.max_bytes = max_bytes
        self.bytes = 0  # rows made (in use, cooling or free)
        self.epoch = 0  # decode passes begun
        self.passes = 0  # passes begun (prefill too)
        self.works = True  # False once MLX memory proved not writable from the host
        self._free: dict[tuple, list[Row]] = {}
        self._cooling: deque[tuple[int, tuple, Row]] = deque()
        self._after_layer: list[tuple[int, tuple, Row]] = []  # this pass: (layer, key, row), see `synced`
        self._lock = threading.Lock()
        self._made: list[mx.array] = []  # every row's array, to release
        self._release = weakref.finalize(self, _release, self._made)

    def reserve(self, layout: BlockLayout):
        """A free row for an expert of `layout`; else `GROW` (its bytes counted: `make` it); else None
        (the bound is reached, or rows do not work here: use numpy staging)."""
        with self._lock:
            if not self.works:
                return None
            free = self._free.get(layout.shape_key)
            if free:
                return free.pop()
            if self.bytes + layout.expert_nbytes > self.max_bytes:
                return None
            self.bytes += layout.expert_nbytes
            return GROW

    def make(self, layout: BlockLayout) -> Row | None:
        """A new row (after `reserve` said `GROW`); None where the host cannot write MLX memory."""
        try:
            array = backend.stage_for_device(mx.array(np.zeros(layout.expert_nbytes, dtype=np.uint8)))
            view = np.array(array, copy=False)
        except (TypeError, ValueError, RuntimeError, MemoryError):
            view = None
        if view is None or not view.flags.writeable or view.shape != (layout.expert_nbytes,):
            with self._lock:
                self.works = False
                self.bytes -= layout.expert_nbytes
            return None
        with self._lock:
            released = not self._release.alive
            if not released:
                self._made.append(array)
        if released:  # made while the reader closed: nothing will release it later
            backend.unstage(array)
        return Row(array, ExpertRows(layout, 1, flat=view[None]))

    def release(self):
        """No more rows: take back the memory hints of those made (the reader is closing)."""
        with self._lock:
            self.works = False
            self._free.clear()
            self._cooling.clear()
            self._after_layer.clear()
        self._release()

    def give_back(self, layout: BlockLayout, row: Row, installed: bool = True, layer: int | None = None):
        """A read is done with `row`: free now if nothing was installed from it, else after the wait;
        `layer`: it was installed only into that MoE layer, which computes next in this pass."""
        with self._lock:
            if not installed:
                self._free.setdefault(layout.shape_key, []).append(row)
            elif layer is not None:
                self._after_layer.append((layer, layout.shape_key, row))
            else:
                self._cooling.append((self.epoch, layout.shape_key, row))

    def begin_pass(self, decode: bool):
        """The engine starts a forward pass (only decode passes count toward `PASSES_APART`)."""
        with self._lock:
            # what no later layer's sync freed in the pass that ended waits as if given back in it
            self._cooling.extend((self.epoch, key, row) for _, key, row in self._after_layer)
            self._after_layer.clear()
            self.epoch += decode
            self.passes += 1

    def synced(self, layer: int | None = None):
        """A host sync returned: rows given back two decode passes ago are free; with `layer` (the sync
        evaluated that MoE layer's routing, in this pass), so are rows installed into earlier layers of
        this pass."""
        with self._lock:
            while self._cooling and self._cooling[0][0] <= self.epoch - PASSES_APART:
                _, key, row = self._cooling.popleft()
                self._free.setdefault(key, []).append(row)
            if layer is not None and self._after_layer:
                waiting = []
                for entry in self._after_layer:
                    if entry[0] < layer:
                        self._free.setdefault(entry[1], []).append(entry[2])
                    else:
                        waiting.append(entry)
                self._after_layer = waiting


def _release(arrays: list[mx.array]):
    for array in arrays:
        backend.unstage(array)
    arrays.clear()
