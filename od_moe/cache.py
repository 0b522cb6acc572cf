"""Resident expert cache of one MoE layer: C stacked slots, a total lookup table, pinning and eviction.

The stacked `(C, ...)` arrays live inside the layer's own mlx-lm switch projections (`gate_proj.weight`
and friends), replacing the `(E, ...)` originals, so mlx-lm's `SwitchGLU` computes on them unchanged once
expert ids are remapped to slots. Bookkeeping is numpy on the generation thread:
- `slot_of[e]`: the slot holding expert e, or -1. The lookup table handed to MLX maps every id to a
  valid slot (non-resident ids to slot 0): `gather_qmm` does no bounds check.
- per slot: the expert in it, pinned flag, last use and who put it there; per expert: its decayed use
  count, kept while it is evicted (LFU remembers an expert that comes back, as Belady's MIN would).
Eviction never touches pinned slots or the experts the running layer needs. Methods return what happened
(slots used, evictions, first uses of prefetched experts) and the runtime books it in the ledger. Not
here: deciding when to read (`runtime.py`), counting (`stats.py`), how bytes come off disk (`store.py`).
"""

from collections.abc import Sequence
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from . import backend, cuda
from .layout import BlockLayout, flat_rows

EVICTION_POLICIES = ("lru", "lfu")
LFU_HALF_LIFE = 64.0  # forward passes after which an expert's use count has halved
FOLD_PASSES = 256  # passes of routing noted at most before they are added to the history (bounds the list)


class Installed(NamedTuple):
    slots: np.ndarray
    evictions: int
    unused_prefetches: int  # evicted experts that were prefetched and never used


# safetensors dtypes whose bytes are already the in-memory representation of an MLX dtype
SAME_BYTES = {
    "F64": mx.float64,
    "F32": mx.float32,
    "F16": mx.float16,
    "BF16": mx.bfloat16,
    "U32": mx.uint32,
    "I32": mx.int32,
    "U16": mx.uint16,
    "I16": mx.int16,
    "U8": mx.uint8,
    "I8": mx.int8,
    "U64": mx.uint64,
    "I64": mx.int64,
    "BOOL": mx.bool_,
}


def _host_bits(raw: np.ndarray, disk_dtype: str, target: mx.Dtype):
    """`raw` converted to `target`'s in-memory bytes with numpy, where that is exact; else None."""
    if SAME_BYTES.get(disk_dtype) == target:
        return raw
    if target == mx.float32 and disk_dtype == "BF16":
        return raw.astype(np.uint32) << 16  # bfloat16 is the high half of a float32
    if target == mx.float32 and disk_dtype == "F16":
        return raw.astype(np.float32)
    return None


class LayerCache:
    """The resident experts of one MoE layer."""

    def __init__(
        self,
        layer: int,
        projections: dict[str, object],
        layout: BlockLayout,
        capacity: int,
        eviction: str = "lru",
    ):
        if eviction not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {eviction!r}")
        self.layer = layer
        self.layout = layout
        self.num_experts = E = layout.num_experts
        self.capacity = C = capacity
        self.eviction = eviction
        self.projections = projections
        self.targets = {}
        for part in layout.parts:
            module = projections[part.proj]
            original = module[part.name]
            if tuple(original.shape[1:]) != tuple(part.shape):
                raise ValueError(
                    f"{layout.module_path}.{part.proj}.{part.name}: model expects {original.shape[1:]}, "
                    f"file has {part.shape}"
                )
            self.targets[(part.proj, part.name)] = original.dtype
            module[part.name] = mx.zeros((C, *part.shape), dtype=original.dtype)
        mx.eval([projections[p.proj][p.name] for p in layout.parts])
        self.slot_of = np.full(E, -1, dtype=np.int64)
        self.expert_in_slot = np.full(C, -1, dtype=np.int64)
        self.pinned = np.zeros(C, dtype=bool)
        self.last_use = np.zeros(C, dtype=np.float64)
        self.uses = np.zeros(E, dtype=np.float64)  # decayed use count of every expert, resident or not
        self.used_at = np.zeros(E, dtype=np.float64)  # when `uses` was last brought up to date
        # the routing history the next-use head reads, in tokens (a prefill pass is many): per expert the
        # token of its last use and its use count decayed to then, as training computes them per token
        self.tokens_routed = 0
        self.token_used_at = np.zeros(E, dtype=np.float64)
        self.token_uses = np.zeros(E, dtype=np.float64)
        self.history_version = 0  # counts changes of that history (what `use_history` reads)
        self._unfolded: list[np.ndarray] = []  # passes noted and not yet added to it
        self.unused_prefetch = np.zeros(C, dtype=bool)  # installed by prefetch, not used yet
        self.arrived_by_prefetch = np.zeros(C, dtype=bool)  # who put the expert there (for display)
        self.host_writes = True  # False once the backend or a dtype rules out writes from host bytes
        self._writers = {}  # (proj, part) -> (stacked array, what writes its rows from host bytes)
        self._changed()

    # -- state ---------------------------------------------------------------------------------
    @property
    def slot_nbytes(self) -> int:
        """Bytes one slot holds in memory (all parts, in their in-memory dtypes)."""
        return sum(int(np.prod(p.shape)) * self.targets[(p.proj, p.name)].size for p in self.layout.parts)

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

    def note_routing(self, ids: np.ndarray):
        """Add a pass's routing, (tokens, k) expert ids in token order, to the per-token history. It is
        folded in when the history is next read (or `FOLD_PASSES` wait): noting a pass costs a list
        append, which is all it costs while nothing reads the history (prefetch paused)."""
        self._unfolded.append(np.asarray(ids).reshape(-1, np.shape(ids)[-1]))
        self.history_version += 1
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

    def use_history(self, never: float) -> tuple[np.ndarray, np.ndarray]:
        """Per expert, as of the layer's latest token: tokens since its last use (`never` if it has no
        use on record) and its use count decayed to now, per token (what the next-use head reads, as
        `training.next_use.history` computes it from traces)."""
        self._fold()
        now = float(self.tokens_routed - 1)
        age = np.where(self.token_uses > 0, now - self.token_used_at, never)
        return age, self.token_uses * 0.5 ** ((now - self.token_used_at) / LFU_HALF_LIFE)

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

    def _blocked(self, protect: Sequence[int]) -> np.ndarray:
        """Slots that may not be evicted: pinned ones and those holding `protect`."""
        blocked = self.pinned.copy()
        held = self.slot_of[np.asarray(protect, dtype=np.int64)] if len(protect) else np.empty(0, np.int64)
        blocked[held[held >= 0]] = True
        return blocked

    def room(self, protect: Sequence[int] = ()) -> int:
        """How many experts can be installed without evicting pinned slots or `protect`."""
        return int((~self._blocked(protect)).sum())

    def choose_slots(
        self, n: int, protect: Sequence[int], clock: float, next_use: np.ndarray | None = None
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

    def evictable(self, clock: float, protect: Sequence[int] = (), next_use: np.ndarray | None = None):
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
        ids: Sequence[int],
        raw: dict[tuple[str, str], np.ndarray],
        prefetched: bool = False,
        protect: Sequence[int] = (),
        clock: float = 0.0,
        arrays: list[mx.array | None] | None = None,
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
        layer's computation evaluates (`_write_mlx`). Either way the staging buffers may be reused as soon
        as this returns.
        """
        ids = np.asarray(ids, dtype=np.int64)
        if np.any(self.slot_of[ids] >= 0):
            raise ValueError(
                f"layer {self.layer}: experts {ids[self.slot_of[ids] >= 0].tolist()} are already resident"
            )
        slots = self.choose_slots(
            len(ids), protect=list(protect) + ids.tolist(), clock=clock, next_use=next_use
        )
        if not (self.host_writes and self._write_host(slots, raw, synchronize)):
            self.host_writes = False
            self._write_mlx(slots, raw, arrays)
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

    def _row_writer(self, part):
        """What writes a part's stacked array from host bytes (`backend.row_writer`), kept while that array
        stays the module's."""
        array = self.projections[part.proj][part.name]
        kept = self._writers.get((part.proj, part.name))
        if kept is None or kept[0] is not array:
            kept = self._writers[(part.proj, part.name)] = (array, backend.row_writer(array))
        return kept[1]

    def _write_host(self, slots: np.ndarray, raw, synchronize: bool = True) -> bool:
        """Copy expert bytes into the slots' memory with no MLX operation (numpy views of host memory, or
        the CUDA runtime's copies); False where that is impossible, or failed (nothing half-written stays:
        the caller writes every slot again through MLX)."""
        writes = []
        for part in self.layout.parts:
            key = (part.proj, part.name)
            writer = self._row_writer(part)
            rows = [_host_bits(raw[key][j], part.dtype, self.targets[key]) for j in range(len(slots))]
            if writer is None or any(r is None for r in rows):
                return False
            writes.append((writer, [np.ascontiguousarray(r).view(writer.dtype) for r in rows]))
        if synchronize:
            mx.synchronize()  # nothing still computing may read the rows about to change
        try:
            for writer, rows in writes:
                for slot, row in zip(slots.tolist(), rows):
                    writer[slot] = row
        except cuda.CopyError:  # copies went off since (a failed install): nothing of this one was queued
            return False
        first = self.layout.parts[0]
        return backend.rows_written(
            (self.projections[first.proj][first.name], int(slots[0]), writes[0][1][0])
        )

    def _write_mlx(self, slots: np.ndarray, raw, arrays=None):
        """Put expert bytes into the slots with MLX operations (backends without host-visible memory): one
        (experts, bytes) array for the whole install (stacked from the reader's flat arrays where it made
        them all, else one host-to-device copy of the rows), then per part a view of its columns written
        with one slice update (one expert) or one scatter. No host sync: the computation that reads the
        slots evaluates them. The array holds its own copy of the bytes, so staging may be reused at
        once."""
        n = len(slots)
        if arrays is not None and all(a is not None for a in arrays):
            flat = arrays[0][None] if n == 1 else mx.stack(arrays)
        else:
            # not advised for the device (`backend.stage_for_device`): MLX recycles its buffer
            flat = mx.array(flat_rows(self.layout, raw, n))
        index = int(slots[0]) if n == 1 else mx.array(slots.astype(np.int32))
        for (proj, name), rows in self._part_rows(flat, n).items():
            stacked = self.projections[proj][name]
            stacked[index] = rows[0] if n == 1 else rows  # in place: the module holds this same array

    def _part_rows(self, flat: mx.array, n: int) -> dict[tuple[str, str], mx.array]:
        """Per part, the rows of `n` experts' flat bytes (`flat_rows` order) as arrays shaped and typed as
        the slots are (lazy views and casts of `flat`)."""
        out, offset = {}, 0
        for part in self.layout.parts:
            key = (part.proj, part.name)
            rows = flat[:, offset : offset + part.nbytes].view(SAME_BYTES[part.dtype]).reshape(n, *part.shape)
            out[key] = rows if rows.dtype == self.targets[key] else rows.astype(self.targets[key])
            offset += part.nbytes
        return out

    def scratch_rows(self, raw, count: int) -> dict[tuple[str, str], mx.array]:
        """Per part, `count` experts' bytes as read (by part) as rows shaped and typed as the slots' (the
        bytes are copied: the read's buffers may be reused at once)."""
        return self._part_rows(mx.array(flat_rows(self.layout, raw, count)), count)

    def with_scratch(self, chunks: list[dict]) -> dict[tuple[str, str], mx.array]:
        """Per part, the slots followed by the `scratch_rows` of `chunks`: the stacks a layer computes on
        once when its routed experts do not all fit in the slots (row C + j is the j-th scratch expert).
        Lazy; the slots themselves stay as they are."""
        return {
            (p, n): mx.concatenate([self.projections[p][n], *(c[(p, n)] for c in chunks)])
            for p, n in chunks[0]
        }

    def forget_prefetches(self):
        """Count every resident expert as used (statistics restart; the experts stay)."""
        self.unused_prefetch[:] = False

    def pin(self, ids: Sequence[int]):
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
        return {f"{p.proj}.{p.name}": self.projections[p.proj][p.name] for p in self.layout.parts}

    def restore(self, expert_in_slot: np.ndarray, arrays: dict[str, mx.array] | None = None):
        """Declare which expert each slot holds (-1: empty), after its bytes were put there: `arrays`
        (by `proj.part` name, shaped and typed as `stacked_arrays()`) replace the stacked arrays."""
        for name, array in (arrays or {}).items():
            proj, part = name.split(".", 1)
            current = self.projections[proj][part]
            if array is None or array.shape != current.shape or array.dtype != current.dtype:
                raise ValueError(
                    f"layer {self.layer} {name}: the cache holds {current.shape} {current.dtype}, not {array}"
                )
            self.projections[proj][part] = array
        if arrays:
            mx.eval(list(self.stacked_arrays().values()))
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
