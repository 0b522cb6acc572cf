"""mlx-lm's switch over other arrays (`switch_on`), for both paths: the per-layer path's overflow stack
(`per_layer/switch.py`) and two tiers' mapped stacks (`two_tier/`).
Not here: the modules that replace `switch_mlp` (`per_layer/switch.py`, `two_tier/layer_step.py`).
"""

import copy

import mlx.core as mx
import mlx.nn as nn


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
