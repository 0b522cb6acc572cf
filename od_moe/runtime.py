"""What every runtime is to the rest of the package: the interface both paths give (`Runtime`), what a path
reports beside the ledger (`PathFigures`), and which path runs (`TwoTierMode`).

`engine.load` settles `two_tier` ("auto", True, False or "lru": the public surface, which stays as it is)
into a `TwoTierMode` (`assembly.two_tier_mode`, `assembly.auto_tiers`), and `assembly.build_runtime` builds
the runtime of that mode with its path's `build` and settings. Everything outside a path's own folder and
`assembly` holds a runtime as a `Runtime` and nothing more: it never asks which path it holds. Not here:
either path (`per_layer/`, `two_tier/`), or how the mode is chosen (`assembly.py`).
"""

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .accounting.ledger import Ledger
from .caching.layer_cache import LayerCache
from .prefetch import governor
from .storage.layout import ExpertIds
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
        arguments: dict[TwoTierMode, bool | str] = {
            TwoTierMode.OFF: False,
            TwoTierMode.ON: True,
            TwoTierMode.LRU: "lru",
        }
        return arguments[self]

    @property
    def path(self) -> str:
        """The path's name as reports show it: "per-layer" or "two-tier"."""
        return "two-tier" if self.tiered else "per-layer"


def _no_prefetch() -> dict[str, Any]:
    return dict(pending=0, **governor.OFF)


def _no_optimistic_passes() -> dict[str, Any]:
    return {"enabled": False, "passes": 0, "missed": 0, "token_miss_rate": 0.0}


@dataclass(frozen=True)
class PathFigures:
    """What a path reports beside the ledger (`Engine.stats`), the same keys on both paths: zeros and
    "off" where a path has no such thing (the defaults)."""

    # prefetch reads queued and not yet started, and the governor's state (`prefetch/governor.py`)
    prefetch: dict[str, Any] = field(default_factory=_no_prefetch)
    # decode passes run with one host sync (`per_layer/optimistic.py`): enabled, passes, missed and the
    # token miss rate
    optimistic: dict[str, Any] = field(default_factory=_no_optimistic_passes)
    # the device keeps its slots itself (two tiers' `lru`): experts moved are counted from its rows
    kept_by_device: bool = False
    # slot fills that found a stack copied instead of written in place (want 0; two tiers)
    stack_moves: int = 0
    # experts a layer each tier holds at most: "device" (slots and kept rows), "host" (read in place from
    # host memory: two tiers), "disk" (the rest, read when needed)
    tiers: dict[str, int] = field(default_factory=dict)
    # past the host's memory, which host row goes first: "recency" or "next-use" (`two_tier/host_eviction.py`)
    host_eviction: str | None = None


class ReadAhead(Protocol):
    """Where a path reads experts ahead of the layer that needs them: the pass clock and the read queue
    (the pipeline's seam between ranks predicts into them: `distributed/seams.py`)."""

    passes: Any  # where generation stands (`per_layer/passes.py`)
    loader: Any  # reads and installs, with their reader threads (`per_layer/loader.py`)


@runtime_checkable
class Runtime(Protocol):
    """What the engine, snapshots, the server, the bench, drafts and the distributed code use of a runtime,
    on either path (`per_layer.per_layer_runtime.PerLayerRuntime`, `two_tier.two_tier_runtime.TwoTierRuntime`,
    both declared as implementing it and held to it by `tests/test_runtime_interface.py`): each member means
    the same on both, and no caller asks which runtime it holds."""

    store: ExpertStore  # where the experts' bytes are read from
    caches: list[LayerCache]  # per MoE layer: which expert each slot holds
    ledger: Ledger  # lookups, hits, reads and installs, by phase and layer (`accounting/ledger.py`)
    host_syncs: int  # evaluations the runtime waited for since `reset_counts`
    mode: TwoTierMode  # which path this is
    mode_reason: str  # why this path runs (said where `load` chose it)
    miss_policy: str  # "load" (exact) or "skip" (the per-layer path's approximate mode)

    def generation_model(self, model: nn.Module) -> nn.Module:
        """What mlx-lm's generation loop calls in place of `model` (the per-layer path's optimistic decode
        passes wrap it; else `model` itself)."""
        ...

    def set_policy(self, policy, settings=None, experts_per_layer: int = 0) -> None:
        """Use the prefetch policy `policy` (its prompt hooks, `prefetch/policies.py`; its router taps where
        it reads router outputs); `settings` (`PrefetchSettings`): prefetch what it predicts, where the path
        predicts (else a UserError)."""
        ...

    def read_ahead(self) -> ReadAhead | None:
        """The clock and read queue where this path reads experts ahead of need; None where it reads
        nothing ahead."""
        ...

    def figures(self) -> PathFigures:
        """What the path reports beside the ledger (`Engine.stats`)."""
        ...

    def transfer_rates(self, repeats: int = 5) -> dict[str, float]:
        """Bytes a second at which this path brings an expert to where a layer computes it, measured now
        on its first MoE layer, by way (two tiers: read in place, copied by a staged pass; the per-layer
        path: installed into slots), and the best ("best"). The slots hold what they held before."""
        ...

    def start_prompt(self, prompt) -> None:
        """A new prompt (token ids) starts: the policy's prompt hook runs."""
        ...

    def start_recording(self) -> None:
        """Record the routing of every pass from now on."""
        ...

    def stop_recording(self) -> list[dict[int, np.ndarray]] | None:
        """The routing of every pass since `start_recording`: [{layer: ids (tokens, k)}, ...]; None where
        nothing was recording."""
        ...

    def settle(self) -> None:
        """Bring into the ledger what passes left to count (routing booked late), waiting where needed."""
        ...

    def reset_counts(self) -> None:
        """Zero the ledger and the counts (the slots stay)."""
        ...

    def load(self, cache: LayerCache, ids: ExpertIds, protect: ExpertIds = ()) -> None:
        """Put experts `ids` of `cache`'s layer into slots now, free slots first, then the most evictable
        (not `protect`)."""
        ...

    def place(self, cache: LayerCache, expert_in_slot: np.ndarray, arrays: dict | None = None) -> None:
        """Put each expert of `expert_in_slot` (-1: empty) into that slot (a snapshot's); `arrays`: their
        bytes, by `proj.part` name as `slot_arrays` gives them, where a snapshot saved them (a ValueError
        where they do not fit)."""
        ...

    def slot_arrays(self, cache: LayerCache) -> dict[str, mx.array]:
        """What `cache`'s slots hold, by `proj.part` name (snapshots)."""
        ...

    def prepare_batches(self, lanes: int) -> None:
        """Before batches of any size are served: make what their passes need, up to `lanes` routed lanes a
        layer (the largest batch times the experts each token routes to; `server/batching.py`)."""
        ...

    def close(self) -> None:
        """Stop what runs beside generation (prefetch, reader threads); the runtime can still generate."""
        ...
