"""Two-tier mode: misses read in place from host memory, hits computed on device slots, no host sync.

Where the GPU has memory of its own (CUDA) and the host holds every expert, a missing expert need not
be read from disk after the host learned the routing (the per-layer path, `per_layer/per_layer_runtime.py`:
a host round trip per layer with a miss). Here each MoE layer has one stack per weight array (`mapped.py`),
its rows the tiers an expert can be read from:
- rows 0..E-1, the host tier: every expert in host memory, as MLX arrays the GPU reads in place;
- rows E..E+C-1, the device slots: the layer's C slots, in device memory;
- then, where the device keeps rows of its own (`kept_rows.py`), those rows, in device memory;
- a lookup table on the device: per expert id the row that holds it (E + its slot where resident, else
  its own row).
A pass computes every routed lane once, with mlx-lm's own switch math on that stack at the table's rows:
the tier an expert is in is only the row the table gives it, so no pass branches on it, and bytes cross
PCIe only for misses. The output is stock mlx-lm's, bit for bit (the same kernel on the same bytes per
lane). Nothing in a pass waits for the host: lookups are booked from the ids' shapes, and what needs the
routing itself, the hits and `Admission`'s counts, is added up on the device (`tally.py`) and read by the
host a few passes late, when it is done; `record_routing`'s trace is read when recording stops. A pass of
several positions (prefill, a batch) is staged instead (`staged_passes.py`): its routed experts copied once
into device memory, then computed there, since a lane read in place crosses PCIe once per lane.
Between passes (at the first MoE layer of the next), admission copies the experts worth a slot from their
host rows into slot rows. MLX writes an array in place only where nothing else holds it, so a fill first
waits for the passes in flight (`mx.synchronize`, once per admission: every `AdmissionSettings.every`
positions); a pass in flight therefore never sees a slot change, and the stack never moves (checked: a copy
would leave the slots' device placement behind).
A layer's pass reads top to bottom in `TwoTierRuntime.layer_pass`. The runtime is made once from
`TwoTierSettings` (`settings.py`) by `build`; nothing writes into it afterwards.
Not here: reading the stack (`mapped.py`), choosing what to admit (`admission.py`), what the model's modules
do with a pass (`layer_step.py`), the CUDA advice (`cuda.HostMapping`), or the per-layer path with its
prefetch (`per_layer/per_layer_runtime.py`).
"""

import functools
import time
import weakref
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from ..accounting.ledger import PHASES, Ledger
from ..caching.layer_cache import LayerCache
from ..errors import UserError
from ..model_surgery.routing import router_matrices
from ..model_surgery.switch_over import switch_on
from ..runtime import ExpertIds, PathFigures, Runtime, TwoTierMode
from ..storage.store import ExpertStore
from . import bus_probe, forecast, slot_fill, staged_passes
from .admission import Admission
from .host_ring import HostRing
from .kept_rows import KeptRows
from .layer_step import (
    CompiledBlock,
    CompileVerdict,
    Lanes,
    LayerSteps,
    TwoTierSwitch,
    all_in_slots,
    as_routed,
    through_table,
)
from .mapped import follow_moves, read_stacks, release_stacks, stack_addresses
from .settings import ADMIT_PASSES, FORECASTS, TwoTierSettings
from .staged_passes import positions_to_stage
from .tally import LAG, DeviceTally, RoutingRecord, book_read


class TwoTierRuntime(Runtime):
    """What the engine drives in two-tier mode (`runtime.Runtime`), with no reads after load and no prefetch:
    the stacks (one a layer, `read_stacks`), mlx-lm's switch over each (`steps`), and how it runs
    (`settings`; the slots kept by the device only where some experts have none);
    `forecast(source layer, x) -> [(target layer, scores)]`: forecasts copied into device-kept rows."""

    def __init__(
        self,
        store: ExpertStore,
        caches: list[LayerCache],
        stacks: list[dict],
        steps: list[LayerSteps],
        settings: TwoTierSettings,
        forecast: Callable | None = None,
    ):
        self.store, self.caches, self.stacks, self.steps = store, caches, stacks, steps
        self.num_experts = caches[0].num_experts
        self.settings = settings
        self.ledger = Ledger(len(caches))
        self.admission = Admission(len(caches), self.num_experts, settings.admission)
        self.mode = TwoTierMode.LRU if settings.kept_by_device else TwoTierMode.ON
        self.mode_reason, self.miss_policy = settings.mode_reason, "load"
        # the slots are kept on the device (`kept_rows.py`), none by the host, and admission is off
        self.device_lru = kept_by_device(settings, caches)
        self.admissions = settings.admission.enabled and not self.device_lru
        device_rows = next(iter(stacks[0].values())).shape[0] - self.num_experts
        if self.device_lru:  # every device row kept by the device
            slots, kept = [0] * len(caches), device_rows
        else:
            slots, kept = [c.capacity for c in caches], settings.kept_rows.rows
        self.kept_rows = KeptRows(stacks, self.num_experts, slots, kept, settings.kept_rows) if kept else None
        self.forecast = forecast if self.kept_rows is not None else None
        held = device_rows if self.device_lru else caches[0].capacity + kept  # expert rows in device memory
        stage = settings.stage_positions
        self.stage_positions = stage or positions_to_stage(caches[0].layout.expert_nbytes, held)
        # a pass of one position is a compiled call of each block (`CompiledBlock`), unless the host decides
        # its rows (device-kept rows on the CPU and Metal, or with `demand` off)
        traced = self.kept_rows is None or self.kept_rows.fuses()
        self.compiles_blocks = settings.compile_blocks and traced
        fills = settings.admission.by_kernel
        by_kernel = slot_fill.available() if fills is None else fills
        # fills between passes as kernels that need no wait (CUDA), else MLX writes after a wait
        self._kernel_fills = slot_fill.KernelFills() if by_kernel else None
        self.policy = None  # whose prompt hooks run (`set_policy`)
        self.host_syncs, self.clock, self.phase = 0, 0, "prefill"
        self.tally = DeviceTally(len(caches), self.num_experts, len(PHASES))
        self.stack_moves = 0  # fills that found a stack copied instead of written in place (want 0)
        self._addresses = [stack_addresses(stack) for stack in stacks]
        self._landed: dict[int, mx.array] = {}  # layer -> computed once its last kernel fills landed
        self._last_output: mx.array | None = None  # the last MoE layer's output in the last pass
        self._table_ring = HostRing((len(caches), self.num_experts), np.uint32)
        # this pass's routed ids, hit lanes, staged layers' counts (`staged_passes`), by layer
        self._routed: dict[int, mx.array] = {}
        self._hit: dict[int, mx.array] = {}
        self._union: dict[int, mx.array] = {}
        self._recording: RoutingRecord | None = None
        self._since_admission, self._admitted_at = 0, 0
        self._prompt_done = False  # a prompt's prefill was counted: admit from it before decoding
        weakref.finalize(self, release_stacks, stacks)
        self._refresh()
        mx.eval(self._tables)  # before another thread

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

    def stop_recording(self) -> list[dict[int, np.ndarray]] | None:
        """The routing of every pass since `start_recording`: [{layer: ids (tokens, k)}, ...]; None where
        nothing was recording."""
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

    def load(self, cache: LayerCache, ids: ExpertIds, protect: ExpertIds = ()):
        """Copy experts `ids` of `cache`'s layer from the mapped stack into slots now (profile seeding,
        snapshots, a fully resident start), free slots first, then the most evictable."""
        if self.device_lru:  # the device fills its slots from the routing; the host places nothing
            return
        wanted = np.asarray(ids, dtype=np.int64)
        wanted = wanted[cache.slot_of[wanted] < 0]
        if wanted.size:
            slots = cache.choose_slots(len(wanted), protect=list(protect) + wanted.tolist(), clock=self.clock)
            self._fill([(cache, wanted, slots)])

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
        first, last = self.num_experts, self.num_experts + cache.capacity
        return {f"{proj}.{name}": rows[first:last] for (proj, name), rows in self.stacks[cache.layer].items()}

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
        return PathFigures(kept_by_device=self.device_lru, stack_moves=self.stack_moves)

    def transfer_rates(self, repeats: int = 5) -> dict[str, float]:
        """Bytes a second at which experts cross the bus on the first MoE layer (`bus_probe.py`): read in
        place by its products ("in_place"), copied to the device by a staged pass ("copied"), and the
        faster ("best"). Nothing is written: the slots hold what they held."""
        cache = self.caches[0]
        nbytes = cache.layout.expert_nbytes
        return bus_probe.transfer_rates(self.steps[0], self.stacks[0], self.num_experts, nbytes, repeats)

    # -- a layer's pass ----------------------------------------------------------------------------
    def layer_pass(
        self, layer: int, x: mx.array, block: CompiledBlock | None = None, indices: mx.array | None = None
    ) -> mx.array:
        """MoE layer `layer`'s pass of `x`, entered once a layer: by its `block`, a pass of one position
        computed as one compiled call of the whole block (routing inside it), or by its switch (`indices`:
        routed by mlx-lm's block around it). No host sync (but where the host decides device-kept rows)."""
        # 1. at the first layer, between passes: the last pass's counts launched, admission, the tables
        if layer == 0:
            self._begin_pass(x)
        positions = x.size // x.shape[-1]
        # 2. forecasts of later layers' experts, copied into their device-kept rows ahead of them
        kept = self.kept_rows
        if self.forecast is not None and kept is not None and self.phase == "decode":
            for target, scores in self.forecast(layer, x):
                kept.expect(target, scores)
        # 3. where each routed expert is read this pass: its row in the table (host tier, device slot, or
        # a device-kept row after the layer's own copies), each lane finding its row (`Lanes`)
        lanes = self._lanes(layer, positions)
        # 4. routing (in the block), each lane's row, the expert products: one compiled call where it can be
        if block is not None:
            y, indices, found = block.on_lanes(lanes, x)
        elif indices is not None:
            y, found = self.steps[layer].on_lanes(lanes, x, indices)
        else:
            raise TypeError("a layer's pass is entered by its block, or by its switch with the routed ids")
        # 5. bookkeeping on what the call gave, nothing waited for: lookups from the ids' shape (a full
        # layer's are all hits), the rest added up on the device at the pass's end (`_end_pass`)
        full = self._full[layer]
        self.ledger.count_lookups(self.phase, layer, indices.size, indices.size if full else 0)
        if not full or self._recording is not None:
            self._routed[layer] = indices
        if "hit" in found:
            self._hit[layer] = found["hit"]
        if "staged" in found:
            self._union[layer] = found["staged"]
        if "rows" in found and kept is not None:
            kept.keep(layer, found["rows"])
        # 6. at the last layer the pass ends, its counts tied to its output
        if layer == len(self.caches) - 1:
            y = self._end_pass(y)
        return y

    def _lanes(self, layer: int, positions: int) -> Lanes:
        """How this pass's lanes of `layer` find their rows (`layer_step.Lanes`): through the table, which
        puts each expert in its tier (its host row, E + its slot), or device-kept rows' own call; staged
        onto a device copy where the pass has `stage_positions` positions or more (`staged_passes.py`)."""
        table, stack = self._tables[layer], tuple(self.stacks[layer].values())
        if self._full[layer] and self._direct[layer]:  # every expert in a slot, in expert order: no table
            return Lanes(("routed",), as_routed, self._direct[layer])
        if self._full[layer]:  # every expert in a slot: every lane a hit
            return Lanes(("slots",), all_in_slots, (table, *stack))
        decode = self.phase == "decode"
        staged = positions >= self.stage_positions
        if self.kept_rows is not None:  # the rows' own call: copies, each lane's row, its hits
            if positions == 1 and decode and self.kept_rows.fuses():
                return self.kept_rows.fused_lanes(layer, table)
            return self.kept_rows.lanes(layer, table, copy=decode, staged=staged)
        hits = bool(self._resident[layer].any())  # else every lane a miss: none counted
        if staged:  # each expert across PCIe once
            by_kernel = slot_fill.available()
            one = positions == 1  # one position's lanes route to distinct experts: no union to find
            read = functools.partial(
                staged_passes.one_position if one else staged_passes.several, by_kernel, hits
            )
            return Lanes(("staged", one, by_kernel, hits), read, (table, *stack), traced=one)
        if hits:
            return Lanes(("table",), through_table, (table, *stack))
        return Lanes(("routed",), as_routed, stack)  # no expert in a slot: every lane mapped

    def _begin_pass(self, x: mx.array):
        self.tally.launch()  # the last pass's counts, queued after it
        tokens = x.size // x.shape[-1]
        self.phase = "decode" if x.ndim < 2 or x.shape[-2] == 1 else "prefill"
        self.clock += 1
        self.ledger.count_forward(self.phase, tokens)
        self._since_admission += tokens  # positions, and passes in `clock`
        every = self.settings.admission.every
        due = self._since_admission >= every and self.clock - self._admitted_at >= ADMIT_PASSES
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
        self._routed, self._hit, self._union = {}, {}, {}

    def _end_pass(self, y: mx.array) -> mx.array:
        """`y`, the last MoE layer's output, once the pass's counts are added (lazily) and tied to it."""
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
        if self._kernel_fills is not None:  # what a slot fill at the next pass waits for (`_admit`)
            self._last_output = y
        return y

    def _refresh(self):
        """Remake the device tables after slots changed (admission, seeding, a snapshot): all layers' rows
        written into a host array the device reads (`HostRing`: no array made from host bytes), copied
        into device memory once, each layer's tables views of that copy."""
        num_experts = self.num_experts
        slot_of = np.stack([c.slot_of for c in self.caches])
        resident = slot_of >= 0
        own = np.arange(num_experts)
        rows = self._table_ring.write(np.where(resident, num_experts + slot_of, own)) + 0
        self._table_ring.used_by(rows)
        self._resident, self._full = resident, resident.all(axis=1)
        self._tables = [rows[i] for i in range(len(self.caches))]
        in_order = self._full & (slot_of == own).all(axis=1)
        in_order[list(self._landed)] = False  # their slots wait for fills the views would not wait for
        self._direct = [  # the slot rows alone (views: nothing copied)
            tuple(part[num_experts:] for part in stack.values()) if ok else None
            for stack, ok in zip(self.stacks, in_order)
        ]
        for layer, landed in self._landed.items():  # this pass reads those slots only once they are filled
            self._tables[layer] = rows[layer] + (landed * 0).astype(mx.uint32)
        self._landed = {}
        self._dirty = False
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
        if fills and self._kernel_fills is not None and self._last_output is not None:
            self._fill_by_kernels(self._kernel_fills, fills, self._last_output)
        elif fills:
            self._fill(fills)

    def _fill_by_kernels(
        self,
        kernels: slot_fill.KernelFills,
        fills: list[tuple[LayerCache, np.ndarray, np.ndarray]],
        after: mx.array,
    ):
        """`_fill` with no wait (CUDA, `slot_fill.py`), by `kernels`: the copies run on MLX's stream after
        `after`, the last pass's last MoE output (so after every read of the slots they overwrite), and the
        tables of the layers filled are made from them (`_refresh`)."""
        t0 = time.perf_counter()
        self._landed.update(kernels.fill_layers(self.stacks, fills, self.num_experts, after))
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


def kept_by_device(settings: TwoTierSettings, caches: list[LayerCache]) -> bool:
    """Whether the device keeps the slots (`settings.kept_by_device`), where some experts have none."""
    return settings.kept_by_device and caches[0].capacity < caches[0].num_experts


def forecast_of(settings: TwoTierSettings, blocks, device_lru: bool) -> Callable | None:
    """The forecast `settings.forecast` asks for, over the routers of `blocks` (mlx-lm's MoE blocks), or None:
    a UserError for an unknown kind, or one whose experts have no device-kept rows to be copied into."""
    asked = settings.forecast
    if asked.kind not in FORECASTS:
        raise UserError(f"forecast kind must be one of {', '.join(FORECASTS)}, got {asked.kind!r}")
    if asked.kind == "none":
        return None
    if not (device_lru or settings.kept_rows.rows):
        raise UserError(
            "forecasts copy experts into rows the device keeps: give KeptRowsSettings(rows=N) or "
            "two_tier='lru'"
        )
    if asked.kind == "custom":
        return asked.custom
    routers = router_matrices([block.block for block in blocks])
    if asked.kind == "shadow":
        if asked.predictor is None:
            raise UserError("a shadow forecast needs the shadow network: ForecastSettings(predictor=...)")
        return forecast.shadow_forecast(asked.predictor, asked.distance, routers)
    return forecast.next_gate_forecast(routers, asked.distance)


def build(store: ExpertStore, blocks, caches: list[LayerCache], settings: TwoTierSettings, progress=None):
    """Read every layer's stack (`progress.update(bytes)` as it goes), make the runtime and put a
    `TwoTierSwitch` where each block's switch was, and a `CompiledBlock` where each block was (where it has
    an owner to hold it). `caches` were made over the blocks' switches; their own slot arrays are given back
    (the slots are the stacks' last rows). `settings.kept_rows.rows`: device rows per layer after the
    slots, kept on the device (`kept_rows.py`: filled by the layer's misses and forecasts);
    `settings.kept_by_device`: the slots themselves are such rows (the host's caches stay empty, admission
    off), unless every expert fits in them."""
    predicted = forecast_of(settings, blocks, kept_by_device(settings, caches))
    # the slots and kept rows of each layer, one on the device at least
    rows = [max(1, cache.capacity + settings.kept_rows.rows) for cache in caches]
    stacks = read_stacks(store, [(c.layout, c.targets, n) for c, n in zip(caches, rows)], progress)
    switches = [switch_on(block.switch, stack) for block, stack in zip(blocks, stacks)]
    steps = [LayerSteps(switch, stack) for switch, stack in zip(switches, stacks)]
    runtime = TwoTierRuntime(store, caches, stacks, steps, settings, predicted)
    by_block = all(block.owner is not None for block in blocks)
    verdict = CompileVerdict()  # shared: the first block that fuses otherwise sends all op by op
    for i, (block, cache, stack) in enumerate(zip(blocks, caches, stacks)):
        block.replace_switch(TwoTierSwitch(switches[i], runtime, i))
        if by_block:
            block.replace_block(
                CompiledBlock(block.block, runtime, i, steps[i], tuple(stack.values()), verdict)
            )
        for part in cache.layout.parts:  # the slots are the stack's rows: mlx-lm's own arrays go
            block.switch[part.proj][part.name] = mx.zeros(
                (0, *part.shape), dtype=stack[part.proj, part.name].dtype
            )
    return runtime
