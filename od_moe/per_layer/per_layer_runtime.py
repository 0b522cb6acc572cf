"""The per-layer runtime: what happens at every MoE layer between routing and the expert math.

Every `OffloadedSwitch` of a model calls `route(layer, hidden, indices)` once per forward pass and
computes on the slots it yields; `route` reads top to bottom, one layer of one decoded token:
1. Layer 0 only, between passes: deferred routing is accounted for (`settle`), the governor looks at
   the token that ended, and finished prefetch reads are installed.
2. Layers whose routing need not be known now compute at once: a fully resident layer only counts its
   lookups (its ids are its slots when the cache holds experts in id order) unless a hook or a recording
   needs the routing; an optimistic decode pass's layers (`optimistic.py`) leave a lazy flag instead,
   read once with the logits (`first_missing_layer`), and a pass that missed runs again from its first
   missing layer (`resumed_pass`). Such passes run only without prefetch (prefetching from them was
   measured and removed: see docs/GPU.md, "Optimistic passes with prefetch").
3. The policy's `before_layer` hook runs (profile seeding happens here) and, when prefetch is on,
   predicts experts for layers ahead (lazy arrays). Skip mode and resident layers a hook watches
   compute without a sync too: their routing is accounted for at the next pass (`settle`); skip mode
   scales missing experts out and loads them then.
4. Exact mode: the layer's routing and the predictions are evaluated together (the layer's one sync);
   `after_routing` hooks run; finished reads are installed; lookups and hits are counted; misses are
   claimed from the reader if being read ("late"), else read and installed here (`loader.py`); the
   predictions are queued for the reader; the slots go to the switch (with a scratch stack of the
   routed experts that do not fit, `Loader.overflow`). With `split_on_miss` (by default on the CPU
   backend, for large experts) a decode layer that misses first hands back its resident experts, which
   compute while the missing ones are read.
Every lookup is booked in the ledger (`accounting/ledger.py`) here, once; reads and installs in `loader.py`.
A demand read that fails raises `ExpertReadError` out of `route` (the request fails; nothing of the read
is installed, so the caches stay consistent). Everything here runs on the generation thread. The runtime is
configured once, by `PerLayerSettings` (`settings.py`) and `set_policy`; nothing writes into it afterwards.
Not here: the forward math (`offloaded_switch.py`), reads and installs (`loader.py`), reading ahead
(`reader.py`), choosing how much to read ahead (`prefetch/governor.py`) or what (`prefetch/policies.py`).
"""

import contextlib
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..accounting.ledger import Ledger
from ..caching.layer_cache import LayerCache
from ..memory import backend
from ..model_surgery.routing import routing_weights, tap_router
from ..prefetch.governor import Governor, PrefetchSettings
from ..prefetch.policies import OnDemand, Prediction, Step
from ..runtime import ExpertIds, PathFigures, Runtime, TwoTierMode
from ..storage.store import ExpertStore
from . import optimistic
from .loader import Loader, install_rate, put_back, read_into_slots
from .offloaded_switch import OffloadedSwitch
from .passes import Passes
from .reader import SMALL_EXPERT_BYTES, Reader
from .settings import PerLayerSettings

MISS_POLICIES = ("load", "skip")
MISS_RATE_WEIGHT = 0.125  # the decode token miss rate is a moving average over about 8 tokens


class Route(NamedTuple):
    """What a switch computes on: slots of the routed experts, and in skip mode a per-expert scale;
    `stacks`: the arrays to compute on instead of the slots' own (the slots and a scratch stack of the
    routed experts that did not fit, `Loader.overflow`); `launch`: the host waited for this
    layer's routing, so its computation should start at once. `lanes`: a round of a decode token that
    computes only the routed experts at these positions (`slots` holds theirs alone), started at once:
    the runtime reads the next round's experts meanwhile; the switch puts the rounds' outputs back in
    routing order."""

    slots: mx.array
    scale: mx.array | None = None
    stacks: dict | None = None
    launch: bool = False
    lanes: np.ndarray | None = None


class Flag(NamedTuple):
    """A layer of an optimistic pass (`optimistic.py`): its routing, and whether a routed expert was
    absent (both lazy)."""

    layer: int
    indices: mx.array
    phase: str
    absent: mx.array


class PerLayerRuntime(Runtime):
    """The per-layer path behind every `OffloadedSwitch` of one model (see the module docstring)."""

    def __init__(
        self,
        store: ExpertStore,
        caches: list[LayerCache],
        settings: PerLayerSettings,
        routers: list | None = None,
    ):
        if settings.miss_policy not in MISS_POLICIES:
            raise ValueError(f"unknown miss policy {settings.miss_policy!r}")
        self.store, self.caches, self.miss_policy = store, caches, settings.miss_policy
        self.mode, self.mode_reason = TwoTierMode.OFF, settings.mode_reason
        self.settings = _settled(settings, caches)  # every None settled for this backend and model
        self.ledger = Ledger(len(caches))
        self.passes = Passes()
        copy_installs = bool(self.settings.copy_installs)  # settled: never None
        self.loader = Loader(store, caches, self.ledger, self.passes, settings.read_threads, copy_installs)
        self._blocks = routers or []  # the MoE blocks whose routers are tapped where outputs are needed
        self._taps: list = [None] * len(caches)  # RouterTaps where router outputs are needed
        if settings.miss_policy == "skip":  # skip mode weighs the resident experts by the router's output
            self._taps = [tap_router(block) for block in self._blocks]
        self._prefetch: PrefetchSettings | None = None  # how prefetch runs, while it does (`set_policy`)
        self._deferred: list[tuple[int, mx.array, str]] = []  # routing booked at the next sync (`settle`)
        self._pass_started: float | None = None
        self._token_miss_rate = self.settings.assumed_token_miss_rate  # did a decode token miss anywhere
        self._pass_missed = False
        # an optimistic pass (`optimistic.py`): the flags of its layers while it runs; in its second run,
        # the first layer that missed
        self._flags: list[Flag] | None = None
        self._resume_from: int | None = None
        self.host_syncs = 0  # evaluations the per-layer path waited for (routing, settling, flags)
        self._optimistic_passes = self._optimistic_misses = 0  # passes run optimistically; those that missed

    # -- configuration ---------------------------------------------------------------------------
    def set_policy(self, policy, settings: PrefetchSettings | None = None, experts_per_layer: int = 0):
        """Use `policy`; with `settings`, a governor has the reader prefetch what it predicts."""
        self.loader.cancel_prefetches()
        self._prefetch = settings
        self.passes.use_policy(policy, next_uses=settings is None or settings.next_use_estimates)
        if policy.reads_router_outputs:
            self._taps = [tap_router(block) for block in self._blocks]
        governor = None
        if settings is not None:
            governor = Governor(settings, self.ledger, settings.experts_per_layer or experts_per_layer)
        self.loader.use_governor(governor)

    @property
    def policy(self):
        """The prefetch policy whose hooks run at every layer (`set_policy`)."""
        return self.passes.policy

    @property
    def governor(self) -> Governor | None:
        """How much to prefetch and whether it pays; None while no prefetch runs."""
        return self.loader.governor

    @property
    def reader(self) -> Reader:
        """The reader threads (`Loader.reader`)."""
        return self.loader.reader

    def load(self, cache: LayerCache, ids: ExpertIds, protect: ExpertIds = (), **kwargs) -> None:
        """Read experts `ids` of `cache`'s layer and install them, now (`Loader.load`)."""
        self.loader.load(cache, ids, protect, **kwargs)

    def place(self, cache: LayerCache, expert_in_slot: np.ndarray, arrays: dict | None = None):
        """Put each expert of `expert_in_slot` (-1: empty) into that slot (a snapshot's): `arrays` where
        given (a ValueError where they do not fit), else read from the model's files (`read_into_slots`)."""
        if arrays is None:
            read_into_slots(self.loader, cache, expert_in_slot)
        else:
            cache.restore(expert_in_slot, arrays)

    def prepare_batches(self, lanes: int):
        """Nothing to make ahead: a batch's pass reads what it misses as any pass does."""

    def slot_arrays(self, cache: LayerCache) -> dict[str, mx.array]:
        """What `cache`'s slots hold, by `proj.part` name (snapshots; two tiers keep them elsewhere)."""
        return cache.stacked_arrays()

    def close(self):
        """Stop prefetching and the reader threads (demand reads start them again)."""
        self.loader.close()
        self.passes.use_policy(OnDemand())
        self._prefetch = None

    def reset_counts(self):
        """Zero the ledger; reads still in flight count as issued, so the prefetch invariant holds."""
        self.settle()
        self.ledger.reset()
        self.host_syncs = self._optimistic_passes = self._optimistic_misses = 0
        for cache in self.caches:
            cache.forget_prefetches()
        self.loader.reset_counts()

    def start_prompt(self, prompt):
        """A new prompt: passes count from zero again (oracle traces are indexed by them)."""
        self.passes.start_prompt()
        self._pass_started = None  # the time between two prompts is not a token's
        self.policy.prompt_start(prompt)

    def start_recording(self):
        """Record the routing of every pass from now on."""
        self.passes.start_recording()

    def stop_recording(self) -> list[dict[int, np.ndarray]] | None:
        """The routing of every pass since `start_recording`: [{layer: ids (tokens, k)}, ...] (None where
        nothing was being recorded)."""
        self.settle()
        return self.passes.stop_recording()

    def generation_model(self, model):
        """`model` with optimistic decode passes (`optimistic.py`), which run where `settings.optimistic`
        is on."""
        return optimistic.OptimisticModel(model, self)

    def read_ahead(self):
        """This runtime itself: its pass clock (`passes`) and read queue (`loader`)."""
        return self

    def figures(self) -> PathFigures:
        """Prefetch reads pending and the governor's state; optimistic passes."""
        passes = {
            "enabled": self.settings.optimistic,
            "passes": self._optimistic_passes,
            "missed": self._optimistic_misses,
            "token_miss_rate": self._token_miss_rate,
        }
        slots, experts = self.caches[0].capacity, self.caches[0].num_experts
        tiers = {"device": slots, "host": 0, "disk": experts - slots}
        if self.governor is None:  # no prefetch: its figures "off"
            return PathFigures(optimistic=passes, tiers=tiers)
        prefetch = dict(pending=self.reader.counts()["pending"], **self.governor.stats())
        return PathFigures(prefetch=prefetch, optimistic=passes, tiers=tiers)

    def transfer_rates(self, repeats: int = 5) -> dict[str, float]:
        """Bytes a second at which this path installs read experts into a layer's slots ("installed", and
        "best": the same, its only way), measured now on the first MoE layer as `bench/roofline.py`'s
        `install_bandwidth` measures it (`loader.install_rate`: from the arrays the reader threads would
        make, where they make them). Then the layer's experts are read back into the slots they held
        (pins kept; their recency starts afresh); the ledger is unchanged (nothing is booked)."""
        cache = self.caches[0]
        held, pinned = cache.expert_in_slot.copy(), cache.expert_in_slot[cache.pinned]
        rate = install_rate(self.store, cache, self.loader.makes_arrays, repeats)
        put_back(self.store, cache, held)
        if pinned.size:
            cache.pin(pinned.tolist())
        return {"installed": rate, "best": rate}

    # -- the per-layer path ----------------------------------------------------------------------
    def route(self, layer: int, hidden: mx.array, indices: mx.array) -> Iterator[Route]:
        """One MoE layer of a pass, from its input (`hidden`) and routing (`indices`, lazy) to the slots of
        its routed experts, once they are resident: the switch computes on each `Route` yielded (see the
        module docstring)."""
        cache, tokens = self.caches[layer], indices.size // indices.shape[-1]
        phase = "prefill" if hidden.ndim >= 2 and hidden.shape[-2] > 1 else "decode"
        resume_from = self._resume_from  # an optimistic pass run again from here: its start is booked
        resumed = resume_from is not None
        new_pass = layer == 0 and not resumed
        # 1. between passes: what the last one left is booked, the governor looks at it
        if new_pass:
            self._between_passes()
        self.passes.at_layer(layer, new_pass)

        # 2. routing not needed now: compute at once
        if resume_from is not None and layer < resume_from:  # all resident, as the first run found; booked
            yield Route(cache.routed_slots(indices))
            return
        if cache.is_full() and self._nobody_watches():  # nothing can miss: count, and compute
            if not resumed:  # (its first run counted it)
                if new_pass:
                    self._start_pass(tokens, phase)
                self.ledger.count_lookups(phase, layer, indices.size, indices.size)
            yield Route(cache.routed_slots(indices))
            return
        if self._flags is not None:  # an optimistic run: a lazy flag says whether an expert was absent
            if new_pass:
                self._start_pass(tokens, phase)
            absent = mx.logical_not(cache.resident_mask()[indices]).any()
            self._flags.append(Flag(layer, indices, phase, absent))
            yield Route(cache.routed_slots(indices))
            return

        # 3. the policy's hook; routing learnt at the next sync (resident, or skip mode)
        exact = self.miss_policy == "load" and not cache.is_full()
        step, predictions = self._before_layer(layer, hidden, phase, exact)
        if new_pass:  # after the hook: seeding belongs to the time of the pass that ended
            self._start_pass(tokens, phase)
        if not exact:
            self._deferred.append((layer, indices, phase))
            if self.miss_policy == "skip":
                yield _skipping(cache, self._taps[layer], indices)
            else:
                yield Route(cache.routed_slots(indices))
            return

        # 4. exact: the routing, with the predictions made at this layer (its one sync)
        self._evaluate(layer, indices, predictions)
        ids = np.array(indices).astype(np.int64)
        self._after_routing(step, ids)
        uniq, counts = np.unique(ids, return_counts=True)
        if step.prefetching:  # between layers: the cooperative install point
            self.reader.withdraw(layer)
            self.loader.install_ready({layer: uniq})
        # lookups and hits
        resident = cache.slot_of[uniq] >= 0
        hits = counts[resident]
        self.ledger.count_lookups(phase, layer, ids.size, hits.sum(), uniq.size, hits.size)
        self.loader.touch(cache, uniq[resident], hits)
        # misses: waited for where prefetch is reading them, else read here
        missing = uniq[~resident]
        self._pass_missed |= bool(missing.size)
        if missing.size and step.prefetching:
            missing = self.loader.claim(layer, missing, uniq, counts)
        fits = missing.size <= cache.room(protect=uniq)
        launch = self.settings.launch_early
        one_token = ids.size == ids.shape[-1]
        if self.settings.split_on_miss and fits and 0 < missing.size < uniq.size and one_token:
            # a decode token's layer in two rounds: its resident experts compute while the missing ones
            # are read and installed (into slots the first round does not read: the routed experts are
            # protected, so no copy waits for the device), then the missing ones compute. Each routed
            # expert's output is computed once, as in one round, so the result is the same
            missed = np.isin(ids.reshape(-1), missing)
            here, later = np.flatnonzero(~missed), np.flatnonzero(missed)
            yield Route(cache.routed_slots(_take_lanes(indices, here)), lanes=here)
            self.loader.load_missing(cache, missing, uniq, counts, synchronize=False)
            self.loader.submit(predictions)
            yield Route(cache.routed_slots(_take_lanes(indices, later)), launch=launch, lanes=later)
            return
        if missing.size and fits:
            self.loader.load_missing(cache, missing, uniq, counts)
        self.loader.submit(predictions)
        # the expert computation: on the slots (their lookup table made anew only when experts changed)
        if fits:
            yield Route(cache.routed_slots(indices), launch=launch)
        else:  # more routed experts than slots: a scratch stack beside them
            slots, stacks = self.loader.overflow(cache, indices, uniq, counts, missing)
            yield Route(slots, stacks=stacks, launch=launch)

    def _before_layer(
        self, layer: int, hidden: mx.array, phase: str, exact: bool
    ) -> tuple[Step, list[Prediction]]:
        """The policy's hook before a layer that may sync: its step, and what it predicts (lazy)."""
        if exact and self._prefetch is not None and self._prefetch.synchronous:
            self.loader.drain()
        governor = self.governor
        prefetching = exact and governor is not None and (governor.active or self.reader.busy)
        tap = self._taps[layer]
        step = Step(
            self.passes.index,
            layer,
            phase,
            hidden,
            tap.logits if tap is not None else None,
            predict=prefetching and phase == "decode" and governor is not None and governor.active,
            prefetching=prefetching,
        )
        t0 = time.perf_counter()
        predictions = self.policy.before_layer(step)
        if step.predict:
            self.ledger.count_reader(busy_s=time.perf_counter() - t0)
        return step, predictions

    def _nobody_watches(self) -> bool:
        """No policy hook and no recording needs the routing (so a full cache need not know it)."""
        return self.passes.recording is None and type(self.policy) is OnDemand

    # -- optimistic decode passes (`optimistic.py` runs them) -------------------------------------
    def may_pass_optimistically(self) -> bool:
        """Whether the next decode pass may run optimistically: `settings.optimistic`, exact mode, no
        prefetch, a policy that allows it, and recent decode tokens missed rarely (a recording learns the
        pass's routing with its flags)."""
        return (
            self.settings.optimistic is True
            and self.miss_policy == "load"
            and self.policy.optimistic_passes
            and self.governor is None
            and self._token_miss_rate < optimistic.OPTIMISTIC_BELOW
            and not all(c.is_full() for c in self.caches)  # then no layer syncs anyway
        )

    def begin_optimistic_pass(self):
        """The next pass runs optimistically: a layer whose experts are not all resident computes without
        a sync (an absent expert on slot 0: wrong but finite) and leaves a lazy flag saying whether one was
        absent, until `first_missing_layer` reads them (or `cancel_optimistic_pass`)."""
        self._flags = []

    def cancel_optimistic_pass(self):
        """The optimistic pass did not finish (it raised): the next pass runs as usual."""
        self._flags = None

    def first_missing_layer(self, logits: mx.array) -> int | None:
        """End the optimistic pass: read its flags with its `logits` (its one sync), book the layers before
        the first that missed as exact mode would have, and return that layer (None: none missed, and the
        pass stands)."""
        flags, self._flags = self._flags, None
        if not flags:  # every layer was fully resident: nothing to check, and no sync
            return None
        mx.eval(logits, [f.indices for f in flags], [f.absent for f in flags])
        self.host_syncs += 1
        self.loader.synced()
        first_miss = next((f.layer for f in flags if f.absent.item()), None)
        for flag in flags:
            if first_miss is not None and flag.layer >= first_miss:
                break
            self._book_routing(flag.layer, flag.indices, flag.phase)  # all resident: nothing absent
        self._pass_missed = first_miss is not None
        self._optimistic_passes += 1
        self._optimistic_misses += self._pass_missed
        return first_miss

    @contextlib.contextmanager
    def resumed_pass(self, first_miss: int):
        """Within: the optimistic pass runs again, from `first_miss` as exact mode runs it; the layers
        before compute as they did, with no sync (their inputs, so their routing, are the same) and no
        booking (done by `first_missing_layer`)."""
        self._resume_from = first_miss
        try:
            yield
        finally:
            self._resume_from = None

    # -- between passes --------------------------------------------------------------------------
    def _between_passes(self):
        self.settle()
        if self.passes.phase == "decode" and self.passes.clock:  # the pass that ended: did it miss anywhere
            weight = MISS_RATE_WEIGHT
            self._token_miss_rate = (1 - weight) * self._token_miss_rate + weight * float(self._pass_missed)
        now = time.perf_counter()
        if self.governor is not None:  # between tokens: the cooperative install point
            self.governor.end_token(
                self.passes.phase, now - self._pass_started if self._pass_started else None
            )
            self.loader.install_ready({})
        self._pass_started = now

    def _start_pass(self, tokens: int, phase: str):
        self.passes.start(phase)
        self._pass_missed = False
        self.ledger.count_forward(phase, tokens)
        if self.loader.rows is not None:
            self.loader.rows.begin_pass(phase == "decode")

    def settle(self):
        """Account for routing that needed no sync; in skip mode, load what missed so later tokens hit.
        With synchronous prefetch, also wait for the reads in progress (so counts repeat exactly)."""
        if self._prefetch is not None and self._prefetch.synchronous:
            self.reader.drain()
        if not self._deferred:
            return
        deferred, self._deferred = self._deferred, []
        mx.eval([indices for _, indices, _ in deferred])
        self.host_syncs += 1
        for layer, indices, phase in deferred:
            missing, uses = self._book_routing(layer, indices, phase)
            if missing.size and self.miss_policy == "skip":
                cache = self.caches[layer]
                most_used_first = missing[np.argsort(-uses, kind="stable")]
                fit = most_used_first[: cache.room()]
                if fit.size:
                    self.loader.load(cache, np.sort(fit))

    def _book_routing(self, layer: int, indices: mx.array, phase: str) -> tuple[np.ndarray, np.ndarray]:
        """Account for a layer's routing known after it computed (evaluated `indices`): the policy's hook,
        lookups and hits, the uses of resident experts; returns the absent experts and their uses."""
        cache = self.caches[layer]
        ids = np.array(indices).astype(np.int64)
        self._after_routing(Step(self.passes.index, layer, phase, None, None, False, False), ids)
        uniq, counts = np.unique(ids, return_counts=True)
        resident = cache.slot_of[uniq] >= 0
        hits = counts[resident]
        self.ledger.count_lookups(phase, layer, ids.size, hits.sum(), uniq.size, hits.size)
        self.loader.touch(cache, uniq[resident], hits)
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
            self.ledger.count_reader(busy_s=time.perf_counter() - t0)
            self.host_syncs += 2
        else:
            mx.eval(indices, lazy)
            self.host_syncs += 1
        self.loader.synced(layer)

    def _after_routing(self, step: Step, ids: np.ndarray):
        self.passes.record(step.layer, ids)
        t0 = time.perf_counter()
        self.policy.after_routing(step, ids)
        if step.prefetching:  # the policy's bookkeeping for prefetch: part of what prefetch costs
            self.ledger.count_reader(busy_s=time.perf_counter() - t0)


def _settled(settings: PerLayerSettings, caches: list[LayerCache]) -> PerLayerSettings:
    """`settings` with every None decided for this backend and these experts:
    - optimistic passes where a sync stalls the device, which then idles; on the CPU a sync costs nothing
      and a pass run again does (docs/BENCHMARKS.md, "Investigations");
    - a decode layer that misses computes its resident experts while the missing ones are read on the CPU
      backend, for experts large enough that reading them takes time; small experts and GPUs, where a sync
      stalls the device, lost by it (docs/BENCHMARKS.md, "Investigations");
    - installs copy read bytes into the slots where MLX arrays are host memory (`Loader.copy_installs`)."""
    stalls = backend.syncs_stall_device()
    large = max(c.layout.expert_nbytes for c in caches) >= SMALL_EXPERT_BYTES
    return replace(
        settings,
        optimistic=stalls if settings.optimistic is None else settings.optimistic,
        split_on_miss=large and not stalls if settings.split_on_miss is None else settings.split_on_miss,
        copy_installs=(
            backend.arrays_in_host_memory() if settings.copy_installs is None else settings.copy_installs
        ),
    )


def _skipping(cache: LayerCache, tap, indices: mx.array) -> Route:
    """Skip mode: missing experts' outputs are zeroed and the others rescaled so the routing weights of
    the resident experts sum to what all k summed to; no sync."""
    slots = cache.routed_slots(indices)
    if cache.is_full():
        return Route(slots)
    present = cache.resident_mask()[indices].astype(mx.float32)
    weights = routing_weights(tap.output if tap is not None else None, indices)
    kept = (weights * present).sum(axis=-1, keepdims=True)
    scale = mx.where(kept > 0, weights.sum(axis=-1, keepdims=True) / mx.maximum(kept, 1e-30), 0.0)
    return Route(slots, scale=present * scale)


def _take_lanes(indices: mx.array, lanes: np.ndarray) -> mx.array:
    """The routed expert ids at positions `lanes` of the last axis."""
    return mx.take(indices, mx.array(lanes.astype(np.int32)), axis=-1)


def build(
    store: ExpertStore, blocks, caches: list[LayerCache], settings: PerLayerSettings
) -> PerLayerRuntime:
    """The per-layer runtime over `caches` (made over `blocks`' switches, `assembly.cache_for`), with an
    `OffloadedSwitch` put where each block's switch was; skip mode taps the routers (it weighs the resident
    experts by the router's output)."""
    runtime = PerLayerRuntime(store, caches, settings, [b.block for b in blocks])
    for i, block in enumerate(blocks):
        block.replace_switch(OffloadedSwitch(block.switch, runtime, i))
    return runtime
