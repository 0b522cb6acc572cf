"""Small arrays the host writes and the device reads, made once and rewritten in turn, so that values the
host decides between passes (two-tier mode's lookup tables and slot fills) reach the device with no new
array made from host bytes.

On CUDA an array made from host bytes (`mx.array` of numpy) takes managed memory MLX may allocate anew,
and a pass during which one was made took milliseconds more than another, whatever the array's size or
how it was made (`docs/GPU.md`, "Slots and admission"). Here `depth` arrays are
made at the start, kept in host memory for the device to read in place (`backend.map_for_device`), and written
through numpy views. An array is written again only once what the device made from it last time is
computed (`used_by`, waited for with `mx.eval`, which returns at once when it is), so no read sees a
half-written value. On the CPU and Metal the arrays are plain memory and the same code runs.
Not here: what the values mean (`two_tier_runtime.py`, `slot_fill.py`).
"""

import weakref

import mlx.core as mx
import numpy as np

from ..memory import backend
from .mapped import host_view


class HostRing:
    """`depth` arrays of `shape` and `dtype` (a numpy dtype), written in turn by `write`."""

    def __init__(self, shape: tuple[int, ...], dtype, depth: int = 2):
        self.dtype = np.dtype(dtype)
        self.arrays = [mx.array(np.zeros(shape, self.dtype)) for _ in range(depth)]
        mx.eval(self.arrays)
        for array in self.arrays:
            backend.map_for_device(array, 0)
        self._views = [host_view(array) for array in self.arrays]  # the host writes through these
        weakref.finalize(self, _release, list(self.arrays))
        self._users: list[mx.array | None] = [None] * depth
        self._next = 0

    def write(self, values: np.ndarray) -> mx.array:
        """The next array of the ring holding `values` (once what was made from it before is computed);
        pass what the device makes from it to `used_by` before the next `write` comes round to it."""
        k = self._next
        self._next = (k + 1) % len(self.arrays)
        if self._users[k] is not None:
            mx.eval(self._users[k])
            self._users[k] = None
        view = self._views[k]
        view[...] = np.ascontiguousarray(values, dtype=self.dtype).view(view.dtype).reshape(view.shape)
        self._last = k
        return self.arrays[k]

    def used_by(self, made: mx.array, written: mx.array | None = None):
        """`made` reads the array the last `write` returned (or `written`, one `write` returned): that
        array is written again only after it."""
        k = self._last if written is None else next(i for i, a in enumerate(self.arrays) if a is written)
        self._users[k] = made


def _release(arrays: list[mx.array]):
    for array in arrays:
        backend.unmap(array)
