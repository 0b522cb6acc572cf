"""What every runtime is to the rest of the package: the interface both paths give (`Runtime`), and which
path runs (`TwoTierMode`).

`engine.load` settles `two_tier` ("auto", True, False or "lru": the public surface, which stays as it is)
into a `TwoTierMode` (`assembly.two_tier_mode`, `assembly.auto_tiers`), and `assembly.build_runtime` builds
the runtime of that mode. Not here: either path (`per_layer/per_layer_runtime.py`,
`two_tier/two_tier_runtime.py`), or how the
mode is chosen (`assembly.py`).
"""

import enum
from collections.abc import Sequence
from typing import Protocol

import mlx.core as mx
import numpy as np

from .accounting.ledger import Ledger
from .caching.layer_cache import LayerCache
from .storage.store import ExpertStore


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


class Runtime(Protocol):
    """What the engine, snapshots, the server and the bench use of a runtime, on either path
    (`per_layer.per_layer_runtime.PerLayerRuntime`,
    `two_tier.two_tier_runtime.TwoTierRuntime`): each member means the same on
    both. What one path alone has (the per-layer path's prefetch, governor, miss policy and optimistic
    passes; two tiers' admission, device rows and plans) is that runtime's own: a caller that needs it
    knows which runtime it holds (`isinstance`)."""

    store: ExpertStore  # where the experts' bytes are read from
    caches: list[LayerCache]  # per MoE layer: which expert each slot holds
    ledger: Ledger  # lookups, hits, reads and installs, by phase and layer (`accounting/ledger.py`)
    host_syncs: int  # evaluations the runtime waited for since `reset_counts`

    def set_policy(self, policy, settings=None, experts_per_layer: int = 0) -> None:
        """Use the prefetch policy `policy` (its prompt hooks, `prefetch/policies.py`); `settings`
        (`PrefetchSettings`): prefetch what it predicts, where the path predicts (else a UserError)."""

    def start_prompt(self, prompt) -> None:
        """A new prompt (token ids) starts: the policy's prompt hook runs."""

    def start_recording(self) -> None:
        """Record the routing of every pass from now on."""

    def stop_recording(self) -> list[dict[int, np.ndarray]]:
        """The routing of every pass since `start_recording`: [{layer: ids (tokens, k)}, ...]."""

    def settle(self) -> None:
        """Bring into the ledger what passes left to count (routing booked late), waiting where needed."""

    def reset_counts(self) -> None:
        """Zero the ledger and the counts (the slots stay)."""

    def load(self, cache: LayerCache, ids: Sequence[int], protect: Sequence[int] = ()) -> None:
        """Put experts `ids` of `cache`'s layer into slots now, free slots first, then the most evictable
        (not `protect`)."""

    def place(self, cache: LayerCache, expert_in_slot: np.ndarray, arrays: dict | None = None) -> None:
        """Put each expert of `expert_in_slot` (-1: empty) into that slot (a snapshot's); `arrays`: their
        bytes, by `proj.part` name as `slot_arrays` gives them, where a snapshot saved them (a ValueError
        where they do not fit)."""

    def slot_arrays(self, cache: LayerCache) -> dict[str, mx.array]:
        """What `cache`'s slots hold, by `proj.part` name (snapshots)."""

    def prepare_batches(self, lanes: int) -> None:
        """Before batches of any size are served: make what their passes need, up to `lanes` routed lanes a
        layer (the largest batch times the experts each token routes to; `server/batching.py`)."""

    def close(self) -> None:
        """Stop what runs beside generation (prefetch, reader threads); the runtime can still generate."""
