"""mlx-lm's switch over other arrays (`switch_on`), for both paths: the per-layer path's overflow stack
(`per_layer/switch.py`) and two tiers' mapped stacks (`two_tier/`); and its products traced with their
batch indices given (`batch_indices_given`), for the compiled passes of `two_tier/layer_step.py`.
Not here: the modules that replace `switch_mlp` (`per_layer/switch.py`, `two_tier/layer_step.py`).
"""

import contextlib
import copy

import mlx.core as mx
import mlx.nn as nn
import numpy as np


def switch_on(switch: nn.Module, stacks: dict[tuple[str, str], mx.array]) -> nn.Module:
    """A shallow copy of mlx-lm's `switch` whose projections hold `stacks` ((projection, array name) ->
    array) instead of their own: the same code computes on other rows; `switch` is left as it is (a
    layer's overflow here, the two-tier mode's mapped stack)."""
    clone = copy.copy(switch)
    for proj in {p for p, _ in stacks}:
        module = clone[proj] = copy.copy(switch[proj])
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


@contextlib.contextmanager
def batch_indices_given():
    """While open, mlx-lm's switch products (`mx.gather_qmm`, `mx.gather_mm`) called with rhs indices, no
    lhs indices and unsorted get `batch_rows`, the values MLX would make. In a trace for `mx.compile` those
    are constants of the compiled call, where MLX's own are an `arange` operation (a kernel on the GPU) per
    product at every pass, and a copy where they broadcast; the products, and their bits, are the same.
    Sorted calls are left as they are (MLX picks kernels by which indices were given). Meant for traces
    only: op by op it saves nothing, and a new shape's indices are made from host bytes mid-pass."""
    gather_qmm, gather_mm = mx.gather_qmm, mx.gather_mm

    def given(product, positional: int):  # (how many arguments after x come before lhs_indices)
        def call(x, *args, **kwargs):
            unset = len(args) <= positional and kwargs.get("lhs_indices") is None
            lanes = kwargs.get("rhs_indices")
            if unset and lanes is not None and not kwargs.get("sorted_indices"):
                with contextlib.suppress(ValueError):  # shapes that do not broadcast: MLX says so
                    kwargs["lhs_indices"] = batch_rows(tuple(x.shape[:-2]), tuple(lanes.shape))
            return product(x, *args, **kwargs)

        return call

    mx.gather_qmm, mx.gather_mm = given(gather_qmm, 3), given(gather_mm, 1)
    try:
        yield
    finally:
        mx.gather_qmm, mx.gather_mm = gather_qmm, gather_mm
