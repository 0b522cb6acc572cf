"""Two-tier mode: misses read in place from host memory, hits computed on device slots, no host sync.

Where the GPU has memory of its own (CUDA) and the host holds every expert, a missing expert need not
be read from disk after the host learned the routing (the per-layer path, `runtime.py`: a host round
trip per layer with a miss). Here each MoE layer has:
- the mapped stack: every expert in host memory as MLX arrays the GPU reads in place (`mapped.py`), plus
  a row of zeros kept on the device;
- C device slots: mlx-lm's own switch with C stacked experts (`LayerCache` holds them and says which
  expert sits where);
- lookup tables on the device: per expert id its slot (0 where absent), its row of the mapped stack (the
  zero row where resident) and whether it is resident.
A pass (`TwoTierSwitch`) computes every routed lane twice with mlx-lm's own switch math, once on the
slots and once on the mapped stack, and keeps per lane the one that holds the expert (`mx.where`): a
hit's mapped lane reads only the device's zero row and a miss's slot lane reads slot 0, so bytes cross
PCIe only for misses. A layer with every expert resident computes on the slots alone (the plain resident
path), one with none on the mapped stack alone. The output is stock mlx-lm's, bit for bit: the same
kernels on the same bytes per lane. Nothing in a pass waits for the host: lookups are booked from the
ids' shapes, and what needs the routing itself, the hits and `Admission`'s counts, is added up on the
device (`tally.py`) and read by the host a few passes late, when it is done; `record_routing`'s trace is
read when recording stops.
Between passes (at the first MoE layer of the next), admission copies the experts worth a slot from the
mapped stack with MLX slice updates, ordered on MLX's stream after the passes already launched, so no
pass in flight sees a slot change. Measured on an H100 (`tools/two_tier_probe.py`, 8 Qwen3-30B-shaped
layers): 1.51 / 3.38 / 5.48 / 10.4 ms a token at hit rates 1 / 0.75 / 0.5 / 0, exact.
Not here: reading the stack (`mapped.py`), choosing what to admit (`admission.py`), the CUDA advice
(`cuda.HostMapping`), or the per-layer path with its prefetch (`runtime.py`).
"""

import time
import weakref
from collections.abc import Sequence
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .admission import Admission
from .cache import LayerCache
from .errors import UserError
from .mapped import read_stack, release_stack
from .policies import OnDemand
from .stats import PHASES, Ledger
from .store import ExpertStore
from .switch import switch_on
from .tally import DeviceTally

# passes between admissions (a prompt's prefill is admitted at once). Admitting often did not pay on the
# H100 (`benchmarks/two_tier.py`, 25% of experts in slots, widened x128 copy): every 8 passes against slots
# frozen after a warm-up prompt ran 0.56x against 0.66x stock on one machine and 0.44x against 0.43x on
# another, with hit rates 0.61 against 0.47: within the spread between machines, so host reads stay rare
ADMIT_EVERY = 64
LAG = 3  # a pass this many passes back is done when the next is built in mlx-lm's pipelined loop


class TwoTierSwitch(nn.Module):
    """Drop-in `switch_mlp`: hits on the device slots (`inner`), misses on the mapped stack."""

    def __init__(self, inner: nn.Module, mapped: nn.Module, runtime: "TwoTierRuntime", layer: int):
        super().__init__()
        self.inner = inner
        self.layer = layer
        object.__setattr__(self, "mapped", mapped)  # not a child: the stack is no parameter of the model
        object.__setattr__(self, "runtime", runtime)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        return self.runtime.compute(self.layer, self.inner, self.mapped, x, indices)


class _Tables(NamedTuple):
    slots: mx.array  # (E,) uint32: the slot of each expert, 0 where absent
    rows: mx.array  # (E,) uint32: the mapped row of each expert, E (the zero row) where resident
    hit: mx.array  # (E,) bool


class TwoTierRuntime:
    """What the engine drives in two-tier mode: the same interface as `OffloadRuntime` where the engine
    uses it (ledger, caches, settle, recording, policy), with no reads after load and no prefetch."""

    miss_policy = "load"
    two_tier = True

    def __init__(
        self, store: ExpertStore, caches: list[LayerCache], stacks: list[dict], admit_every: int = ADMIT_EVERY
    ):
        self.store, self.caches, self.stacks = store, caches, stacks
        self.num_experts = caches[0].num_experts
        self.ledger = Ledger(len(caches))
        self.admission = Admission(len(caches), self.num_experts)
        self.admit_every = admit_every
        self.admissions = True  # fill slots between passes; off, the slots stay as loaded or seeded
        self.policy = OnDemand()
        self.taps: list = [None] * len(caches)
        self.governor = self.settings = None
        self.optimistic, self.optimistic_passes, self.optimistic_misses = False, 0, 0
        self.token_miss_rate, self.host_syncs, self.copy_installs = 0.0, 0, False
        self.clock, self.phase = 0, "prefill"
        self.tally = DeviceTally(len(caches), self.num_experts, len(PHASES))
        self._tables: list[_Tables | None] = [None] * len(caches)
        self._resident = np.zeros((len(caches), self.num_experts), dtype=bool)
        self._dirty = True  # slots changed since the tables were made
        self._routed: dict[int, mx.array] = {}
        self._hit: dict[int, mx.array] = {}
        self._recording: list | None = None
        self._recorded: list[tuple[mx.array, int]] = []  # (pass's ids (layers, lanes), k), lazy
        self._since_admission = 0
        self._prompt_done = False  # a prompt's prefill was counted: admit from it before decoding
        weakref.finalize(self, _release, stacks)

    # -- the engine's interface ------------------------------------------------------------------
    def set_policy(self, policy, settings=None, experts_per_layer: int = 0):
        """Use `policy`'s prompt hooks (router discovery: `profile`); predictions are not used here."""
        if settings is not None:
            raise UserError(
                f"prefetch policy {policy.name!r} predicts experts for the per-layer path; two-tier mode "
                "admits experts from their routing counts: use prefetch 'none' or 'profile', or "
                "two_tier=False"
            )
        self.policy = policy

    def close(self):
        self.policy = OnDemand()

    def reset_counts(self):
        """Zero the ledger (the slots and admission's counts stay)."""
        self.settle()
        self.ledger.reset()
        self.host_syncs = 0

    def start_prompt(self, prompt):
        self._dirty = True  # slots may have changed between requests (a snapshot, seeding)
        self.policy.prompt_start(prompt)

    def start_recording(self):
        self._recording = []

    def stop_recording(self) -> list[dict[int, np.ndarray]]:
        """The routing of every pass since `start_recording`: [{layer: ids (tokens, k)}, ...]."""
        self.settle()
        recording, self._recording = self._recording, None
        return recording

    def optimistic_ok(self) -> bool:
        return False  # no pass here waits for the host: nothing to run optimistically

    def settle(self):
        """Bring every pass's hits into the ledger (and the trace, where recording), waiting for passes
        still computing."""
        if self._book(self.tally.read()) or self._recorded:
            self.host_syncs += 1
        if self._recorded:
            mx.eval([ids for ids, _ in self._recorded])
            for ids, k in self._recorded:
                routed = np.array(ids).astype(np.int64)
                self._recording.append({i: row.reshape(-1, k) for i, row in enumerate(routed)})
            self._recorded = []

    def load(self, cache: LayerCache, ids: Sequence[int], protect: Sequence[int] = (), **_):
        """Copy experts `ids` of `cache`'s layer from the mapped stack into slots now (profile seeding,
        snapshots, a fully resident start), free slots first, then the most evictable."""
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[cache.slot_of[ids] < 0]
        if ids.size:
            slots = cache.choose_slots(len(ids), protect=list(protect) + ids.tolist(), clock=self.clock)
            self._fill(cache, ids, slots)

    # -- a pass --------------------------------------------------------------------------------
    def compute(self, layer: int, inner: nn.Module, mapped: nn.Module, x: mx.array, indices: mx.array):
        """One MoE layer's experts for `indices`: what mlx-lm's switch would give, with no host sync."""
        if layer == 0:
            self._begin_pass(x)
        cache = self.caches[layer]
        tables = self._tables[layer]
        lanes = indices.size
        if tables is None:  # every expert resident (slots in id order: the plain resident path)
            y = inner(x, cache.routed_slots(indices))
            self.ledger.count_lookups(self.phase, layer, lanes, lanes)
        else:
            self._routed[layer] = indices
            self.ledger.count_lookups(self.phase, layer, lanes, 0)  # hits come from the device
            if not self._resident[layer].any():
                y = mapped(x, indices)
            else:
                hit = self._hit[layer] = tables.hit[indices]
                on_slots = inner(x, tables.slots[indices])
                in_place = mapped(x, tables.rows[indices])
                y = mx.where(hit[..., None], on_slots, in_place)
        if self._recording is not None:
            self._routed.setdefault(layer, indices)
        if layer == len(self.caches) - 1:
            self._end_pass(indices.shape[-1])
        return y

    def _begin_pass(self, x: mx.array):
        self.tally.launch()  # the last pass's counts, queued after it
        tokens = x.size // x.shape[-1]
        self.phase = "decode" if x.ndim < 2 or x.shape[-2] == 1 else "prefill"
        self.clock += 1
        self.ledger.count_forward(self.phase, tokens)
        self._since_admission += 1
        if self.admissions and self._since_admission >= self.admit_every:
            # passes LAG back are done in a pipelined loop (mlx-lm waits for each token two passes on)
            self._admit(self.tally.read(done_by=self.clock - LAG))
        elif self.admissions and self._prompt_done and self.phase == "decode":
            self._admit(self.tally.read())  # the prompt's routing: prefill was waited for anyway
        self._prompt_done = False
        if self._dirty:
            self._refresh()
            self._dirty = False
        self._routed, self._hit = {}, {}

    def _end_pass(self, k: int):
        counted = {i: ids for i, ids in self._routed.items() if self._tables[i] is not None}
        self.tally.add(self.clock, PHASES.index(self.phase), counted, self._hit)
        if self._recording is not None:
            ids = mx.stack([self._routed[i].reshape(-1) for i in range(len(self.caches))])
            self._recorded.append((ids, k))
        self._prompt_done = self._prompt_done or self.phase == "prefill"
        self._routed, self._hit = {}, {}

    def _refresh(self):
        """Remake the device tables after slots changed (admission, seeding, a snapshot): two host-to-device
        arrays for all layers, not three per layer (fewer transfers; their cost on CUDA was not measured
        apart), each layer's tables views of them; a layer with every expert in slots needs none."""
        E, L = self.num_experts, len(self.caches)
        resident = np.stack([c.slot_of >= 0 for c in self.caches])
        full = [bool(resident[i].all()) and c.capacity == E for i, c in enumerate(self.caches)]
        slot_of = np.stack([c.slot_of for c in self.caches])
        indices = np.stack([np.where(resident, slot_of, 0), np.where(resident, E, np.arange(E))], axis=1)
        block, hits = mx.array(indices.astype(np.uint32)), mx.array(resident)
        self._resident = resident
        self._tables = [None if full[i] else _Tables(block[i, 0], block[i, 1], hits[i]) for i in range(L)]

    # -- between passes ----------------------------------------------------------------------------
    def _book(self, read) -> bool:
        """Put a tally read into the ledger (hits) and admission (counts); False where there was none."""
        if read is None:
            return False
        passes, counts, hits = read
        for p, phase in enumerate(PHASES):
            for layer in np.flatnonzero(hits[p]):
                self.ledger.count_lookups(phase, int(layer), 0, int(hits[p, layer]))
        self.admission.add(counts, passes)
        return True

    def _admit(self, read):
        """Book a tally read, then copy into slots the experts `Admission` names, every layer's indices in
        one host-to-device array."""
        if not self._book(read):
            return
        self._since_admission = 0
        fills = [
            (cache, *self.admission.swaps(i, cache.expert_in_slot)) for i, cache in enumerate(self.caches)
        ]
        fills = [f for f in fills if f[1].size]
        if not fills:
            return
        both = mx.array(
            np.concatenate([np.stack([ids, slots]) for _, ids, slots in fills], axis=1).astype(np.int32)
        )
        start = 0
        for cache, ids, slots in fills:
            self._fill(cache, ids, slots, both[:, start : start + len(ids)])
            start += len(ids)

    def _fill(self, cache: LayerCache, ids: np.ndarray, slots: np.ndarray, index: mx.array | None = None):
        """MLX slice updates from the mapped stack into the slots (lazy: the next pass evaluates them,
        after those launched before it), and the cache's bookkeeping. `index`: (2, n) int32 ids and
        slots already on the device."""
        t0 = time.perf_counter()
        stack = self.stacks[cache.layer]
        if len(ids) == 1:
            to, source = int(slots[0]), int(ids[0])
        elif index is not None:
            source, to = index[0], index[1]
        else:
            to, source = mx.array(slots.astype(np.int32)), mx.array(ids.astype(np.int32))
        for (proj, name), rows in stack.items():
            held = cache.projections[proj][name]
            held[to] = rows[source]  # in place: the module holds this same array
        held = cache.expert_in_slot.copy()
        evicted = int((held[slots] >= 0).sum())
        held[slots] = ids
        cache.restore(held)
        self._dirty = True
        self.ledger.add(
            self.phase, cache.layer, installed=len(ids), evictions=evicted, install_s=time.perf_counter() - t0
        )


def _release(stacks):
    for stack in stacks:
        release_stack(stack)


def build(store: ExpertStore, blocks, caches: list[LayerCache], progress=None) -> TwoTierRuntime:
    """Read every layer's mapped stack (`progress.update(bytes)` as it goes), make the runtime and put a
    `TwoTierSwitch` where each block's switch was. `caches` were made over the blocks' switches."""
    stacks = [read_stack(store, cache.layout, cache.targets, progress) for cache in caches]
    runtime = TwoTierRuntime(store, caches, stacks)
    for i, (block, stack) in enumerate(zip(blocks, stacks)):
        block.replace_switch(TwoTierSwitch(block.switch, switch_on(block.switch, stack), runtime, i))
    runtime._refresh()
    return runtime
