"""How the two-tier path runs (`TwoTierSettings`): given to `two_tier.build` once, never written into its
runtime afterwards.

`engine.load` fills in the kind of slots it chose (`two_tier="lru"`: kept by the device) and why; benchmarks
and tests pass the rest as `load(path_settings=TwoTierSettings(...))`. Not here: the runtime these settle
(`two_tier_runtime.py`), choosing the path (`assembly.py`).
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class TwoTierSettings:
    """The two-tier path's settings; None: the default each field names."""

    kept_by_device: bool = False  # the slots are rows the device keeps, least recently used (`kept_rows.py`)
    lookahead_rows: int = 0  # device rows per layer after the slots, filled by misses and predictions
    admissions: bool = True  # fill slots between passes from routing counts (off: they stay as seeded)
    admit_every: int | None = None  # positions between admissions; None: `two_tier_runtime.ADMIT_EVERY`
    # a pass of this many positions or more is staged (`staged_passes.py`); None: from the experts' size
    stage_positions: int | None = None
    mode_reason: str = ""  # why two tiers run (`Runtime.mode_reason`)
