"""What every runtime is to the rest of the package: which path runs (`TwoTierMode`).

`engine.load` settles `two_tier` ("auto", True, False or "lru": the public surface, which stays as it is)
into a `TwoTierMode` (`assembly.two_tier_mode`, `assembly.auto_tiers`), and `assembly.build_runtime` builds
the runtime of that mode. Not here: either path (`per_layer/runtime.py`, `two_tier/runtime.py`), or how the
mode is chosen (`assembly.py`).
"""

import enum


class TwoTierMode(enum.Enum):
    """Which path runs: the per-layer path (`OFF`), or two tiers with slots admitted by routing counts
    (`ON`) or kept by the device, least recently used (`LRU`, `two_tier/kept_rows.py`)."""

    OFF = "off"
    ON = "on"
    LRU = "lru"

    @property
    def tiered(self) -> bool:
        """Two-tier mode runs (slots of either kind)."""
        return self is not TwoTierMode.OFF

    @property
    def argument(self) -> bool | str:
        """`load`'s `two_tier` that asks for this mode: False, True or "lru"."""
        return {TwoTierMode.OFF: False, TwoTierMode.ON: True, TwoTierMode.LRU: "lru"}[self]
