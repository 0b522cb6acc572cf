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

import collections
import functools
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..accounting.ledger import PHASES, Ledger
from ..caching.layer_cache import LayerCache
from ..errors import UserError
from ..model_surgery.moe_blocks import top_k_of
from ..model_surgery.routing import router_matrices
from ..model_surgery.switch_over import switch_on
from ..runtime import ExpertIds, PathFigures, Runtime, TwoTierMode
from ..storage.store import ExpertStore
from . import bus_probe, disk_passes, forecast, slot_fill, staged_passes
from .admission import Admission
from .host_eviction import NextUseOrder
from .host_ring import HostRing
from .host_tier import HostTier, NoRoomError, flagged_through_table, table_rows
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
from .settings import ADMIT_PASSES, DISK_PREFETCH, DISK_RERUNS, FORECASTS, TwoTierSettings
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
        host_ids: list[np.ndarray] | None = None,
        top_k: int = 0,
        next_use: NextUseOrder | None = None,
    ):
        self.store, self.caches, self.stacks, self.steps = store, caches, stacks, steps
        self.num_experts = caches[0].num_experts
        self.settings = settings
        # rows 0..host_rows-1 of each stack are the host tier: every expert in expert order, or past the
        # host's memory (`host_tier.py`) a bounded number of rows, the other experts on disk
        self.host_rows = next(iter(stacks[0].values())).shape[0] - _device_rows(caches, settings)
        self.ledger = Ledger(len(caches))
        self.phase = "prefill"
        # past the host's memory, the next-use head's estimates order the host tier's eviction
        self.next_use = next_use if host_ids is not None else None
        due = self.next_use.due if self.next_use is not None else None
        self.host_tier = (
            HostTier(
                store,
                caches,
                stacks,
                self.host_rows,
                host_ids,
                self._book_disk,
                settings.disk_threads,
                due,
                settings.disk_span,
            )
            if host_ids is not None
            else None
        )
        self.admission = Admission(len(caches), self.num_experts, settings.admission)
        self.mode = TwoTierMode.LRU if settings.kept_by_device else TwoTierMode.ON
        self.mode_reason, self.miss_policy = settings.mode_reason, "load"
        # the slots are kept on the device (`kept_rows.py`), none by the host, and admission is off
        self.device_lru = kept_by_device(settings, caches)
        self.admissions = settings.admission.enabled and not self.device_lru
        device_rows = next(iter(stacks[0].values())).shape[0] - self.host_rows
        if self.device_lru:  # every device row kept by the device
            slots, kept = [0] * len(caches), device_rows
        else:
            slots, kept = [c.capacity for c in caches], settings.kept_rows.rows
        self.kept_rows = KeptRows(stacks, self.num_experts, slots, kept, settings.kept_rows) if kept else None
        self.forecast = forecast if self.kept_rows is not None else None
        # past the host's memory: forecasts read from disk into the host tier (`_forecast_reads`)
        self.disk_forecast = forecast if host_ids is not None else None
        self.top_k = top_k  # experts a position routes to (a forecast reads that many a layer)
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
        # (past the host's memory fills wait: the host rows they copy from are free once they are done)
        self._kernel_fills = slot_fill.KernelFills() if by_kernel and host_ids is None else None
        self.policy = None  # whose prompt hooks run (`set_policy`)
        self.host_syncs, self.clock, self.phase = 0, 0, "prefill"
        self.tally = DeviceTally(len(caches), self.num_experts, len(PHASES))
        self.stack_moves = 0  # fills that found a stack copied instead of written in place (want 0)
        self._addresses = [stack_addresses(stack) for stack in stacks]
        self._landed: dict[int, mx.array] = {}  # layer -> computed once its last kernel fills landed
        self._last_output: mx.array | None = None  # the last MoE layer's output in the last pass
        self._table_ring = HostRing((len(caches), self.num_experts), np.uint32)
        # a layer's rows when it learned its routing (past the host's memory), written in turn: a pass
        # waits at each such layer, so the ring's arrays used layers before are computed
        self._exact_ring = HostRing((self.num_experts,), np.uint32, depth=4)
        # this pass's routed ids, hit lanes, staged layers' counts (`staged_passes`), by layer
        self._routed: dict[int, mx.array] = {}
        self._hit: dict[int, mx.array] = {}
        self._union: dict[int, mx.array] = {}
        self._recording: RoutingRecord | None = None
        self._since_admission, self._admitted_at = 0, 0
        self._prompt_done = False  # a prompt's prefill was counted: admit from it before decoding
        self._lookups: dict[int, tuple[int, int]] = {}  # this pass's (lookups, hits known) by layer
        # past the host's memory (`disk_passes.py`): layers from `_exact_from` on learn their routing and
        # read what is on disk before they compute (None: none, the pass flagged); a flagged pass's
        # absent lanes by layer, its booking until its flags are read, and what a pass run again keeps
        self._exact_from: int | None = 0
        self._flagged = self._resumed = False
        self._stop_early = True  # a flagged pass stops at its first miss (`begin_flagged_pass`)
        self._found = False  # a flagged run that runs on found a layer with absent lanes (`_read_found`)
        self._resume_from = 0  # a pass run again: its first layer not run as before
        self._missing: dict[int, mx.array] = {}
        self._watched: collections.deque = collections.deque()  # a flagged pass's layers not yet read
        self._unbooked: PassBooking | None = None
        self._carried: PassBooking | None = None
        self._last_y: mx.array | None = None  # the last pass's output, computed before host rows change
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
        if self.host_tier is not None:
            self.host_tier.close()

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
            self._fill_from_anywhere(cache, wanted, slots)

    def place(self, cache: LayerCache, expert_in_slot: np.ndarray, arrays: dict | None = None):
        """Put each expert of `expert_in_slot` (-1: empty) into that slot (a snapshot's), empty the rest:
        copied from its host rows, which hold every expert (so `arrays`, a snapshot's bytes, are not read)."""
        cache.restore(np.full(cache.capacity, -1))
        if self.device_lru:
            return
        held = np.asarray(expert_in_slot, dtype=np.int64)
        slots = np.flatnonzero(held >= 0)
        if slots.size:
            self._fill_from_anywhere(cache, held[slots], slots)

    def slot_arrays(self, cache: LayerCache) -> dict[str, mx.array]:
        """The slot rows of `cache`'s layer by `proj.part` name, as `LayerCache.stacked_arrays` names them."""
        first, last = self.host_rows, self.host_rows + cache.capacity
        return {f"{proj}.{name}": rows[first:last] for (proj, name), rows in self.stacks[cache.layer].items()}

    def prepare_batches(self, lanes: int):
        """Device-kept rows compile their kernel for every size a pass of up to `lanes` routed lanes takes
        (`KeptRows.compile`)."""
        if self.kept_rows is not None:
            self.kept_rows.compile(lanes)

    def generation_model(self, model):
        """`model` itself where every expert is in host memory (a two-tier pass never waits for the host);
        past it, decode passes flagged and run again where they met an expert on disk (`disk_passes.py`)."""
        if self.host_tier is None:
            return model
        paths, settings = [c.layout.module_path for c in self.caches], self.settings
        return disk_passes.DiskPasses(model, self, paths, settings.disk_prefetch, settings.disk_rerun)

    def read_ahead(self):
        """None: two tiers read nothing ahead (every expert is in host memory)."""
        return None

    def figures(self) -> PathFigures:
        """No prefetch and no optimistic passes; whether the device keeps the slots; stacks moved; the
        tiers (past the host's memory the tiers do not overlap: an expert is in one)."""
        device = next(iter(self.stacks[0].values())).shape[0] - self.host_rows
        disk = max(0, self.num_experts - device - self.host_rows) if self.host_tier is not None else 0
        tiers = {"device": device, "host": self.host_rows, "disk": disk}
        evicts = None if self.host_tier is None else "recency" if self.next_use is None else "next-use"
        return PathFigures(
            kept_by_device=self.device_lru, stack_moves=self.stack_moves, tiers=tiers, host_eviction=evicts
        )

    def transfer_rates(self, repeats: int = 5) -> dict[str, float]:
        """Bytes a second at which experts cross the bus on the first MoE layer (`bus_probe.py`): read in
        place by its products ("in_place"), copied to the device by a staged pass ("copied"), and the
        faster ("best"). Nothing is written: the slots hold what they held."""
        cache = self.caches[0]
        nbytes = cache.layout.expert_nbytes
        return bus_probe.transfer_rates(self.steps[0], self.stacks[0], self.host_rows, nbytes, repeats)

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
        exact = self.host_tier is not None and (
            layer >= self._exact_from if self._exact_from is not None else layer < self.settings.exact_layers
        )
        rerun = self._resumed and layer < self._resume_from  # as it ran before: its inputs are made
        if self.next_use is not None and self.phase == "decode" and positions == 1 and not rerun:
            self.next_use.inputs(layer, x)
        if exact and self.disk_forecast is not None and self.phase == "decode":
            self._forecast_reads(layer, x)
        lanes = self._exact_lanes(layer) if exact else self._lanes(layer, positions)
        # 4. routing (in the block), each lane's row, the expert products: one compiled call where it can be
        if block is not None:
            y, indices, found = block.on_lanes(lanes, x)
        elif indices is not None and exact:  # past the host's memory, in as many rounds as rows allow
            y, found = self._exact_switch(layer, x, indices)
        elif indices is not None:
            y, found = self.steps[layer].on_lanes(lanes, x, indices)
        else:
            raise TypeError("a layer's pass is entered by its block, or by its switch with the routed ids")
        # 5. bookkeeping on what the call gave, nothing waited for: lookups from the ids' shape (a full
        # layer's are all hits), the rest added up on the device at the pass's end (`_end_pass`); none for
        # the layers of a pass run again before its first miss (booked by `first_missing_layer`)
        if "missing" in found:
            self._missing[layer] = found["missing"]
        if self._resumed and layer < self._resume_from:
            return self._end_pass(y) if layer == len(self.caches) - 1 else y
        full = self._full[layer]
        self._lookups[layer] = (indices.size, indices.size if full else 0)
        if not full or self._recording is not None:
            self._routed[layer] = indices
        if "hit" in found:
            self._hit[layer] = found["hit"]
        if "staged" in found:
            self._union[layer] = found["staged"]
        if "rows" in found and kept is not None:
            kept.keep(layer, found["rows"])
        watch = self._stop_early or not self.settings.flag_stop
        if "missing" in found and self._flagged and watch and self.settings.flag_lag:
            self._watch_flags(layer, y, found["missing"])
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
        if self.host_tier is not None:  # absent experts' lanes flagged (`host_tier.py`)
            flagged = functools.partial(flagged_through_table, self.host_rows)
            return Lanes(("flagged", self.host_rows), flagged, (table, *stack))
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

    # -- past the host's memory: passes that read from disk (`disk_passes.py` drives them) -----------
    def _book_disk(self, layer: int, **counts):
        self.ledger.add(self.phase, layer, **counts)

    def begin_flagged_pass(self, stop_early: bool = True):
        """The next pass runs flagged: no layer waits for its routing, a lane whose expert is on disk reads
        a wrong row and is counted, until `first_missing_layer` reads the counts; `stop_early`: each
        layer's count read `flag_lag` layers on, the pass stopping at the first not 0 (and its runs again)."""
        self._exact_from, self._flagged = None, True
        self._stop_early = stop_early
        self._found = False

    def cancel_flagged_pass(self):
        """The flagged pass did not finish (it raised): passes run exactly again."""
        self._exact_from, self._flagged, self._resumed = 0, False, False
        self._unbooked = self._carried = None
        self._missing = {}
        self._watched.clear()

    def first_missing_layer(self, logits: mx.array) -> "disk_passes.Missed | None":
        """End a flagged pass: wait for its `logits` with its flags (its one sync) and book it where no
        lane was absent (None); else what it missed (`disk_passes.Missed`: the first layer with an absent
        lane, and what the pass routed from there on, exact at that layer), the layers before it kept for
        the pass run again."""
        flagged = sorted(self._missing)
        counts = mx.stack([self._missing[i] for i in flagged]) if flagged else None
        booked = self._unbooked
        assert booked is not None, "first_missing_layer without a flagged pass"
        if self._carried is not None:  # a pass run again: the layers before its first miss as first run
            booked = self._carried.merged(booked)
        head = self.next_use.pending() if self.next_use is not None else []
        mx.eval(logits, [] if counts is None else counts, list(booked.routed.values()), head)
        absent = dict(zip(flagged, np.array(counts).tolist())) if counts is not None else {}
        first = next((i for i in flagged if absent[i] > 0), None)
        self._missing, self._unbooked = {}, None
        self._watched.clear()
        routed = {i: np.array(ids).reshape(-1).astype(np.int64) for i, ids in booked.routed.items()}
        if first is not None:
            return self._missed(booked, routed, first, int(absent[first]))
        self._routing_final(routed)
        self._carried = None
        self._flagged = self._resumed = False
        self._exact_from = 0
        self._book(booked)
        return None

    def _routing_final(self, routed: dict[int, np.ndarray]):
        """Past the host's memory, these layers' routing in the pass just ended stands: their host rows
        were used now (least recently used rows go first), and the next-use head estimates from it."""
        if self.host_tier is None:
            return
        for i, ids in routed.items():
            self.host_tier.touch(i, ids, self.clock)
            if self.next_use is not None:
                self.next_use.routed(i, ids, self.clock)

    def _watch_flags(self, layer: int, y: mx.array, missing: mx.array):
        """A flagged pass's layer is computed as it is built; `flag_lag` layers on, its count of absent
        lanes is read (the device has that many layers queued meanwhile), and where it is not 0 the pass
        stops there (`disk_passes.StoppedAt`): what it would compute past it is wrong. With `flag_stop` off
        the pass runs on and that layer's experts on disk are read from then on (`_read_found`)."""
        mx.async_eval(y, missing)
        self._watched.append((layer, y, missing))
        if len(self._watched) <= self.settings.flag_lag:
            return
        watched, _, count = self._watched.popleft()
        if count.item() == 0:
            return
        if not (self._stop_early and self.settings.flag_stop):
            self._read_found(watched)
            return
        mx.eval(y)  # every layer queued computed: the reads that follow may take their rows
        self._watched.clear()
        raise disk_passes.StoppedAt(watched)

    def _read_found(self, layer: int):
        """A flagged pass that runs on found lanes of `layer` absent: the experts it routed to there that are
        on disk are read now, while the device computes the layers after it. Their rows may be taken from
        experts this pass's later layers read in place; that is safe, since the pass runs again from its
        first miss, and the layers before it are computed (its routing, read now, needed their outputs).
        The first such layer's routing is known (a read of need); past it the inputs were wrong (a read
        ahead)."""
        ids = np.array(self._routed[layer]).reshape(-1).astype(np.int64)
        self.fetch_ahead(layer, ids, ahead=self._found)
        self._found = True

    def stopped_pass(self, first: int) -> "disk_passes.Missed":
        """End a flagged pass that stopped at layer `first` (`disk_passes.StoppedAt`): as
        `first_missing_layer` ends one that missed there, from the layers it ran."""
        booked = PassBooking(self._routed, self._hit, self._union, self._lookups)
        self._routed, self._hit, self._union, self._lookups = {}, {}, {}, {}
        if self._carried is not None:
            booked = self._carried.merged(booked)
        absent = int(np.array(self._missing[first]))
        self._missing = {}
        self.ledger.add(self.phase, first, stopped_passes=1)
        routed = {i: np.array(ids).reshape(-1).astype(np.int64) for i, ids in booked.routed.items()}
        return self._missed(booked, routed, first, absent)

    def _missed(self, booked: "PassBooking", routed: dict, first: int, absent: int) -> "disk_passes.Missed":
        self._routing_final({i: ids for i, ids in routed.items() if i < first})
        if self.next_use is not None:  # computed from wrong inputs past the miss: made again when run again
            self.next_use.forget(range(first, len(self.caches)))
        self.ledger.add(self.phase, first, reruns=1, disk_lanes=absent)
        self._carried = booked.before(first)
        return disk_passes.Missed(first, {i: ids for i, ids in routed.items() if i >= first})

    def resume(self, first: int, exact: bool, skipped: bool = False):
        """The pass that missed at `first` runs again (its KV caches trimmed by the caller): the layers
        before `first` skipped (`skipped`: their outputs given again, no layer entered before `first`) or as
        they ran (same inputs, no booking); from `first` on flagged again, or (`exact`) each learning its
        routing and reading what is on disk first. `first_missing_layer` closes it."""
        self._exact_from = first if exact else None
        self._flagged = self._resumed = True
        self._resume_from = first
        self._found = False
        if skipped:  # layer 0 is not entered: the pass begins here
            self._begin_pass(None)

    def wait_for_reads(self):
        """Wait for every read from disk in flight (the seconds booked as waited), so that the next pass's
        tables hold what they read."""
        tier = self.host_tier
        assert tier is not None
        self.ledger.add(self.phase, 0, wait_s=tier.wait_all())

    def fetch_ahead(self, layer: int, ids: np.ndarray, ahead: bool = True) -> int:
        """Start reading from disk the experts `ids` of `layer` that are in neither a slot nor the host tier
        (as many as free rows allow, on the reader threads); how many were asked for. `ahead`: a forecast
        (else known to be needed: a pass's own routing)."""
        tier = self.host_tier
        assert tier is not None
        cache = self.caches[layer]
        routed = np.unique(np.asarray(ids, dtype=np.int64))
        wanted = tier.on_disk(layer, routed, cache.slot_of)
        try:  # no read takes the row of an expert routed with them
            return len(tier.fetch(layer, wanted, protect=routed, clock=self.clock, ahead=ahead))
        except NoRoomError:
            return 0

    def _forecast_reads(self, layer: int, x: mx.array):
        """At a layer that learns its routing (it waits anyway), the forecast's top experts of later layers
        from its hidden state `x`, those confident enough (`ForecastSettings.floor`), read from disk ahead
        of them (`fetch_ahead`)."""
        forecasts = self.disk_forecast(layer, x) if self.disk_forecast is not None else []
        if not forecasts:
            return
        k = self.top_k
        tops, confident = [], []
        for _, scores in forecasts:
            top = mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]
            p = mx.take_along_axis(mx.softmax(scores.astype(mx.float32), axis=-1), top, axis=-1)
            tops.append(top)
            confident.append(p * k >= self.settings.forecast.floor)
        stacked = mx.stack(tops), mx.stack(confident)
        mx.eval(*stacked)  # one wait
        ids, keep = (np.array(a) for a in stacked)
        for (target, _), top, kept in zip(forecasts, ids, keep):
            self.fetch_ahead(target, top[kept])

    def _exact_lanes(self, layer: int) -> Lanes:
        """Lanes that learn their routing (a host sync) and find each expert a row, reading those on disk
        into the host tier first (`_present`)."""
        return Lanes(("exact", layer), functools.partial(self._exact_read, layer), (), traced=False)

    def _exact_read(self, layer: int, indices: mx.array):
        ids = np.array(indices).astype(np.int64)  # the sync
        self.host_syncs += 1
        read = self._rows_of(indices, self._present(layer, ids))
        return tuple(self.stacks[layer].values()), read, {"hit": read >= self.host_rows}

    def _rows_of(self, indices: mx.array, rows: np.ndarray) -> mx.array:
        """Each routed lane's row by a layer's `rows` (per expert), through a host ring (`HostRing`: no
        array made from host bytes in a pass)."""
        table = self._exact_ring.write(rows.astype(np.uint32))
        read = table[indices]
        self._exact_ring.used_by(read)
        return read

    def _exact_switch(self, layer: int, x: mx.array, indices: mx.array) -> tuple[mx.array, dict]:
        """The switch of `layer` on `x`, its routed experts read from disk first. Where they do not all fit
        the host tier at once, in groups of experts that do (`_expert_groups`), each group's lanes computed
        before the next group's reads take its rows: every expert is read at most once a pass, however many
        positions route to it. A pass of several positions computes on a device copy of the experts it
        routes to (`_group_pass`), so that an expert crosses the bus once, not once a lane. Exact: each lane
        computed on its expert's bytes as in one call."""
        ids = np.array(indices).astype(np.int64)  # the sync
        self.host_syncs += 1
        groups, kept = self._expert_groups(layer, ids)
        # a prompt's or a batch's pass (a decode pass's lanes route to distinct experts: nothing to share)
        staged = ids.size // ids.shape[-1] >= max(2, self.stage_positions)
        if len(groups) == 1:
            return self._group_pass(layer, x, indices, ids, self._present(layer, ids), staged)
        k, flat = ids.shape[-1], ids.reshape(-1)
        xs, lanes_all = x.reshape(-1, x.shape[-1]), indices.reshape(-1, 1)
        order, outputs, hits = [], [], []
        for group in groups:
            lanes = np.flatnonzero(np.isin(flat, group))
            picked = mx.array(lanes)
            rows = self._present(layer, flat[lanes], kept)
            y, found = self._group_pass(
                layer, xs[picked // k], lanes_all[picked], flat[lanes, None], rows, staged
            )
            mx.eval(y)  # before the next group's reads take its rows
            order.append(lanes)
            outputs.append(y.reshape(lanes.size, -1))
            hits.append(found["hit"].reshape(-1))
        back = mx.array(np.argsort(np.concatenate(order)))  # each lane back in its place
        y = mx.concatenate(outputs, axis=0)[back]
        return y.reshape(*ids.shape, -1), {"hit": mx.concatenate(hits, axis=0)[back].reshape(ids.shape)}

    def _group_pass(
        self, layer: int, x: mx.array, indices: mx.array, ids: np.ndarray, rows: np.ndarray, staged: bool
    ) -> tuple[mx.array, dict]:
        """The switch of `layer` on `x` and its lanes `indices` (`ids` on the host), every expert they route
        to present at its row of `rows` (per expert): read in place, or (`staged`) from a device copy of those
        experts' rows made first, each copied once (`staged_passes.take_rows`)."""
        arrays = tuple(self.stacks[layer].values())
        if not staged:
            read = self._rows_of(indices, rows)
            return self.steps[layer].compute(arrays, x, read), {"hit": read >= self.host_rows}
        experts = np.unique(ids)
        place = np.zeros(self.num_experts, np.uint32)
        place[experts] = np.arange(experts.size)
        sources = self._exact_ring.write(np.resize(rows[experts], self.num_experts))
        copies = staged_passes.take_rows(
            list(arrays), sources[: experts.size], mx.array(experts.size), slot_fill.available()
        )
        read = self._rows_of(indices, place)
        y = self.steps[layer].compute(tuple(copies), x, read)
        self._exact_ring.used_by(y, sources)
        return y, {"hit": mx.array(rows[ids] >= self.host_rows)}

    def _expert_groups(self, layer: int, ids: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """(The experts `ids` route to, in groups whose experts outside the device slots fit the host tier's
        rows; experts kept in their host rows through every group). The last group is the experts latest
        used, so that the host tier holds them for the passes after; up to half the rows' worth of them
        already in host rows are kept there throughout (else an earlier group's reads would take their rows
        and the last group read them again). The others go first: those in host rows (read by no group),
        then those on disk by their last position. The slots' experts go with the first group."""
        needed = np.unique(ids)
        slot_of, H = self.caches[layer].slot_of, self.host_rows
        outside = needed[slot_of[needed] < 0]
        if outside.size <= H or self.host_tier is None:
            return [needed], np.zeros(0, np.int64)
        positions = ids.reshape(-1, ids.shape[-1])
        last = np.full(self.num_experts, -1)
        np.maximum.at(last, positions, np.arange(positions.shape[0])[:, None])
        outside = outside[np.argsort(last[outside], kind="stable")]  # the latest used last
        held = self.host_tier.in_host(layer)[outside] >= 0
        final, final_held = outside[-H:], held[-H:]
        held_last = final[final_held]
        kept = held_last[held_last.size - min(held_last.size, H // 2) :]  # H // 2 may be 0
        final = final[~final_held | np.isin(final, kept)]
        first = ~np.isin(outside, final)
        early = np.concatenate([outside[first & held], outside[first & ~held]])
        room = H - kept.size
        groups = [early[s : s + room] for s in range(0, early.size, room)] + [final]
        groups[0] = np.concatenate([needed[slot_of[needed] >= 0], groups[0]])
        return groups, kept

    def _present(self, layer: int, ids: np.ndarray, keep: np.ndarray | tuple = ()) -> np.ndarray:
        """Every expert of `ids` in a slot or a host row (those on disk read now, on the reader threads):
        the layer's rows per expert (`host_tier.table_rows`). `keep`: experts whose rows no read takes."""
        tier, cache = self.host_tier, self.caches[layer]
        assert tier is not None
        needed = np.unique(ids)
        outside = needed[cache.slot_of[needed] < 0]
        on_disk = tier.on_disk(layer, outside, cache.slot_of)
        lanes_on_disk = int(np.isin(ids, on_disk).sum())
        if on_disk.size:
            late = tier.pending_ahead(layer, on_disk)
            protect = np.concatenate([outside, np.asarray(keep, np.int64)])
            waited = tier.wait(tier.fetch(layer, on_disk, protect=protect, clock=self.clock))
            self.ledger.add(self.phase, layer, disk_lanes=lanes_on_disk, wait_s=waited, prefetch_late=late)
            self._dirty = True  # the next pass's tables see the rows read
        tier.touch(layer, outside, self.clock)
        return table_rows(cache.slot_of, tier.in_host(layer), self.host_rows)

    def _begin_pass(self, x: mx.array | None):
        """Between passes (`x`: the first MoE layer's input; None where a pass run again skips the layers
        before its first miss, `resume`)."""
        if self.host_tier is not None:
            # host rows change between passes only once the passes that read them are computed
            if self._last_y is not None:
                mx.eval(self._last_y)
                self._last_y = None
            self.host_tier.boundary()
            self._dirty = self._dirty or self.host_tier.take_changed()
        self._missing = {}
        self._watched.clear()
        if self._resumed:  # the same pass again: counted once, the slots as they were
            if self._dirty:
                self._refresh()
            return
        assert x is not None
        self.tally.launch()  # the last pass's counts, queued after it
        tokens = x.size // x.shape[-1]
        self.phase = "decode" if x.ndim < 2 or x.shape[-2] == 1 else "prefill"
        self.clock += 1
        self.ledger.count_forward(self.phase, tokens)
        self._since_admission += tokens  # positions, and passes in `clock`
        every = self.settings.admission.cadence(past_host_memory=self.host_tier is not None)
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
        """`y`, the last MoE layer's output, once the pass's counts are added (lazily) and tied to it; a
        flagged pass's are kept until its flags are read (`first_missing_layer`)."""
        booked = PassBooking(self._routed, self._hit, self._union, self._lookups)
        self._routed, self._hit, self._union, self._lookups = {}, {}, {}, {}
        if self.host_tier is not None:
            self._last_y = y
        if self._flagged:
            self._unbooked = booked
            return y
        y = self._book(booked, y)
        if self.kept_rows is not None:
            self.kept_rows.end_pass()
        if self._kernel_fills is not None:  # what a slot fill at the next pass waits for (`_admit`)
            self._last_output = y
        return y

    def _book(self, booked: "PassBooking", y: mx.array | None = None):
        """Count a pass's lookups, add its routing and hits to the tally (tied to `y`, its last MoE output,
        in a decoded pass), record its routing."""
        for layer, (lookups, hits) in booked.lookups.items():
            self.ledger.count_lookups(self.phase, layer, lookups, hits)
        # the routing counts feed admission alone: none is made where it is off (device-kept rows)
        routed = booked.routed
        counted = {i: ids for i, ids in routed.items() if not self._full[i]} if self.admissions else {}
        self.tally.add(self.clock, PHASES.index(self.phase), counted, booked.hit, booked.union)
        if y is not None and self.phase == "decode":  # computed with the token, not on their own
            y = self.tally.tie(y)
        if self._recording is not None:
            self._recording.add(routed)
        self._prompt_done = self._prompt_done or self.phase == "prefill"
        return y

    def _refresh(self):
        """Remake the device tables after slots changed (admission, seeding, a snapshot): all layers' rows
        written into a host array the device reads (`HostRing`: no array made from host bytes), copied
        into device memory once, each layer's tables views of that copy."""
        num_experts, host_rows = self.num_experts, self.host_rows
        slot_of = np.stack([c.slot_of for c in self.caches])
        resident = slot_of >= 0
        own = np.arange(num_experts)
        row_of = self.host_tier.row_of if self.host_tier is not None else own
        table = table_rows(slot_of, row_of, host_rows)
        rows = self._table_ring.write(table) + 0
        self._table_ring.used_by(rows)
        self._resident, self._full = resident, resident.all(axis=1)
        self._tables = [rows[i] for i in range(len(self.caches))]
        in_order = self._full & (slot_of == own).all(axis=1)
        in_order[list(self._landed)] = False  # their slots wait for fills the views would not wait for
        self._direct = [  # the slot rows alone (views: nothing copied)
            tuple(part[host_rows:] for part in stack.values()) if ok else None
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
        fills = [self._from_host(*f) for f in fills]
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
        self._landed.update(kernels.fill_layers(self.stacks, self._moves(fills), self.host_rows, after))
        _book_fills(self.ledger, self.phase, fills, (time.perf_counter() - t0) / len(fills))
        self._dirty = True  # the tables are out of date

    def _fill(self, fills: list[tuple[LayerCache, np.ndarray, np.ndarray]]):
        """For each (cache, ids, slots): copy experts `ids` from their host rows into the rows of `slots`
        in the same stacks, in place, and do the caches' bookkeeping."""
        t0 = time.perf_counter()
        self._last_output = None  # it holds the last pass's graph, and with it a stack
        if self.host_tier is not None:  # reads and the tier hold views of the stacks
            self.host_tier.let_go()
        slot_fill.write_after_wait(self.stacks, self._moves(fills))
        for cache, _, _ in fills:
            layer = cache.layer
            self.stack_moves += follow_moves(self.stacks[layer], self._addresses[layer], self.host_rows)
        if self.host_tier is not None:  # the copies are done: the rows they were made from are free
            self.host_tier.boundary()
        _book_fills(self.ledger, self.phase, fills, (time.perf_counter() - t0) / len(fills))
        self._dirty = True  # the tables are out of date

    def _fill_from_anywhere(self, cache: LayerCache, ids: np.ndarray, slots: np.ndarray):
        """`_fill` of experts `ids` into `slots` of `cache`'s layer; past the host's memory those on disk
        are read into the host tier first, as many at a time as it has rows."""
        if self.host_tier is None:
            self._fill([(cache, ids, slots)])
            return
        step = self.host_rows
        for start in range(0, len(ids), step):
            some, into = ids[start : start + step], slots[start : start + step]
            tier = self.host_tier
            tier.wait(tier.fetch(cache.layer, some, clock=self.clock))
            self._fill([(cache, some, into)])

    def _from_host(self, cache: LayerCache, ids: np.ndarray, slots: np.ndarray):
        """(cache, ids, slots) of a fill, past the host's memory only the experts in host rows (one on disk
        is read into a slot only once a pass has read it into the host tier)."""
        if self.host_tier is None:
            return cache, ids, slots
        held = self.host_tier.in_host(cache.layer)[ids] >= 0
        return cache, ids[held], slots[held]

    def _moves(self, fills) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """Per (cache, ids, slots) of `fills`: (layer, source rows, target rows), the experts' host rows into
        their slot rows. Past the host's memory the tiers do not overlap (`host_tier.py`): an expert leaves
        its host row, and the expert its slot held takes that row (the two rows swapped: `write_after_wait`
        gathers every source before it writes), else the row is given back."""
        moves = []
        for cache, ids, slots in fills:
            layer, targets = cache.layer, self.host_rows + np.asarray(slots, np.int64)
            if self.host_tier is None:
                moves.append((layer, np.asarray(ids, np.int64), targets))
                continue
            sources = self.host_tier.in_host(layer)[ids]
            assert (sources >= 0).all(), "a fill from the host tier of an expert not in it"
            victims = cache.expert_in_slot[slots]
            demoted = victims >= 0
            self.host_tier.swap(layer, ids[demoted], victims[demoted], self.clock)
            self.host_tier.give_back(layer, ids[~demoted])
            moves.append(
                (
                    layer,
                    np.concatenate([sources, targets[demoted]]),
                    np.concatenate([targets, sources[demoted]]),
                )
            )
        return moves


@dataclass(frozen=True)
class PassBooking:
    """What a pass books once it stands, by layer: routed ids, hit lanes, staged counts, (lookups, hits
    known from the shape)."""

    routed: dict
    hit: dict
    union: dict
    lookups: dict

    def before(self, layer: int) -> "PassBooking":
        """The layers before `layer`."""

        def keep(d):
            return {i: v for i, v in d.items() if i < layer}

        return PassBooking(keep(self.routed), keep(self.hit), keep(self.union), keep(self.lookups))

    def merged(self, later: "PassBooking") -> "PassBooking":
        """These layers with `later`'s."""
        return PassBooking(
            {**self.routed, **later.routed},
            {**self.hit, **later.hit},
            {**self.union, **later.union},
            {**self.lookups, **later.lookups},
        )


def _host_experts(settings: TwoTierSettings, caches: list[LayerCache], top_k: int) -> list[np.ndarray]:
    """Per layer, the experts the host tier holds at the start: every one in expert order, or past the
    host's memory (`settings.host_experts`) the first that many (a UserError where that cannot hold one
    position's experts read from disk, or the path runs what three tiers do not yet: rows kept by the
    device, forecasts)."""
    E = caches[0].num_experts
    H = settings.host_experts
    if settings.disk_prefetch not in DISK_PREFETCH or settings.disk_rerun not in DISK_RERUNS:
        raise UserError(
            f"disk_prefetch must be one of {', '.join(DISK_PREFETCH)} and disk_rerun one of"
            f" {', '.join(DISK_RERUNS)}, got {settings.disk_prefetch!r} and {settings.disk_rerun!r}"
        )
    if H is None or H >= E:
        return [np.arange(E) for _ in caches]
    if H < max(1, top_k):
        raise UserError(
            f"host_experts must be at least the experts a position routes to ({top_k}): those read from"
            f" disk for a layer are in host rows at once; got {H}"
        )
    if kept_by_device(settings, caches) or settings.kept_rows.rows:
        raise UserError(
            "past the host's memory (host_experts below the experts a layer) the device's slots are admitted"
            " by routing counts: give two_tier=True and no kept rows"
        )
    return [np.arange(H) for _ in caches]


def _device_rows(caches: list[LayerCache], settings: TwoTierSettings) -> int:
    """Rows of each stack in device memory: the slots and kept rows, one at least."""
    return max(1, caches[0].capacity + settings.kept_rows.rows)


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


def forecast_of(
    settings: TwoTierSettings, blocks, device_lru: bool, bounded: bool = False
) -> Callable | None:
    """The forecast `settings.forecast` asks for, over the routers of `blocks` (mlx-lm's MoE blocks), or None:
    a UserError for an unknown kind, or one with nothing to fill: no device-kept rows to copy experts into
    and (`bounded`) no host tier to read them into from disk."""
    asked = settings.forecast
    if asked.kind not in FORECASTS:
        raise UserError(f"forecast kind must be one of {', '.join(FORECASTS)}, got {asked.kind!r}")
    if asked.kind == "none":
        return None
    if not (device_lru or settings.kept_rows.rows or bounded):
        raise UserError(
            "forecasts copy experts into rows the device keeps, or read them from disk into a host tier: "
            "give KeptRowsSettings(rows=N), two_tier='lru' or host_experts"
        )
    if asked.kind == "custom":
        return asked.custom
    routers = router_matrices([block.block for block in blocks])
    if asked.kind == "shadow":
        if asked.predictor is None:
            raise UserError("a shadow forecast needs the shadow network: ForecastSettings(predictor=...)")
        return forecast.shadow_forecast(asked.predictor, asked.distance, routers)
    return forecast.next_gate_forecast(routers, asked.distance)


def next_use_order(predictor, blocks, caches: list[LayerCache]) -> NextUseOrder | None:
    """The host tier's eviction order from `predictor`'s next-use head over `blocks`' routers (None: least
    recent use); a UserError where it has no such head or was made for another shape of model."""
    if predictor is None:
        return None
    c = predictor.config
    if not c.next_use:
        raise UserError(
            "host_next_use needs a shadow network with a next-use head: train one with "
            "`od-moe train-predictor`"
        )
    routers = router_matrices([block.block for block in blocks])
    wrong = c.misfits(*routers[0].shape)  # (layers, experts, hidden size)
    if wrong:
        raise UserError(
            f"host_next_use's predictor does not fit this model: {', '.join(wrong)}; give the predictor "
            "trained for this model"
        )
    return NextUseOrder(predictor.next_use, routers, caches[0].num_experts)


def build(store: ExpertStore, blocks, caches: list[LayerCache], settings: TwoTierSettings, progress=None):
    """Read every layer's stack (`progress.update(bytes)` as it goes), make the runtime and put a
    `TwoTierSwitch` where each block's switch was, and a `CompiledBlock` where each block was (where it has
    an owner to hold it). `caches` were made over the blocks' switches; their own slot arrays are given back
    (the slots are the stacks' last rows). `settings.kept_rows.rows`: device rows per layer after the
    slots, kept on the device (`kept_rows.py`: filled by the layer's misses and forecasts);
    `settings.kept_by_device`: the slots themselves are such rows (the host's caches stay empty, admission
    off), unless every expert fits in them."""
    top_k = top_k_of(blocks[0].block)
    host_ids = _host_experts(settings, caches, top_k)
    bounded = len(host_ids[0]) < caches[0].num_experts  # past the host's memory
    predicted = forecast_of(settings, blocks, kept_by_device(settings, caches), bounded)
    # the slots and kept rows of each layer, one on the device at least
    rows = _device_rows(caches, settings)
    layers = [(c.layout, c.targets, rows, ids) for c, ids in zip(caches, host_ids)]
    stacks = read_stacks(store, layers, progress)
    switches = [switch_on(block.switch, stack) for block, stack in zip(blocks, stacks)]
    steps = [LayerSteps(switch, stack) for switch, stack in zip(switches, stacks)]
    order = next_use_order(settings.host_next_use, blocks, caches) if bounded else None
    runtime = TwoTierRuntime(
        store, caches, stacks, steps, settings, predicted, host_ids if bounded else None, top_k, order
    )
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
