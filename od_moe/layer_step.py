"""A two-tier layer's pass of one position as one compiled MLX call: how its lanes find their rows (the
slots' table, the row kernel's copies, a staging copy) and then mlx-lm's switch on those rows.

A decoded token on a fast GPU waits on the host (docs/two-tier-h100.md, "Where a decoded token's time
goes"): at every pass Python makes each MLX operation of a layer's lookups and of mlx-lm's switch
(`SwitchGLU`: three `gather_qmm`s and the activation). `mx.compile` traces a step once per input shapes
and MLX replays it with none of that Python. The operations are the same ones on the same bytes, so the
output is the switch's bit for bit (the suite compares tokens with stock mlx-lm's). Only one position's
passes are compiled: their shapes repeat at every decoded token, while a prompt's would trace anew for
each length.
Not here: what the lanes read (`two_tier.py`, `lookahead.py`, `staging.py`).
"""

import mlx.core as mx
import mlx.nn as nn

from .switch import switch_on


class LayerSteps:
    """mlx-lm's switch of one layer, copied so that it holds none of the stack's arrays between calls, and
    the compiled steps made over it."""

    def __init__(self, stacked: nn.Module, keys):
        self.keys = list(keys)  # the stack's (projection, array name), in the order arrays are given
        self.switch = switch_on(stacked, dict.fromkeys(self.keys))
        self._compiled: dict = {}

    def compute(self, arrays, x: mx.array, indices: mx.array) -> mx.array:
        """`switch(x, indices)` on `arrays` (in `keys`' order), set for this call only: afterwards the
        switch keeps none of them alive."""
        for (proj, name), array in zip(self.keys, arrays):
            self.switch[proj][name] = array
        try:
            return self.switch(x, indices)
        finally:
            for proj, name in self.keys:
                self.switch[proj][name] = None

    def __call__(self, lanes, x: mx.array, inputs: tuple):
        """`step` for lanes that close over nothing (a module's function, its own key): (the switch's
        output, the lanes' other outputs)."""
        return self.step(lanes, lambda: lanes)(x, inputs)

    def step(self, key, make):
        """The compiled call (x, inputs) -> (the switch's output, the lanes' other outputs) for `key`, which
        names everything the lanes close over. `make()` (called once) gives the lanes: `lanes(*inputs)` ->
        (the arrays to compute on, in `keys`' order; the row each lane reads in them; a tuple of other
        outputs)."""
        if key not in self._compiled:
            lanes = make()

            def call(x, inputs):
                arrays, read, outputs = lanes(*inputs)
                return self.compute(arrays, x, read), outputs

            self._compiled[key] = mx.compile(call)
        return self._compiled[key]


def as_routed(indices: mx.array, *arrays):
    """Lanes that read the rows they are routed to (every expert in its own row)."""
    return arrays, indices, ()


def through_table(table: mx.array, indices: mx.array, *arrays):
    """Lanes that read the row the table gives their expert; the other output: which are hits (a row
    past the experts' own, E + slot)."""
    read = table[indices]
    return arrays, read, (read >= table.shape[0],)
