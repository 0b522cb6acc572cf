"""mlx-lm's switch over other arrays (`switch_on`), for both paths: the per-layer path's overflow stack
(`per_layer/offloaded_switch.py`) and two tiers' mapped stacks (`two_tier/`); and its products traced with
their batch indices given (`switch_on(rows_given=True)`), for the compiled passes of `two_tier/layer_step.py`:
od-moe's own twins of mlx-lm's projection classes, so nothing of mlx's or mlx-lm's is replaced.
Not here: the modules that replace `switch_mlp` (`per_layer/offloaded_switch.py`, `two_tier/layer_step.py`).
"""

import copy
from collections.abc import Mapping

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear


def switch_on(
    switch: nn.Module, stacks: Mapping[tuple[str, str], mx.array | None], rows_given: bool = False
) -> nn.Module:
    """A shallow copy of mlx-lm's `switch` whose projections hold `stacks` ((projection, array name) ->
    array) instead of their own: the same code computes on other rows; `switch` is left as it is (a
    layer's overflow here, the two-tier mode's mapped stack). None for an array: the copy holds none
    (`two_tier/layer_step.py` gives the arrays at each call).

    rows_given: the copied projections call their products with `batch_rows` for lhs indices, the values
    MLX makes when given none. In a trace for `mx.compile` those are constants of the compiled call, where
    MLX's own are an `arange` operation (a kernel on the GPU) per product at every pass, and a copy where
    they broadcast; the products, and their bits, are the same. Meant for traces: op by op it saves
    nothing, and a new shape's indices are made from host bytes mid-pass. Projections of other classes
    keep their own call."""
    clone = copy.copy(switch)
    for proj in {p for p, _ in stacks}:
        module = clone[proj] = copy.copy(switch[proj])
        if rows_given and type(module) in _ROWS_GIVEN:
            module.__class__ = _ROWS_GIVEN[type(module)]  # the copy's own class: `switch` is untouched
        for (p, name), array in stacks.items():
            if p == proj:
                module[name] = array
    return clone


_batch_rows: dict[tuple, mx.array] = {}


def batch_rows(batch: tuple, lanes: tuple) -> mx.array:
    """The lhs indices `gather_qmm` and `gather_mm` use when given none, for inputs of batch shape `batch`
    and rhs indices of shape `lanes`: each batch entry its own row (MLX's `arange` over the batch), laid out
    in the shape both broadcast to, so that the products read them with no copy (CUDA's copies indices
    that are not row-contiguous, a broadcast's among them); made once per shapes from host bytes."""
    key = (batch, lanes)
    if key not in _batch_rows:
        rows = np.arange(int(np.prod(batch, dtype=np.int64)), dtype=np.uint32).reshape(batch)
        _batch_rows[key] = mx.array(np.broadcast_to(rows, np.broadcast_shapes(batch, lanes)).copy())
    return _batch_rows[key]


class _QuantizedRowsGiven(QuantizedSwitchLinear):
    """mlx-lm's quantized switch projection, its product called with `batch_rows` for lhs indices."""

    def __call__(self, x, indices, sorted_indices=False):
        rows = _rows_for(x, indices, sorted_indices)
        if rows is None:
            return super().__call__(x, indices, sorted_indices)
        x = mx.gather_qmm(
            x,
            self["weight"],
            self["scales"],
            self.get("biases"),
            lhs_indices=rows,
            rhs_indices=indices,
            transpose=True,
            group_size=self.group_size,
            bits=self.bits,
            mode=self.mode,
            global_scale=self.global_scale,
        )
        return x + mx.expand_dims(self["bias"][indices], -2) if "bias" in self else x


class _RowsGiven(SwitchLinear):
    """mlx-lm's floating-point switch projection, its product called with `batch_rows` for lhs indices."""

    def __call__(self, x, indices, sorted_indices=False):
        rows = _rows_for(x, indices, sorted_indices)
        if rows is None:
            return super().__call__(x, indices, sorted_indices)
        x = mx.gather_mm(x, self["weight"].swapaxes(-1, -2), lhs_indices=rows, rhs_indices=indices)
        return x + mx.expand_dims(self["bias"][indices], -2) if "bias" in self else x


def _rows_for(x: mx.array, indices: mx.array, sorted_indices: bool) -> mx.array | None:
    """`batch_rows` for a product of `x` by the rows `indices` names; None for a sorted call (MLX picks
    kernels by which indices were given) or shapes that do not broadcast (MLX's own call says so)."""
    if sorted_indices:
        return None
    try:
        return batch_rows(tuple(x.shape[:-2]), tuple(indices.shape))
    except ValueError:
        return None


# mlx-lm's projection classes and their twins that give the batch indices (`switch_on(rows_given=True)`)
_ROWS_GIVEN: dict[type[nn.Module], type[nn.Module]] = {
    QuantizedSwitchLinear: _QuantizedRowsGiven,
    SwitchLinear: _RowsGiven,
}
