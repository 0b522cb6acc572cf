"""The offload runtime: what happens at every MoE layer between routing and the expert math.

Every `OffloadedSwitch` of a model calls `route(layer, x, indices)` once per forward pass and computes on
the slots it gets back. One decoded token, top to bottom:
1. Layer 0 only, between passes: deferred routing is accounted for (`settle`), the governor looks at
   the token that ended, and finished prefetch reads are installed.
2. The policy's `before_layer` hook runs (profile seeding happens here) and, when prefetch is on,
   predicts experts for layers ahead (lazy arrays).
3. Exact mode: the layer's routing and the predictions are evaluated together (the layer's one sync);
   `after_routing` hooks run; finished reads are installed; lookups and hits are counted; misses are
   claimed from the reader if being read ("late"), else read and installed here; the predictions are
   queued for the reader; the slots go back to the switch (with a scratch stack of the routed experts
   that do not fit, `_overflow`). On the CPU backend a decode layer that misses first hands back its
   resident experts, which compute while the missing ones are read (`_split`).
   A layer whose experts are all resident only counts its lookups (its ids are its slots when the cache
   holds experts in id order) unless a hook or a recording needs the routing; such layers and skip
   mode never sync: their routing is accounted for at the next pass (`settle`); skip mode scales
   missing experts out and loads them then. An optimistic decode pass (`optimistic.py`) does not sync
   at partly resident layers either: each leaves a lazy flag, read once with the logits
   (`end_optimistic`), and a pass that missed runs again from its first missing layer (`begin_resume`);
   such passes run only without prefetch (prefetching from them was measured and removed: see
   docs/GPU.md, "Optimistic passes with prefetch").
Where the policy knows when each expert is needed next (`next_uses`: the oracle), reads and installs evict
the expert needed farthest ahead (Belady's MIN), and a prefetched expert goes in only if it is needed no
later than the one it would evict. Every count is booked in the ledger (`stats.py`) here, once. A demand
read that fails raises `ExpertReadError` out of `route` (the request fails; nothing of the read is
installed, so the caches stay consistent); a failed prefetch is only dropped. Everything here runs on the
generation thread. Not here: the forward math (`switch.py`), reading ahead (`reader.py`), choosing how
much to read ahead (`governor.py`) or what (`policies.py`).
"""

import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from . import backend
from .cache import Installed, LayerCache
from .errors import ExpertReadError
from .governor import Governor, PrefetchSettings
from .layout import Staging
from .policies import OnDemand, Prediction, Step
from .reader import READ_THREADS, SMALL_EXPERT_BYTES, Read, Reader
from .routing import routing_weights
from .stats import Ledger
from .store import ExpertStore

MISS_POLICIES = ("load", "skip")
# decode passes run optimistically (`optimistic.py`) while the share of recent decode tokens that missed
# somewhere (a moving average over about 8 tokens) is below this: a pass that misses costs a second pass
# from its first missing layer, one that does not saves a sync per partly resident layer
OPTIMISTIC_BELOW = 0.5
MISS_RATE_WEIGHT = 0.125
READ_BATCH = 16  # experts per read round at most...
STAGING_BYTES = 8 * 2**20  # ...and at most this many bytes: staging and install copies count against budgets


class Route(NamedTuple):
    """What a switch computes on: slots of the routed experts, and in skip mode a per-expert scale;
    `stacks`: the arrays to compute on instead of the slots' own (the slots and a scratch stack of the
    routed experts that did not fit, `_overflow`); `launch`: the host waited for this
    layer's routing, so its computation should start at once. `lanes`: a round of a decode token that
    computes only the routed experts at these positions (`slots` holds theirs alone), started at once:
    the runtime reads the next round's experts meanwhile; the switch puts the rounds' outputs back in
    routing order."""

    slots: mx.array
    scale: mx.array | None = None
    stacks: dict | None = None
    launch: bool = False
    lanes: np.ndarray | None = None


class OffloadRuntime:
    def __init__(
        self,
        store: ExpertStore,
        caches: list[LayerCache],
        miss_policy: str = "load",
        read_threads: int = READ_THREADS,
    ):
        if miss_policy not in MISS_POLICIES:
            raise ValueError(f"unknown miss policy {miss_policy!r}")
        self.store, self.caches, self.miss_policy = store, caches, miss_policy
        self.read_threads = read_threads
        self.ledger = Ledger(len(caches))
        self.taps: list = [None] * len(caches)  # RouterTaps where router outputs are needed
        self.policy = OnDemand()
        self._reader: Reader | None = None
        # installs copy read bytes into the slots (numpy views of host memory); on CUDA the runtime's
        # copies (`cuda.DeviceCopies`) can do the same but stay off: on the H100 an install of a widened
        # expert took 0.50 ms that way against 2.39 ms as an MLX write from a host-made array (scratch
        # `probe2.py`), yet decode with them ran 0.87-1.06x of MLX writes (`benchmarks/sync_path.py
        # --switch copy_installs`: above 1 only for the oracle in exact mode, 1.06x on both models at 25%;
        # none 0.92-1.00x; the oracle with optimistic passes 0.95-0.96x; widened cold 0.87x). The
        # per-layer path there waits on the host, and the copies move install work off the GPU, where lazy
        # MLX writes overlap the host's work, onto the host
        self.copy_installs = backend.arrays_in_host_memory()
        self.governor: Governor | None = None
        self.settings: PrefetchSettings | None = None
        self.clock = 0  # forward passes so far: the time of cache uses
        self.phase = "prefill"  # of the running pass
        self._recording: list[dict[int, np.ndarray]] | None = None
        self._staging: dict[tuple, Staging] = {}  # this thread's buffers for reads it does itself
        self._deferred = []
        self._prompt_passes = 0  # passes since the prompt started
        self._pass_index = 0
        self._running_layer: int | None = None  # the layer of the running pass that `route` is at
        self._pass_started: float | None = None
        # may decode passes run optimistically (`optimistic.py`): where a sync stalls the device
        # (`benchmarks/sync_path.py`: 1.25x at 87.5% resident on an H100; 0.82-0.88x on the CPU backend)
        self.optimistic = backend.syncs_stall_device()
        self.launch_early = True  # a layer the host synced at starts computing at once (`Route.launch`)
        # a decode layer that misses computes its resident experts while the missing ones are read
        # (`_split`): on the CPU backend, where compute is slow, for experts large enough that reading
        # them takes time (`benchmarks/sync_path.py --switch split_on_miss`: widened x128 at 25% cold,
        # 1.18x with none and 1.15x with the predictor; the bundled model's 20 KB experts from the page
        # cache, 0.95x at 25% and 0.97x at 50%, the second round's launch costing more than it hides; on
        # the H100, where compute is short and launches dear, 0.84x warm and 0.88x cold on the widened copy)
        large = max(c.layout.expert_nbytes for c in caches) >= SMALL_EXPERT_BYTES
        self.split_on_miss = large and not backend.syncs_stall_device()
        self.token_miss_rate = 1.0  # moving average: did a decode token miss at any layer
        self._pass_missed = False
        self._speculative: list | None = None  # optimistic pass: (layer, indices, phase, absent flag)
        self._resume_from: int | None = None  # its second pass: the first layer that missed
        self.host_syncs = 0  # evaluations the per-layer path waited for (routing, settling, flags)
        self.optimistic_passes = self.optimistic_misses = 0  # passes run optimistically; those that missed

    # -- configuration ---------------------------------------------------------------------------
    def set_policy(self, policy, settings: PrefetchSettings | None = None, experts_per_layer: int = 0):
        """Use `policy`; with `settings`, a governor has the reader prefetch what it predicts."""
        if self._reader is not None:  # engines that never prefetch start no reader at load
            self._reader.cancel_prefetches()
        self.policy, self.settings, self.governor = policy, settings, None
        if settings is not None:
            self.governor = Governor(settings, self.ledger, settings.experts_per_layer or experts_per_layer)

    @property
    def reader(self) -> Reader:
        """The reader threads (started again if `close` stopped them)."""
        if self._reader is None or self._reader.closed:
            self._reader = Reader(
                self.store,
                [c.layout for c in self.caches],
                self.ledger,
                self.read_threads,
                make_arrays=not (self.copy_installs and backend.copies_into_arrays()),
            )
        return self._reader

    @property
    def copy_installs(self) -> bool:
        """Installs copy the read bytes into the slots where the backend allows (`backend.row_writer`:
        numpy views of host memory, the CUDA runtime's copies); off, they are MLX writes from arrays the
        reader threads make (`benchmarks/sync_path.py --switch copy_installs`). Set it before the engine
        reads."""
        return self._copy_installs

    @copy_installs.setter
    def copy_installs(self, on: bool):
        self._copy_installs = on
        for cache in self.caches:
            cache.host_writes = on
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def close(self):
        """Stop prefetching and the reader threads (demand reads start them again)."""
        if self._reader is not None:
            self._reader.close()
        self.policy, self.settings, self.governor = OnDemand(), None, None

    def reset_counts(self):
        """Zero the ledger; reads still in flight count as issued, so the prefetch invariant holds."""
        self.settle()
        self.ledger.reset()
        self.host_syncs = self.optimistic_passes = self.optimistic_misses = 0
        for cache in self.caches:
            cache.forget_prefetches()
        if self.governor is not None:
            counts = self.reader.counts()
            self.ledger.reader["issued"] = counts["reading"] + counts["ready"]
            self.governor.reset()

    def start_prompt(self, prompt):
        """A new prompt: passes count from zero again (oracle traces are indexed by them)."""
        self._prompt_passes = 0
        self._pass_started = None  # the time between two prompts is not a token's
        self.policy.prompt_start(prompt)

    def start_recording(self):
        self._recording = []

    def stop_recording(self) -> list[dict[int, np.ndarray]]:
        """The routing of every pass since `start_recording`: [{layer: ids (tokens, k)}, ...]."""
        self.settle()
        recording, self._recording = self._recording, None
        return recording

    # -- the per-layer path ----------------------------------------------------------------------
    def route(self, layer: int, x: mx.array, indices: mx.array) -> Iterator[Route]:
        """The slots of a layer's routed experts, once they are resident (see the module docstring)."""
        phase = "prefill" if x.ndim >= 2 and x.shape[-2] > 1 else "decode"
        cache = self.caches[layer]
        resuming = self._resume_from is not None  # the second run of an optimistic pass: booked already
        if layer == 0 and not resuming:
            self._between_passes()
            self._pass_index = self._prompt_passes
        self._running_layer = layer
        if cache.is_full() and self._nobody_watches():  # nothing can miss: count, and compute at once
            if layer == 0 and not resuming:
                self._start_pass(indices.size // indices.shape[-1], phase)
            if not resuming:
                self._count_lookups(phase, layer, indices.size, indices.size)
            yield Route(cache.routed_slots(indices))
            return
        if self._speculative is not None:  # optimistic: no sync; a lazy flag says if anything was absent
            if layer == 0:
                self._start_pass(indices.size // indices.shape[-1], phase)
            absent = mx.logical_not(cache.resident_mask()[indices]).any()
            self._speculative.append((layer, indices, phase, absent))
            yield Route(cache.routed_slots(indices))
            return
        if resuming and layer < self._resume_from:  # all resident, as the optimistic run found
            yield Route(cache.routed_slots(indices))
            return
        exact = self.miss_policy == "load" and not cache.is_full()
        if exact and self.settings is not None and self.settings.synchronous:
            self._drain()
        prefetching = exact and self.governor is not None and (self.governor.active or self.reader.busy)
        tap = self.taps[layer]
        step = Step(
            self._pass_index,
            layer,
            phase,
            x,
            tap.logits if tap is not None else None,
            predict=prefetching and phase == "decode" and self.governor.active,
            prefetching=prefetching,
        )
        t0 = time.perf_counter()
        predictions = self.policy.before_layer(step)
        if step.predict:
            self.ledger.reader["busy_s"] += time.perf_counter() - t0
        if layer == 0 and not resuming:  # after the hook: seeding belongs to the time of the pass that ended
            self._start_pass(indices.size // indices.shape[-1], phase)
        if self.miss_policy == "skip":
            yield self._route_skipping(layer, indices, phase)
        elif not exact:
            self._deferred.append((layer, indices, phase))
            yield Route(cache.routed_slots(indices))
        else:
            yield from self._route_exact(step, indices, predictions)

    def _route_exact(self, step: Step, indices: mx.array, predictions: list[Prediction]) -> Iterator[Route]:
        layer, cache = step.layer, self.caches[step.layer]
        self._evaluate(layer, indices, predictions)
        ids = np.array(indices).astype(np.int64)
        self._after_routing(step, ids)
        uniq, counts = np.unique(ids, return_counts=True)
        if step.prefetching:  # between layers: the cooperative install point
            self.reader.withdraw(layer)
            self._install_ready({layer: uniq})
        resident = cache.slot_of[uniq] >= 0
        self._count_lookups(step.phase, layer, ids.size, counts[resident].sum())
        self._touch(cache, uniq[resident], counts[resident])
        missing = uniq[~resident]
        self._pass_missed |= bool(missing.size)
        if missing.size and step.prefetching:
            missing = self._claim(layer, missing, uniq, counts)
        fits = missing.size <= cache.room(protect=uniq)
        if self.split_on_miss and fits and 0 < missing.size < uniq.size and ids.size == ids.shape[-1]:
            yield from self._split(cache, indices, ids, uniq, counts, missing, predictions)
            return
        if missing.size and fits:
            self._load_missing(cache, missing, uniq, counts)
        self._submit(predictions)
        if fits:  # the cache's lookup table is made anew only when its experts changed
            yield Route(cache.routed_slots(indices), launch=self.launch_early)
        else:
            yield self._overflow(cache, indices, uniq, counts, missing)

    def _split(self, cache: LayerCache, indices, ids, uniq, counts, missing, predictions) -> Iterator[Route]:
        """A decode token's layer that misses, in two rounds: its resident experts compute while the
        missing ones are read and installed (into slots the first round does not read: the routed
        experts are protected, so no copy waits for the device), then the missing ones compute. Each
        routed expert's output is computed once, as in one round, so the result is the same."""
        absent = np.isin(ids.reshape(-1), missing)
        here, later = np.flatnonzero(~absent), np.flatnonzero(absent)
        yield Route(cache.routed_slots(_take_lanes(indices, here)), lanes=here)
        self._load_missing(cache, missing, uniq, counts, synchronize=False)
        self._submit(predictions)
        yield Route(cache.routed_slots(_take_lanes(indices, later)), launch=self.launch_early, lanes=later)

    def _load_missing(self, cache: LayerCache, missing, uniq, counts, synchronize: bool = True):
        """Read and install a layer's missing routed experts (the routed ones protected) and count their
        uses, as the computation about to run makes them."""
        self.load(cache, missing, protect=uniq, computing=True, synchronize=synchronize)
        self._touch(cache, missing, counts[np.searchsorted(uniq, missing)])

    def _overflow(self, cache: LayerCache, indices: mx.array, uniq, counts, missing) -> Route:
        """More distinct routed experts than slots (a batch, or a long prefill chunk, at a small capacity):
        the most used missing experts go into the slots the routed ones leave free; the rest are read into
        a scratch stack beside the slots, and the layer computes once on both (`LayerCache.with_scratch`),
        each expert's rows grouped as stock mlx-lm groups them, so the result is the same. Nothing routed
        is evicted within the layer, and no expert is read twice."""
        future = self._future(cache.layer)
        if future is None:  # the most used go in
            order = np.argsort(-counts[np.searchsorted(uniq, missing)], kind="stable")
            admit = missing[order[: cache.room(protect=uniq)]]
        else:  # each only if needed no later than what it would evict (Belady's MIN, bypass allowed)
            admit = np.asarray(_worth(cache, missing, uniq, future, self.clock), dtype=np.int64)
        if admit.size:
            self._load_missing(cache, admit, uniq, counts)
        scratch, rows = [], []  # experts read into the scratch stack, in order; their rows by chunk
        chunk = self._read_chunk(cache)
        while (rest := np.setdiff1d(uniq[cache.slot_of[uniq] < 0], scratch)).size:
            # (a late prefetch of one may have gone into a slot instead, or found none: read it then)
            t0 = time.perf_counter()
            experts, raw, reads = self._read(cache, rest[:chunk], uniq.tolist())
            t1 = time.perf_counter()
            try:
                rows.append(cache.scratch_rows(raw, len(experts)))
            finally:
                self.reader.recycle(reads, installed=False)
            scratch += experts
            self._book_read(cache, len(experts), t1 - t0)
        self._touch(cache, uniq, counts)  # the resident ones; the scratch ones pass through
        table = np.where(cache.slot_of >= 0, cache.slot_of, 0)
        table[np.asarray(scratch, dtype=np.int64)] = cache.capacity + np.arange(len(scratch))
        slots = mx.array(table.astype(np.int32))[indices]
        return Route(slots, stacks=cache.with_scratch(rows), launch=self.launch_early)

    def _route_skipping(self, layer: int, indices: mx.array, phase: str) -> Route:
        """Skip mode: no sync; missing experts' outputs are zeroed and the others rescaled so the routing
        weights of the resident experts sum to what all k summed to."""
        cache = self.caches[layer]
        self._deferred.append((layer, indices, phase))
        slots = cache.routed_slots(indices)
        if cache.is_full():
            return Route(slots)
        present = cache.resident_mask()[indices].astype(mx.float32)
        tap = self.taps[layer]
        weights = routing_weights(tap.output if tap is not None else None, indices)
        kept = (weights * present).sum(axis=-1, keepdims=True)
        scale = mx.where(kept > 0, weights.sum(axis=-1, keepdims=True) / mx.maximum(kept, 1e-30), 0.0)
        return Route(slots, scale=present * scale)

    # -- optimistic decode passes (`optimistic.py`) -----------------------------------------------
    def optimistic_ok(self) -> bool:
        """Whether the next decode pass may run optimistically: exact mode, no prefetch, a policy that
        allows it, and recent decode tokens missed rarely. A recording learns the pass's routing with its
        flags."""
        return (
            self.optimistic
            and self.miss_policy == "load"
            and self.policy.optimistic_passes
            and self.governor is None
            and self.token_miss_rate < OPTIMISTIC_BELOW
            and not all(c.is_full() for c in self.caches)  # then no layer syncs anyway
        )

    def begin_optimistic(self):
        self._speculative = []

    def abort_optimistic(self):
        self._speculative = None

    def end_optimistic(self, logits: mx.array) -> int | None:
        """Read the optimistic pass's flags with its logits (its one sync); book the layers before the
        first that missed as exact mode would have; that layer, or None if none missed."""
        speculative, self._speculative = self._speculative, None
        if not speculative:  # every layer was fully resident: nothing to check, and no sync
            return None
        mx.eval(logits, [s[1] for s in speculative], [s[3] for s in speculative])
        self.host_syncs += 1
        self._synced()
        first_miss = next((s[0] for s in speculative if s[3].item()), None)
        for layer, indices, phase, _ in speculative:
            if first_miss is not None and layer >= first_miss:
                break
            self._book(layer, indices, phase)  # all resident: nothing absent
        self._pass_missed = first_miss is not None
        self.optimistic_passes += 1
        self.optimistic_misses += self._pass_missed
        return first_miss

    def begin_resume(self, layer: int):
        self._resume_from = layer

    def end_resume(self):
        self._resume_from = None

    def _nobody_watches(self) -> bool:
        """No policy hook and no recording needs the routing (so a full cache need not know it)."""
        return self._recording is None and type(self.policy) is OnDemand

    # -- between passes --------------------------------------------------------------------------
    def _between_passes(self):
        self.settle()
        if self.phase == "decode" and self.clock:  # the pass that ended: did it miss anywhere
            w = MISS_RATE_WEIGHT
            self.token_miss_rate = (1 - w) * self.token_miss_rate + w * float(self._pass_missed)
        now = time.perf_counter()
        if self.governor is not None:  # between tokens: the cooperative install point
            self.governor.end_token(self.phase, now - self._pass_started if self._pass_started else None)
            self._install_ready({})
        self._pass_started = now

    def _start_pass(self, tokens: int, phase: str):
        self.phase = phase
        self._pass_missed = False
        self.clock += 1
        self._prompt_passes += 1
        self.ledger.count_forward(phase, tokens)
        if self._rows is not None:
            self._rows.begin_pass(phase == "decode")
        if self._recording is not None:
            self._recording.append({})

    def settle(self):
        """Account for routing that needed no sync; in skip mode, load what missed so later tokens hit.
        With synchronous prefetch, also wait for the reads in progress (so counts repeat exactly)."""
        if self.settings is not None and self.settings.synchronous:
            self.reader.drain()
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        mx.eval([indices for _, indices, _ in deferred])
        self.host_syncs += 1
        for layer, indices, phase in deferred:
            missing, uses = self._book(layer, indices, phase)
            if missing.size and self.miss_policy == "skip":
                cache = self.caches[layer]
                most_used_first = missing[np.argsort(-uses, kind="stable")]
                fit = most_used_first[: cache.room()]
                if fit.size:
                    self.load(cache, np.sort(fit))

    def _book(self, layer: int, indices: mx.array, phase: str) -> tuple[np.ndarray, np.ndarray]:
        """Account for a layer's routing known after it computed (evaluated `indices`): the policy's hook,
        lookups and hits, the uses of resident experts; returns the absent experts and their uses."""
        cache = self.caches[layer]
        ids = np.array(indices).astype(np.int64)
        self._after_routing(Step(self._pass_index, layer, phase, None, None, False, False), ids)
        uniq, counts = np.unique(ids, return_counts=True)
        resident = cache.slot_of[uniq] >= 0
        self._count_lookups(phase, layer, ids.size, counts[resident].sum())
        self._touch(cache, uniq[resident], counts[resident])
        return uniq[~resident], counts[~resident]

    # -- routing known ---------------------------------------------------------------------------
    def _evaluate(self, layer: int, indices: mx.array, predictions: list[Prediction]):
        """Evaluate a layer's routing with the predictions made at it (one sync); while the governor
        measures what prefetch costs, the predictions' compute is timed apart (a second sync)."""
        lazy = [a for p in predictions for a in (p.experts, p.scores) if isinstance(a, mx.array)]
        lazy += self.policy.pending()
        if lazy and self.governor is not None and self.governor.measuring:
            mx.eval(indices)
            t0 = time.perf_counter()
            mx.eval(lazy)
            self.ledger.reader["busy_s"] += time.perf_counter() - t0
            self.host_syncs += 2
        else:
            mx.eval(indices, lazy)
            self.host_syncs += 1
        self._synced(layer)

    @property
    def _rows(self):
        """The reader's rows of MLX memory (`device_rows.py`), where reads land in them."""
        return self._reader.rows if self._reader is not None else None

    def _synced(self, layer: int | None = None):
        """A host sync returned (of MoE layer `layer`'s routing, where given): staging rows whose installs
        surely ran may be read into again."""
        if self._rows is not None:
            self._rows.synced(layer)

    def _after_routing(self, step: Step, ids: np.ndarray):
        if self._recording:
            self._recording[-1][step.layer] = ids.reshape(-1, ids.shape[-1])
        t0 = time.perf_counter()
        self.policy.after_routing(step, ids)
        if step.prefetching:  # the policy's bookkeeping for prefetch: part of what prefetch costs
            self.ledger.reader["busy_s"] += time.perf_counter() - t0

    def _count_lookups(self, phase: str, layer: int, lookups: int, hits: int):
        self.ledger.count_lookups(phase, layer, lookups, hits)

    def _touch(self, cache: LayerCache, ids: np.ndarray, uses: np.ndarray):
        first_uses = cache.touch(ids, uses, self.clock)
        if first_uses:
            self.ledger.add(self.phase, cache.layer, prefetch_useful=first_uses)

    # -- reads and installs ----------------------------------------------------------------------
    def load(
        self,
        cache: LayerCache,
        ids: Sequence[int],
        protect: Sequence[int] = (),
        computing: bool = False,
        synchronize: bool = True,
    ):
        """Read experts `ids` of `cache`'s layer and install them, now; prefetches of them already in flight
        are waited for, not read twice. `computing`: the layer computes next in this pass, on these
        installs (the routing path), so their staging rows are free after a later layer's sync.
        `synchronize=False`: nothing in flight reads the slots these installs may take (`_split`)."""
        ids = np.asarray(ids, dtype=np.int64)
        chunk = self._read_chunk(cache)
        keep = list(protect) + ids.tolist()
        for start in range(0, len(ids), chunk):
            t0 = time.perf_counter()
            experts, raw, reads = self._read(cache, ids[start : start + chunk], keep, synchronize)
            t1 = time.perf_counter()
            if not experts:
                continue
            self._book_read(cache, len(experts), t1 - t0)
            try:
                installed = cache.install(
                    experts,
                    raw,
                    protect=keep,
                    clock=self.clock,
                    arrays=_arrays(reads),
                    next_use=self._future(cache.layer),
                    synchronize=synchronize,
                )
            finally:
                self.reader.recycle(reads, computing=computing)
            self._book_install(
                cache.layer, installed, len(experts), time.perf_counter() - t1, prefetched=False
            )
        refused = ids[cache.slot_of[ids] < 0]  # late prefetches that found no slot: read them as demand
        if refused.size:
            self.load(cache, refused, protect, computing, synchronize)

    def _read_chunk(self, cache: LayerCache) -> int:
        """Experts one read round takes: enough for every reader thread, within the staging bounds."""
        return max(self.read_threads, min(READ_BATCH, STAGING_BYTES // cache.layout.expert_nbytes))

    def _book_read(self, cache: LayerCache, count: int, seconds: float):
        nbytes = count * cache.layout.expert_nbytes
        self.ledger.add(self.phase, cache.layer, experts_read=count, bytes_read=nbytes, read_s=seconds)

    def _read(
        self, cache: LayerCache, ids: np.ndarray, keep: list, synchronize: bool = True
    ) -> tuple[list[int], dict, list[Read]]:
        """Demand reads of `ids`: (experts read, their bytes by part, reads to recycle). With nothing in
        flight and no helper threads, this thread reads them into its own staging, with no hand-off at
        all; otherwise through the reader, which waits for late prefetches (installed here) and
        parallelises the rest."""
        if self.read_threads == 1 and (self.governor is None or not self.reader.busy):
            staging = self._staging.get(cache.layout.shape_key)
            if staging is None or staging.size < len(ids):
                staging = self._staging[cache.layout.shape_key] = Staging(
                    cache.layout, max(len(ids), READ_BATCH)
                )
            try:
                return ids.tolist(), self.store.read(cache.layout, ids, staging), []
            except OSError as e:
                self._failed(cache.layout, ids, e)
        t0 = time.perf_counter()
        reads, late = self.reader.fetch(cache.layer, ids)
        self._take_late(cache.layer, late, 0.0 if reads else time.perf_counter() - t0, keep, synchronize)
        failed = [r for r in reads if r.error is not None]
        if failed:
            self.reader.recycle(reads)
            self._failed(cache.layout, [r.expert for r in failed], failed[0].error)
        return [r.expert for r in reads], _rows(reads), reads

    def _failed(self, layout, ids, error: BaseException):
        """Raise a failed demand read's error here, on the generation thread: an OSError as the
        `ExpertReadError` that fails the request (nothing of the read was installed)."""
        if isinstance(error, OSError) and not isinstance(error, ExpertReadError):
            raise self.store.read_error(layout, ids, error) from error
        raise error

    def _future(self, layer: int) -> np.ndarray | None:
        """Passes until each expert of `layer` is needed again, where the policy knows (the oracle);
        a layer the running pass has not reached yet still has this pass's use ahead of it."""
        reached = self._running_layer is not None and layer <= self._running_layer
        return self.policy.next_uses(self._pass_index if reached else self._pass_index - 1, layer)

    def _book_install(
        self,
        layer: int,
        installed: Installed | None,
        count: int,
        seconds: float,
        prefetched: bool,
        refused: int = 0,
    ):
        """Book an install (`installed` None: nothing went in); `refused`: prefetches not installable."""
        evictions, unused = (installed.evictions, installed.unused_prefetches) if installed else (0, 0)
        kind = "prefetch_" if prefetched else ""
        counts = {f"{kind}installed": count, f"{kind}install_s": seconds}
        self.ledger.add(self.phase, layer, evictions=evictions, prefetch_wasted=unused + refused, **counts)

    def _install_prefetched(self, reads: list[Read], protect: Sequence[int], synchronize: bool = True):
        """Install finished reads of one layer, best first, as far as unprotected slots allow. A prefetch
        never evicts an expert predicted for the same run of its layer. A failed read is dropped (booked
        as wasted): a layer that needs the expert reads it on demand, and that read's error, if it fails
        again, fails the request that needs it."""
        start = time.perf_counter()
        layer = reads[0].layer
        cache = self.caches[layer]
        protect = list(protect) + self.reader.wanted(layer)
        self.ledger.add(
            self.phase, layer, prefetch_taken=len(reads), prefetch_bytes=sum(r.nbytes for r in reads)
        )
        fresh = [r for r in reads if r.error is None and cache.slot_of[r.expert] < 0]
        future = self._future(layer)
        if future is None:
            fresh = fresh[: cache.room(protect=protect)]
        else:
            fresh = _paying(cache, fresh, protect, future, self.clock)
        installed, t0 = None, time.perf_counter()
        if fresh:  # demand got there first, or no slot may be evicted for the others: they bought nothing
            installed = cache.install(
                [r.expert for r in fresh],
                _rows(fresh),
                prefetched=True,
                protect=protect,
                clock=self.clock - 0.5,
                arrays=_arrays(fresh),
                next_use=future,
                synchronize=synchronize,
            )
        t1 = time.perf_counter()
        self._book_install(
            layer, installed, len(fresh), t1 - t0, prefetched=True, refused=len(reads) - len(fresh)
        )
        self.reader.recycle(reads)
        # choosing what goes in is prefetch's cost too; the install itself is booked apart (a demand read
        # of the same expert would have cost it as well)
        self.ledger.reader["busy_s"] += (t0 - start) + (time.perf_counter() - t1)

    def _install_ready(self, protect: dict[int, Sequence[int]]):
        """Install every finished read, one install per layer."""
        by_layer: dict[int, list[Read]] = {}
        for r in sorted(self.reader.take_ready(), key=lambda r: (-r.score, r.layer, r.expert)):
            # threads finish in any order
            by_layer.setdefault(r.layer, []).append(r)
        for layer, reads in by_layer.items():
            self._install_prefetched(reads, protect.get(layer, ()))

    def _take_late(
        self, layer: int, late: list[Read], waited_s: float, protect: Sequence[int], synchronize: bool = True
    ):
        """Book and install prefetches a demand miss found in flight (`waited_s` for them)."""
        if late:
            self.ledger.add(self.phase, layer, wait_s=waited_s, prefetch_late=len(late))
            self._install_prefetched(late, protect, synchronize)

    def _await_late(self, layer: int, ids, protect: Sequence[int]) -> bool:
        """Wait for the prefetches of `ids` being read (instead of reading them twice) and install them;
        whether there were any."""
        t0 = time.perf_counter()
        _, late = self.reader.fetch(layer, ids, read=False)
        self._take_late(layer, late, time.perf_counter() - t0, protect)
        return bool(late)

    def _claim(self, layer: int, missing: np.ndarray, uniq: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Late prefetches: wait for misses being read instead of reading them twice; the rest."""
        if not self._await_late(layer, missing, uniq):
            return missing
        cache = self.caches[layer]
        still = missing[cache.slot_of[missing] < 0]
        arrived = np.setdiff1d(missing, still)
        self._touch(cache, arrived, counts[np.searchsorted(uniq, arrived)])
        return still

    def _submit(self, predictions: list[Prediction]):
        """Queue the predicted experts that are not resident; the governor says how many per layer, and
        where the policy estimates next uses, only those needed sooner than the experts they would evict."""
        if not predictions:
            return
        t0 = time.perf_counter()
        floor = self.governor.min_score
        for layer, experts, scores in predictions:
            experts, scores = np.asarray(experts), np.asarray(scores)
            order = np.argsort(-scores, kind="stable")[: self.governor.take(len(experts))]
            chosen = {int(experts[n]): float(scores[n]) for n in order}
            cache = self.caches[layer]
            absent = [e for e in chosen if cache.slot_of[e] < 0 and chosen[e] >= floor]
            future = self._future(layer) if absent else None
            if future is not None:  # read only what would go in: needed sooner than what it evicts
                protect = list(chosen) + self.reader.wanted(layer)
                absent = _worth(cache, absent, protect, future, self.clock, strict=True)
            self.reader.submit(layer, chosen, absent)
        self.ledger.reader["busy_s"] += time.perf_counter() - t0

    def _drain(self):
        """Synchronous prefetch: every read requested so far lands before this layer runs."""
        while self.reader.drain():
            self._install_ready({})
        self._install_ready({})


def _paying(cache: LayerCache, fresh: list[Read], protect, future: np.ndarray, clock: float) -> list[Read]:
    """The prefetched reads worth installing where next uses are known or estimated (`_worth`)."""
    worth = set(_worth(cache, [r.expert for r in fresh], protect, future, clock))
    return sorted((r for r in fresh if r.expert in worth), key=lambda r: future[r.expert])


def _worth(cache: LayerCache, experts, protect, future: np.ndarray, clock: float, strict=False) -> list[int]:
    """Of the absent `experts`, those each needed no later (`strict`: sooner) than the expert it would
    evict (a free slot evicts nothing), soonest first; the others would cost a read, not save one."""
    free = int((cache.expert_in_slot < 0).sum())
    victims = cache.evictable(clock, protect, future)  # needed farthest ahead first
    room = np.concatenate([np.full(free, np.inf), future[cache.expert_in_slot[victims]]])
    worth = []
    for e, limit in zip(sorted(experts, key=lambda e: future[e]), room):
        if future[e] > limit or strict and future[e] == limit:
            break
        worth.append(e)
    return worth


def _take_lanes(indices: mx.array, lanes: np.ndarray) -> mx.array:
    """The routed expert ids at positions `lanes` of the last axis."""
    return mx.take(indices, mx.array(lanes.astype(np.int32)), axis=-1)


def _rows(reads: list[Read]) -> dict:
    """The finished reads' bytes by part, as per-expert rows (what `LayerCache.install` takes)."""
    return {key: [r.raw[key][0] for r in reads] for key in reads[0].raw} if reads else {}


def _arrays(reads: list[Read]) -> list | None:
    """The flat MLX arrays the reader made of the reads' bytes (None for a read it made none of); None if
    it made none at all."""
    made = [r.arrays for r in reads]
    return None if all(a is None for a in made) else made
