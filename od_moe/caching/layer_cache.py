"""Resident expert cache of one MoE layer: which expert sits in which of C slots, pinning and eviction.

The slots' stacked `(C, ...)` arrays, inside the layer's own mlx-lm switch projections, and writing bytes
into them are `caching/slot_arrays.py`'s; mlx-lm's `SwitchGLU` computes on them unchanged once expert ids are
remapped to slots. Bookkeeping is numpy on the generation thread:
- `slot_of[e]`: the slot holding expert e, or -1. The lookup table handed to MLX maps every id to a
  valid slot (non-resident ids to slot 0): `gather_qmm` does no bounds check.
- per slot: the expert in it, pinned flag, last use and who put it there; per expert: its decayed use
  count, kept while it is evicted (LFU remembers an expert that comes back, as Belady's MIN would);
  per expert, in tokens, the routing history the next-use head reads (`RoutingHistory`).
Eviction never touches pinned slots or the experts the running layer needs. Methods return what happened
(slots used, evictions, first uses of prefetched experts) and the runtime books it in the ledger. Not
here: deciding when to read (`per_layer/per_layer_runtime.py`, `per_layer/loader.py`), counting
(`accounting/ledger.py`), how bytes come off disk (`storage/store.py`).
"""

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from ..storage.layout import BlockLayout, ExpertIds
from .slot_arrays import SlotArrays

EVICTION_POLICIES = ("lru", "lfu")
LFU_HALF_LIFE = 64.0  # forward passes after which an expert's use count has halved
FOLD_PASSES = 256  # passes of routing noted at most before they are added to the history (bounds the list)


class Installed(NamedTuple):
    slots: np.ndarray
    evictions: int
    unused_prefetches: int  # evicted experts that were prefetched and never used


class LayerCache:
    """The resident experts of one MoE layer."""

    # made when first asked for, dropped when the slots change (`_changed`)
    _full: bool | None
    _identity: bool | None
    _lookup: mx.array | None
    _resident: mx.array | None

    def __init__(
        self,
        layer: int,
        projections: Mapping[str, nn.Module],
        layout: BlockLayout,
        capacity: int,
        eviction: str = "lru",
        own_rows: bool = True,
    ):
        """`own_rows`: the slots' arrays hold their `capacity` rows; False where another runtime holds the
        slots' bytes (two tiers: its stacks' last rows), so that the cache's arrays are made empty and a load
        never holds both (the slots' bytes twice over at its peak)."""
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {eviction!r}")
        self.layer = layer
        self.layout = layout
        self.num_experts = E = layout.num_experts
        self.capacity = C = capacity
        self.eviction = eviction
        self.arrays = SlotArrays(layer, projections, layout, C if own_rows else 0)
        self.projections, self.targets = projections, self.arrays.targets
        self.slot_of = np.full(E, -1, dtype=np.int64)
        self.expert_in_slot = np.full(C, -1, dtype=np.int64)
        self.pinned = np.zeros(C, dtype=bool)
        self.last_use = np.zeros(C, dtype=np.float64)
        self.uses = np.zeros(E, dtype=np.float64)  # decayed use count of every expert, resident or not
        self.used_at = np.zeros(E, dtype=np.float64)  # when `uses` was last brought up to date
        self.history = RoutingHistory(E)  # what the next-use head reads
        self.unused_prefetch = np.zeros(C, dtype=bool)  # installed by prefetch, not used yet
        self.arrived_by_prefetch = np.zeros(C, dtype=bool)  # who put the expert there (for display)
        self._changed()

    # -- state ---------------------------------------------------------------------------------
    @property
    def slot_nbytes(self) -> int:
        """Bytes one slot holds in memory (`SlotArrays.slot_nbytes`)."""
        return self.arrays.slot_nbytes

    @property
    def host_writes(self) -> bool:
        """Installs write bytes into the slots from host memory (`SlotArrays.host_writes`)."""
        return self.arrays.host_writes

    def use_host_writes(self, on: bool):
        """Write installs from host bytes where the backend allows (on), or always with MLX writes."""
        self.arrays.use_host_writes(on)

    @property
    def pinned_count(self) -> int:
        return int(self.pinned.sum())

    @property
    def unused_prefetch_count(self) -> int:
        """Experts installed by prefetch and not used yet."""
        return int(self.unused_prefetch.sum())

    @property
    def resident_count(self) -> int:
        return int((self.expert_in_slot >= 0).sum())

    def resident_ids(self) -> np.ndarray:
        return np.flatnonzero(self.slot_of >= 0)

    def is_full(self) -> bool:
        """Every expert of the layer is resident: no lookup can miss."""
        if self._full is None:
            self._full = self.resident_count == self.num_experts
        return self._full

    def routed_slots(self, indices: mx.array) -> mx.array:
        """Slots of routed expert ids (lazy). When every expert sits in the slot of its own id (a cache
        filled in order, as a fully resident one is) the ids are the slots: no operation at all."""
        if self._identity is None:
            self._identity = bool(np.array_equal(self.slot_of, np.arange(self.num_experts)))
        return indices if self._identity else self.lookup_table()[indices]

    def lookup_table(self) -> mx.array:
        """(E,) int32 slot of every expert id; total: non-resident ids map to slot 0."""
        if self._lookup is None:
            self._lookup = mx.array(np.where(self.slot_of >= 0, self.slot_of, 0).astype(np.int32))
        return self._lookup

    def resident_mask(self) -> mx.array:
        """(E,) bool: which experts are resident now."""
        if self._resident is None:
            self._resident = mx.array(self.slot_of >= 0)
        return self._resident

    def slots_for(self, ids: np.ndarray) -> mx.array:
        """Slots of `ids` (numpy) as an MLX int32 array; non-resident ids map to slot 0."""
        return mx.array(np.where(self.slot_of[ids] >= 0, self.slot_of[ids], 0).astype(np.int32))

    # -- use ---------------------------------------------------------------------------------
    def touch(self, ids: np.ndarray, uses: np.ndarray, clock: float) -> int:
        """Record that resident experts `ids` were used `uses` times at time `clock`; returns how many of
        them were prefetched and are used here for the first time."""
        ids = np.asarray(ids, dtype=np.int64)
        slots = self.slot_of[ids]
        ids, uses = ids[slots >= 0], np.asarray(uses)[slots >= 0]
        slots = slots[slots >= 0]
        if slots.size == 0:
            return 0
        first_uses = int(self.unused_prefetch[slots].sum())
        self.unused_prefetch[slots] = False
        self.uses[ids] = self._decayed(ids, clock) + uses
        self.used_at[ids] = clock
        self.last_use[slots] = clock
        return first_uses

    # -- eviction ------------------------------------------------------------------------------
    def _eviction_order(self, clock: float) -> np.ndarray:
        """Occupied slots, most evictable first."""
        if self.eviction == "lru":
            return np.argsort(self.last_use, kind="stable")
        score = self._decayed(np.maximum(self.expert_in_slot, 0), clock)
        return np.lexsort((self.last_use, score))  # least used first; among equals, least recently

    def _decayed(self, ids: np.ndarray, clock: float) -> np.ndarray:
        """The use counts of experts `ids` as of `clock`."""
        return self.uses[ids] * 0.5 ** ((clock - self.used_at[ids]) / LFU_HALF_LIFE)

    def _blocked(self, protect: ExpertIds) -> np.ndarray:
        """Slots that may not be evicted: pinned ones and those holding `protect`."""
        blocked = self.pinned.copy()
        held = self.slot_of[np.asarray(protect, dtype=np.int64)] if len(protect) else np.empty(0, np.int64)
        blocked[held[held >= 0]] = True
        return blocked

    def room(self, protect: ExpertIds = ()) -> int:
        """How many experts can be installed without evicting pinned slots or `protect`."""
        return int((~self._blocked(protect)).sum())

    def choose_slots(
        self, n: int, protect: ExpertIds, clock: float, next_use: np.ndarray | None = None
    ) -> np.ndarray:
        """n slots to install into: free ones first, then the most evictable unpinned, unprotected ones.
        `next_use`: passes until each expert is needed again (inf: not as far as is known), where the
        future is known: the farthest first (Belady's MIN), the eviction rule among equals."""
        free = np.flatnonzero(self.expert_in_slot < 0)
        if len(free) >= n:
            return free[:n]
        order = self.evictable(clock, protect, next_use)
        chosen = np.concatenate([free, order[: n - len(free)]])
        if len(chosen) < n:
            raise RuntimeError(
                f"layer {self.layer}: no room for {n} experts (capacity {self.capacity}, pinned "
                f"{int(self.pinned.sum())})"
            )
        return chosen

    def evictable(self, clock: float, protect: ExpertIds = (), next_use: np.ndarray | None = None):
        """Occupied slots that may be evicted, the first to go first (see `choose_slots`)."""
        blocked = self._blocked(protect)
        order = np.array(
            [s for s in self._eviction_order(clock) if not blocked[s] and self.expert_in_slot[s] >= 0],
            dtype=np.int64,
        )
        if next_use is not None and order.size:
            farthest = -next_use[self.expert_in_slot[order]]
            order = order[np.argsort(farthest, kind="stable")]
        return order

    # -- installing ----------------------------------------------------------------------------
    def install(
        self,
        ids: ExpertIds,
        raw: dict[tuple[str, str], np.ndarray],
        prefetched: bool = False,
        protect: ExpertIds = (),
        clock: float = 0.0,
        arrays: Sequence[mx.array | None] | None = None,
        next_use: np.ndarray | None = None,
        synchronize: bool = True,
    ) -> "Installed":
        """Put experts `ids` into slots; returns the slots used, the experts evicted, and how many of
        those were prefetched and never used.
        raw: per part, the bytes read from disk, indexable by row (an array or a list of per-expert
        arrays), row i = ids[i]. `prefetched`: they were read ahead of need. `arrays`: the same rows
        already made into flat MLX arrays by a reader thread (`flat_rows`'s rows; None for rows it did
        not make), used where the backend needs MLX copies. `next_use`: where the future is known,
        passes until each expert of the layer is needed again (victims are chosen as `choose_slots` says).
        `synchronize=False`: the caller knows that no computation in flight reads the slots this install
        may take, so host writes need not wait for the device first.

        The bytes are copied straight into the slots' rows where the backend allows (host memory on the
        CPU and Metal, the CUDA runtime's copies: `backend.row_writer`); elsewhere with MLX writes that the
        layer's computation evaluates (`SlotArrays.write`). Either way the staging buffers may be reused as
        soon as this returns.
        """
        ids = np.asarray(ids, dtype=np.int64)
        if np.any(self.slot_of[ids] >= 0):
            raise ValueError(
                f"layer {self.layer}: experts {ids[self.slot_of[ids] >= 0].tolist()} are already resident"
            )
        slots = self.choose_slots(
            len(ids), protect=list(protect) + ids.tolist(), clock=clock, next_use=next_use
        )
        self.arrays.write(slots, raw, arrays, synchronize)
        evicted = self.expert_in_slot[slots]
        unused = int(self.unused_prefetch[slots][evicted >= 0].sum())
        evicted = evicted[evicted >= 0]
        self.slot_of[evicted] = -1
        self.slot_of[ids] = slots
        self.expert_in_slot[slots] = ids
        self.pinned[slots] = False
        self.last_use[slots] = clock
        self.unused_prefetch[slots] = prefetched
        self.arrived_by_prefetch[slots] = prefetched
        self._changed()
        return Installed(slots, len(evicted), unused)

    def _changed(self):
        self._lookup = self._resident = self._full = self._identity = None

    def forget_prefetches(self):
        """Count every resident expert as used (statistics restart; the experts stay)."""
        self.unused_prefetch[:] = False

    def pin(self, ids: ExpertIds):
        """Make resident experts `ids` unevictable. At least one slot must stay evictable."""
        slots = self.slot_of[np.asarray(ids, dtype=np.int64)]
        if np.any(slots < 0):
            raise ValueError(f"layer {self.layer}: only resident experts can be pinned")
        pinned = self.pinned.copy()
        pinned[slots] = True
        if pinned.sum() >= self.capacity:
            raise ValueError(
                f"layer {self.layer}: pinning {int(pinned.sum())} of {self.capacity} slots leaves none for "
                "misses"
            )
        self.pinned = pinned

    def unpin_all(self):
        self.pinned[:] = False

    # -- snapshots -----------------------------------------------------------------------------
    def stacked_arrays(self) -> dict[str, mx.array]:
        """The stacked slot arrays by `proj.part` name (for snapshots)."""
        return self.arrays.stacked()

    def restore(self, expert_in_slot: np.ndarray, arrays: dict[str, mx.array] | None = None):
        """Declare which expert each slot holds (-1: empty), after its bytes were put there: `arrays`
        (by `proj.part` name, shaped and typed as `stacked_arrays()`) replace the stacked arrays."""
        self.arrays.replace(arrays or {})
        held = np.asarray(expert_in_slot, dtype=np.int64)
        self.expert_in_slot[:] = held
        self.slot_of[:] = -1
        self.slot_of[held[held >= 0]] = np.flatnonzero(held >= 0)
        self.unused_prefetch[:] = False
        self.arrived_by_prefetch[:] = False
        self.pinned[:] = False
        self._changed()

    def move(self, permutation: np.ndarray, expert_in_slot: np.ndarray):
        """Rearrange the slots' bytes (slot s receives those of slot `permutation[s]`), then hold
        `expert_in_slot` as `restore` does."""
        index = mx.array(np.asarray(permutation).astype(np.int32))
        self.restore(expert_in_slot, {name: array[index] for name, array in self.stacked_arrays().items()})


class RoutingHistory:
    """The routing of one MoE layer in tokens (a prefill pass is many), as the next-use head reads it: per
    expert the token of its last use and its use count decayed to then, as training computes them per
    token (`training.next_use.history`)."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.tokens_routed = 0
        self.token_used_at = np.zeros(num_experts, dtype=np.float64)
        self.token_uses = np.zeros(num_experts, dtype=np.float64)
        self.version = 0  # counts changes of the history (what `ages_and_uses` reads)
        self._unfolded: list[np.ndarray] = []  # passes noted and not yet added to it

    def note(self, ids: np.ndarray):
        """Add a pass's routing, (tokens, k) expert ids in token order, to the per-token history. It is
        folded in when the history is next read (or `FOLD_PASSES` wait): noting a pass costs a list
        append, which is all it costs while nothing reads the history (prefetch paused)."""
        self._unfolded.append(np.asarray(ids).reshape(-1, np.shape(ids)[-1]))
        self.version += 1
        if len(self._unfolded) >= FOLD_PASSES:
            self._fold()

    def _fold(self):
        """Add the passes noted since the last fold to the history, as one pass of their tokens in order."""
        if not self._unfolded:
            return
        ids = self._unfolded[0] if len(self._unfolded) == 1 else np.concatenate(self._unfolded)
        self._unfolded = []
        tokens = ids.shape[0]
        if tokens == 1:  # a decode pass: its k distinct experts, each used once, now (no ufunc.at: fast)
            used, last, weight = ids[0], 0, 1.0
        else:
            at = np.broadcast_to(np.arange(tokens)[:, None], ids.shape).reshape(-1)
            flat = ids.reshape(-1)
            latest = np.full(self.num_experts, -1)
            np.maximum.at(latest, flat, at)
            used = np.flatnonzero(latest >= 0)
            weights = np.zeros(self.num_experts)  # each use decayed to the expert's last use in this pass
            np.add.at(weights, flat, 0.5 ** ((latest[flat] - at) / LFU_HALF_LIFE))
            last, weight = latest[used], weights[used]
        when = self.tokens_routed + last
        self.token_uses[used] = (
            self.token_uses[used] * 0.5 ** ((when - self.token_used_at[used]) / LFU_HALF_LIFE) + weight
        )
        self.token_used_at[used] = when
        self.tokens_routed += tokens

    def ages_and_uses(self, never: float) -> tuple[np.ndarray, np.ndarray]:
        """Per expert, as of the layer's latest token: tokens since its last use (`never` if it has no
        use on record) and its use count decayed to now, per token (what the next-use head reads, as
        `training.next_use.history` computes it from traces)."""
        self._fold()
        now = float(self.tokens_routed - 1)
        age = np.where(self.token_uses > 0, now - self.token_used_at, never)
        return age, self.token_uses * 0.5 ** ((now - self.token_used_at) / LFU_HALF_LIFE)
