"""Two-tier mode: misses read in place from host memory, hits computed on device slots, no host sync.

Where the GPU has memory of its own (CUDA) and the host holds every expert, a missing expert need not
be read from disk after the host learned the routing (the per-layer path, `per_layer/per_layer_runtime.py`: a
host round
trip per layer with a miss). Here each MoE layer has one stack per weight array (`mapped.py`):
- rows 0..E-1: every expert in host memory, as MLX arrays the GPU reads in place;
- rows E..E+C-1: the layer's C slots, in device memory;
- a lookup table on the device: per expert id the row that holds it (E + its slot where resident, else
  its own row), and whether it is resident.
A pass (`TwoTierSwitch`) computes every routed lane once, with mlx-lm's own switch math on that stack at
the table's rows: bytes cross PCIe only for misses, and the output is stock mlx-lm's, bit for bit (the same
kernel on the same bytes per lane). Nothing in a pass waits for the host: lookups are booked from the ids'
shapes, and what needs the routing itself, the hits and `Admission`'s counts, is added up on the device
(`tally.py`) and read by the host a few passes late, when it is done; `record_routing`'s trace is read
when recording stops. A pass of several positions (prefill, a batch) is staged instead (`staged_passes.py`):
its routed experts copied once into device memory, then computed there, since a lane read in place crosses
PCIe once per lane.
Between passes (at the first MoE layer of the next), admission copies the experts worth a slot from their
host rows into slot rows. MLX writes an array in place only where nothing else holds it, so a fill first
waits for the passes in flight (`mx.synchronize`, once per admission: every `ADMIT_EVERY` positions); a pass
in flight therefore never sees a slot change, and the stack never moves (checked: a copy would leave the
slots' device placement behind).
Each MoE layer's pass enters through `layer_pass` (called by the block, or the switch where the block
stays mlx-lm's), which picks its `layer_step.Plan`: a pass of one position (a decoded token) is one
compiled call per MoE block, else its switch is; other passes run op by op (`_eager`).
Not here: reading the stack (`mapped.py`), choosing what to admit (`admission.py`), the CUDA advice
(`cuda.HostMapping`), or the per-layer path with its prefetch (`per_layer/per_layer_runtime.py`).
"""

import time
import weakref
from collections.abc import Callable, Sequence

import mlx.core as mx
import numpy as np

from ..accounting.ledger import PHASES, Ledger
from ..caching.layer_cache import LayerCache
from ..errors import UserError
from ..model_surgery.switch_over import switch_on
from ..prefetch import governor
from ..runtime import PathFigures, TwoTierMode
from ..storage.store import ExpertStore
from . import slot_fill
from .admission import Admission
from .host_ring import HostRing
from .kept_rows import KeptRows
from .layer_step import (
    CompiledBlock,
    CompileVerdict,
    LayerPass,
    LayerSteps,
    Plan,
    Trace,
    TwoTierSwitch,
    as_routed,
    through_table,
)
from .mapped import follow_moves, read_stacks, release_stacks, stack_addresses
from .settings import TwoTierSettings
from .staged_passes import STAGE_POSITIONS, positions_to_stage, staged_lanes, staged_switch
from .tally import LAG, DeviceTally, RoutingRecord, book_read

# positions decoded between admissions (a prompt's prefill is admitted at once), and at least ADMIT_PASSES
# passes. Even with slots filled by kernels and tables written into host rings, a pass that fills costs
# more than another, and admitting more often buys hit rate but no speed that holds, so admissions stay
# rare. A batch's pass brings the routing of all its sequences, so admission counts positions: counting
# passes, a batch would admit too rarely and miss more; admitting every few passes decoded slower
# (`docs/GPU.md`, "Slots and admission")
ADMIT_EVERY, ADMIT_PASSES = 64, 8


class TwoTierRuntime:
    """What the engine drives in two-tier mode (`runtime.Runtime`), with no reads after load and no
    prefetch."""

    def __init__(
        self, store: ExpertStore, caches: list[LayerCache], stacks: list[dict], admit_every: int = ADMIT_EVERY
    ):
        self.store, self.caches, self.stacks, self.num_experts = store, caches, stacks, caches[0].num_experts
        self.ledger = Ledger(len(caches))
        self.admission = Admission(len(caches), self.num_experts)
        self.admit_every = admit_every
        self.admissions = True  # fill slots between passes; off, the slots stay as loaded or seeded
        self.policy = None  # whose prompt hooks run (`set_policy`)
        self.host_syncs, self.clock, self.phase = 0, 0, "prefill"
        self.mode, self.mode_reason, self.miss_policy = TwoTierMode.ON, "", "load"
        self.tally = DeviceTally(len(caches), self.num_experts, len(PHASES))
        # per layer, (E,) uint32: the stack row of each expert, E + its slot where resident (a hit)
        self._tables: list[mx.array | None] = [None] * len(caches)
        self._resident = np.zeros((len(caches), self.num_experts), dtype=bool)
        self._full = np.zeros(len(caches), dtype=bool)  # every expert of the layer in a slot
        # mlx-lm's switch over each stack (`build`), and its copy for compiled and staged passes
        self.switches, self.steps = [None] * len(caches), [None] * len(caches)
        self._addresses = [stack_addresses(stack) for stack in stacks]
        self.stack_moves = 0  # fills that found a stack copied instead of written in place (want 0)
        # fills between passes as kernels that need no wait (CUDA), else MLX writes after a wait
        self.kernel_fills = slot_fill.KernelFills() if slot_fill.available() else None
        self._landed: dict[int, mx.array] = {}  # layer -> computed once its last kernel fills landed
        self._last_output: mx.array | None = None  # the last MoE layer's output in the last pass
        self._table_ring = HostRing((len(caches), self.num_experts), np.uint32)
        self._dirty = True  # slots changed since the tables were made
        # this pass's routed ids, hit lanes, staged layers' counts (`staged_passes.staged_switch`), by layer
        self._routed, self._hit, self._union = {}, {}, {}
        self.stage_positions = STAGE_POSITIONS  # a pass of this many positions or more is staged (`build`)
        self._recording: RoutingRecord | None = None
        self._since_admission, self._admitted_at = 0, 0
        self._prompt_done = False  # a prompt's prefill was counted: admit from it before decoding
        self.kept_rows: KeptRows | None = None  # rows after the slots, filled by prediction
        self.forecast = None  # (source layer, x) -> [(target layer, scores)] (`forecast.py`)
        self.device_lru = False  # the slots are kept on the device (`kept_rows.py`), none by the host
        self.by_block = False  # each MoE block is a `CompiledBlock`, whose call is the layer's pass
        self.open: LayerPass | Trace | None = None  # the layer pass a `CompiledBlock` opened, or its trace
        weakref.finalize(self, release_stacks, stacks)

    # -- the runtime interface (`runtime.Runtime`) -------------------------------------------------
    def set_policy(self, policy, settings=None, experts_per_layer: int = 0):
        """Use `policy`'s prompt hooks (router discovery: `profile`); predictions are not used here."""
        if settings is not None:
            raise UserError(
                f"prefetch policy {policy.name!r} predicts experts for the per-layer path; two-tier mode"
                " admits experts by routing counts: use prefetch 'none' or 'profile', or two_tier=False"
            )
        self.policy = policy

    def close(self):
        self.policy = None

    def reset_counts(self):
        """Zero the ledger (the slots and admission's counts stay)."""
        self.settle()
        self.ledger.reset()
        self.host_syncs = 0

    def start_prompt(self, prompt):
        self._dirty = True  # slots may have changed between requests (a snapshot, seeding)
        if self.policy is not None:
            self.policy.prompt_start(prompt)

    def start_recording(self):
        self._recording = RoutingRecord()

    def stop_recording(self) -> list[dict[int, np.ndarray]]:
        """The routing of every pass since `start_recording`: [{layer: ids (tokens, k)}, ...]."""
        self.settle()
        recording, self._recording = self._recording, None
        return None if recording is None else recording.passes

    def settle(self):
        """Bring every pass's hits into the ledger (and routing, where recorded), waiting for passes."""
        booked = book_read(self.ledger, self.admission, self.tally.read())
        if self._recording is not None and self._recording.read() or booked:
            self.host_syncs += 1
        if self.kept_rows is not None:
            self.kept_rows.book(self.ledger)

    def load(self, cache: LayerCache, ids: Sequence[int], protect: Sequence[int] = ()):
        """Copy experts `ids` of `cache`'s layer from the mapped stack into slots now (profile seeding,
        snapshots, a fully resident start), free slots first, then the most evictable."""
        if self.device_lru:  # the device fills its slots from the routing; the host places nothing
            return
        ids = np.asarray(ids, dtype=np.int64)
        ids = ids[cache.slot_of[ids] < 0]
        if ids.size:
            slots = cache.choose_slots(len(ids), protect=list(protect) + ids.tolist(), clock=self.clock)
            self._fill([(cache, ids, slots)])

    def place(self, cache: LayerCache, expert_in_slot: np.ndarray, arrays: dict | None = None):
        """Put each expert of `expert_in_slot` (-1: empty) into that slot (a snapshot's), empty the rest:
        copied from its host rows, which hold every expert (so `arrays`, a snapshot's bytes, are not read)."""
        cache.restore(np.full(cache.capacity, -1))
        if self.device_lru:
            return
        held = np.asarray(expert_in_slot, dtype=np.int64)
        slots = np.flatnonzero(held >= 0)
        if slots.size:
            self._fill([(cache, held[slots], slots)])

    def slot_arrays(self, cache: LayerCache) -> dict[str, mx.array]:
        """The slot rows of `cache`'s layer by `proj.part` name, as `LayerCache.stacked_arrays` names them."""
        E, C = self.num_experts, cache.capacity
        return {f"{proj}.{name}": rows[E : E + C] for (proj, name), rows in self.stacks[cache.layer].items()}

    def prepare_batches(self, lanes: int):
        """Device-kept rows compile their kernel for every size a pass of up to `lanes` routed lanes takes
        (`KeptRows.compile`)."""
        if self.kept_rows is not None:
            self.kept_rows.compile(lanes)

    def generation_model(self, model):
        """`model` itself: a two-tier pass never waits for the host, so nothing wraps it."""
        return model

    def read_ahead(self):
        """None: two tiers read nothing ahead (every expert is in host memory)."""
        return None

    def figures(self) -> PathFigures:
        """No prefetch and no optimistic passes; whether the device keeps the slots; stacks moved."""
        return PathFigures(
            prefetch=dict(pending=0, **governor.OFF),
            optimistic={"enabled": False, "passes": 0, "missed": 0, "token_miss_rate": 0.0},
            kept_by_device=self.device_lru,
            stack_moves=self.stack_moves,
        )

    # -- a pass: one way in per layer --------------------------------------------------------------
    def layer_pass(self, layer: int, x: mx.array, compute: Callable[[LayerPass], mx.array]) -> mx.array:
        """MoE layer `layer`'s pass of `x`, the one way in (from `CompiledBlock`, else `TwoTierSwitch`): at
        the first layer a pass begins; the plan is picked (`one_position`: a pass of one position as
        compiled calls, else op by op); `compute(step)` computes the layer, its switch in `step` (a
        `LayerPass`, which keeps the routed ids); their lookups are booked; at the last layer the pass
        ends. No host sync."""
        if layer == 0:
            self._begin_pass(x)
        ahead = self.kept_rows is not None and self.phase == "decode"
        if ahead and self.forecast is not None:
            for target, scores in self.forecast(layer, x):
                self.kept_rows.expect(target, scores)
        plan = self.one_position(layer) if x.size == x.shape[-1] else None
        step = LayerPass(plan, lambda x, indices: self._eager(layer, x, indices, ahead))
        y = compute(step)
        self.book_lookups(layer, plan, step.indices, step.outputs)
        return self._end_layer(layer, y)

    def switch(self, layer: int, x: mx.array, indices: mx.array) -> mx.array:
        """What mlx-lm's switch of `layer` gives for `indices` (`TwoTierSwitch`): in the layer pass a block
        opened (`open`: a `CompiledBlock`'s pass, or its trace, which computes only the MLX work), as that
        pass computes; else this call is the layer's pass."""
        steps = self.steps[layer]
        if self.open is not None:
            return self.open.switch(steps, x, indices)
        return self.layer_pass(layer, x, lambda step: step.switch(steps, x, indices))

    def _end_layer(self, layer: int, y: mx.array) -> mx.array:
        """`y`, the layer's output; at the last MoE layer the pass ends, its counts tied to `y`."""
        if layer == len(self.caches) - 1:
            y = self._end_pass(y)
            if self.kernel_fills is not None:  # what a slot fill at the next pass waits for (`_admit`)
                self._last_output = y
        return y

    def one_position(self, layer: int) -> Plan | None:
        """How a pass of one position computes `layer` in one compiled call (`layer_step.Plan`), or None
        where the host decides the rows (device-kept rows on the CPU and Metal, a prompt's pass)."""
        table, stack = self._tables[layer], tuple(self.stacks[layer].values())
        if self._full[layer] and self._direct[layer]:  # every expert in a slot, in expert order: no table
            return Plan(("routed",), as_routed, self._direct[layer])
        if self._full[layer]:
            return Plan(("table",), through_table, (table, *stack))
        if self.kept_rows is not None:  # the rows keep their own call's hits
            fused = self.phase == "decode" and self.kept_rows.fuses()
            return self.kept_rows.plan(layer, table) if fused else None
        if self.stage_positions <= 1:  # each lane's expert copied to the device first (`staged_passes.py`)
            by_kernel = slot_fill.available()
            return Plan(("staged", by_kernel), staged_lanes(by_kernel), (table, *stack), self._keep)
        if self._resident[layer].any():
            return Plan(("table",), through_table, (table, *stack), self._keep)
        return Plan(("routed",), as_routed, stack)  # no expert in a slot: every lane mapped

    def book_lookups(self, layer: int, plan: Plan | None, indices: mx.array, outputs: tuple):
        """Count a layer pass's lookups, keep its routed ids (admission's counts, recording) and what `plan`
        keeps of its outputs."""
        lanes, full = indices.size, self._full[layer]
        self.ledger.count_lookups(self.phase, layer, lanes, lanes if full else 0)  # else: from the device
        if not full or self._recording is not None:
            self._routed[layer] = indices
        if plan is not None and plan.finish is not None:
            plan.finish(layer, outputs)

    def _keep(self, layer: int, outputs: tuple):
        """A one-position pass's outputs: a staged pass's counts first, the hit lanes last."""
        if len(outputs) == 2:
            self._union[layer] = outputs[0]
        if self._resident[layer].any():
            self._hit[layer] = outputs[-1]

    def _eager(self, layer: int, x: mx.array, indices: mx.array, ahead: bool) -> mx.array:
        """A layer pass op by op (several positions; rows the host decides): each lane's row, then the
        switch on them, or on device copies of the experts routed (staged, `staged_passes.py`)."""
        steps, rows, stack, E = self.steps[layer], self._tables[layer], self.stacks[layer], self.num_experts
        stacked = self.switches[layer]
        if self._full[layer]:
            views = self._direct[layer]
            return steps.compute(views, x, indices) if views else stacked(x, rows[indices])
        read = indices  # no expert in a slot: every lane mapped
        if self.kept_rows is not None:  # each lane's row (after copies, if any), and hits before them
            rows, read, hit = self.kept_rows.lanes(layer, rows, indices, copy=ahead)
            if hit is not None:  # else the rows count their own call's hits
                self._hit[layer] = hit
        elif self._resident[layer].any():
            read = rows[indices]
            self._hit[layer] = read >= E
        if indices.size >= self.stage_positions * indices.shape[-1]:  # each expert across PCIe once
            y, self._union[layer] = staged_switch(steps, stack, rows, x, indices, E)
            return y
        return stacked(x, read)

    def _begin_pass(self, x: mx.array):
        self.tally.launch()  # the last pass's counts, queued after it
        tokens = x.size // x.shape[-1]
        self.phase = "decode" if x.ndim < 2 or x.shape[-2] == 1 else "prefill"
        self.clock += 1
        self.ledger.count_forward(self.phase, tokens)
        self._since_admission += tokens  # positions, and passes in `clock`
        due = self._since_admission >= self.admit_every and self.clock - self._admitted_at >= ADMIT_PASSES
        if self.admissions and due:
            # passes LAG back are done in a pipelined loop (mlx-lm waits for each token two passes on)
            self._admit(self.tally.read(done_by=self.clock - LAG))
        elif self.admissions and self._prompt_done and self.phase == "decode":
            self._admit(self.tally.read())  # the prompt's routing: prefill was waited for anyway
        elif due and self.kept_rows is not None:  # device-kept rows' counts, for a server's live figures
            self.kept_rows.book(self.ledger, lagged=True)
            self._since_admission, self._admitted_at = 0, self.clock
        self._prompt_done = False
        if self._dirty:
            self._refresh()
            self._dirty = False
        self._routed, self._hit, self._union = {}, {}, {}

    def _end_pass(self, y: mx.array) -> mx.array:
        # the routing counts feed admission alone: none is made where it is off (device-kept rows)
        counted = {i: ids for i, ids in self._routed.items() if not self._full[i]} if self.admissions else {}
        self.tally.add(self.clock, PHASES.index(self.phase), counted, self._hit, self._union)
        y = self.tally.tie(y) if self.phase == "decode" else y  # computed with the token, not on their own
        if self.kept_rows is not None:
            self.kept_rows.end_pass()
        if self._recording is not None:
            self._recording.add(self._routed)
        self._prompt_done = self._prompt_done or self.phase == "prefill"
        self._routed, self._hit, self._union = {}, {}, {}
        return y

    def _refresh(self):
        """Remake the device tables after slots changed (admission, seeding, a snapshot): all layers' rows
        written into a host array the device reads (`HostRing`: no array made from host bytes), copied
        into device memory once, each layer's tables views of that copy."""
        E = self.num_experts
        slot_of = np.stack([c.slot_of for c in self.caches])
        resident = slot_of >= 0
        rows = self._table_ring.write(np.where(resident, E + slot_of, np.arange(E))) + 0
        self._table_ring.used_by(rows)
        self._resident, self._full = resident, resident.all(axis=1)
        self._tables = [rows[i] for i in range(len(self.caches))]
        in_order = self._full & (slot_of == np.arange(E)).all(axis=1)
        in_order[list(self._landed)] = False  # their slots wait for fills the views would not wait for
        self._direct = [  # the slot rows alone (views: nothing copied)
            tuple(part[E:] for part in stack.values()) if ok else None
            for stack, ok in zip(self.stacks, in_order)
        ]
        for layer, landed in self._landed.items():  # this pass reads those slots only once they are filled
            self._tables[layer] = rows[layer] + (landed * 0).astype(mx.uint32)
        self._landed = {}
        mx.async_eval(self._tables, [d for d in self._direct if d is not None])  # not in a pass

    # -- between passes ----------------------------------------------------------------------------
    def _admit(self, read):
        """Book a tally read, then copy into slots the experts `Admission` names."""
        if not book_read(self.ledger, self.admission, read):
            return
        self._since_admission, self._admitted_at = 0, self.clock
        fills = [
            (cache, *self.admission.swaps(i, cache.expert_in_slot)) for i, cache in enumerate(self.caches)
        ]
        fills = [f for f in fills if f[1].size]
        if fills and self.kernel_fills is not None and self._last_output is not None:
            self._fill_by_kernels(fills, self._last_output)
        elif fills:
            self._fill(fills)

    def _fill_by_kernels(self, fills: list[tuple[LayerCache, np.ndarray, np.ndarray]], after: mx.array):
        """`_fill` with no wait (CUDA, `slot_fill.py`): the copies run on MLX's stream after `after`, the
        last pass's last MoE output (so after every read of the slots they overwrite), and the tables of
        the layers filled are made from them (`_refresh`)."""
        t0 = time.perf_counter()
        self._landed.update(self.kernel_fills.fill_layers(self.stacks, fills, self.num_experts, after))
        _book_fills(self.ledger, self.phase, fills, (time.perf_counter() - t0) / len(fills))
        self._dirty = True  # the tables are out of date

    def _fill(self, fills: list[tuple[LayerCache, np.ndarray, np.ndarray]]):
        """For each (cache, ids, slots): copy experts `ids` from their host rows into the rows of `slots`
        in the same stacks, in place, and do the caches' bookkeeping."""
        t0 = time.perf_counter()
        self._last_output = None  # it holds the last pass's graph, and with it a stack
        slot_fill.write_after_wait(self.stacks, fills, self.num_experts)
        for cache, _, _ in fills:
            layer = cache.layer
            self.stack_moves += follow_moves(self.stacks[layer], self._addresses[layer], self.num_experts)
        _book_fills(self.ledger, self.phase, fills, (time.perf_counter() - t0) / len(fills))
        self._dirty = True  # the tables are out of date


def _book_fills(ledger: Ledger, phase: str, fills, seconds: float):
    """The caches' slots and the ledger after `fills` (cache, ids, slots) were copied."""
    for cache, ids, slots in fills:
        held = cache.expert_in_slot.copy()
        evicted = int((held[slots] >= 0).sum())
        held[slots] = ids
        cache.restore(held)
        ledger.add(phase, cache.layer, installed=len(ids), evictions=evicted, install_s=seconds)


def build(store: ExpertStore, blocks, caches: list[LayerCache], settings: TwoTierSettings, progress=None):
    """Read every layer's stack (`progress.update(bytes)` as it goes), make the runtime and put a
    `TwoTierSwitch` where each block's switch was. `caches` were made over the blocks' switches; their own
    slot arrays are given back (the slots are the stacks' last rows). `settings.lookahead_rows`: device rows
    per layer after the slots, kept on the device (`kept_rows.py`: filled by the layer's misses).
    `settings.kept_by_device`: the slots themselves are such rows (the host's caches stay empty, admission
    off), unless every expert fits in them."""
    lookahead_rows = settings.lookahead_rows
    device_lru = settings.kept_by_device and caches[0].capacity < caches[0].num_experts
    rows = [max(1, cache.capacity + lookahead_rows) for cache in caches]  # one in device memory at least
    stacks = read_stacks(store, [(c.layout, c.targets, n) for c, n in zip(caches, rows)], progress)
    runtime = TwoTierRuntime(store, caches, stacks, settings.admit_every or ADMIT_EVERY)
    runtime.mode = TwoTierMode.LRU if settings.kept_by_device else TwoTierMode.ON
    runtime.mode_reason = settings.mode_reason
    runtime.by_block = all(block.owner is not None for block in blocks)
    held = rows[0] if device_lru else caches[0].capacity + lookahead_rows  # expert rows in device memory
    runtime.stage_positions = settings.stage_positions or positions_to_stage(
        caches[0].layout.expert_nbytes, held
    )
    runtime.admissions = settings.admissions
    if device_lru:
        slots, kept = [0] * len(caches), rows[0]
        runtime.admissions, runtime.device_lru = False, True
    else:
        slots, kept = [c.capacity for c in caches], lookahead_rows
    if kept:
        runtime.kept_rows = KeptRows(stacks, runtime.num_experts, slots, kept, kept)
    verdict = CompileVerdict()  # shared: the first block that fuses otherwise sends all op by op
    for i, (block, cache, stack) in enumerate(zip(blocks, caches, stacks)):
        runtime.switches[i] = switch_on(block.switch, stack)
        runtime.steps[i] = LayerSteps(runtime.switches[i], stack)
        block.replace_switch(TwoTierSwitch(runtime.switches[i], runtime, i))
        if runtime.by_block:
            block.replace_block(CompiledBlock(block.block, runtime, i, tuple(stack.values()), verdict))
        for part in cache.layout.parts:
            cache.projections[part.proj][part.name] = mx.zeros(
                (0, *part.shape), dtype=stack[part.proj, part.name].dtype
            )
    runtime._refresh()
    mx.eval(runtime._tables)  # before another thread
    return runtime
