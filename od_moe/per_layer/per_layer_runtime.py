"""The per-layer runtime: what happens at every MoE layer between routing and the expert math.

Every `OffloadedSwitch` of a model calls `route(layer, x, indices)` once per forward pass and computes on
the slots it gets back. One decoded token, top to bottom:
1. Layer 0 only, between passes: deferred routing is accounted for (`settle`), the governor looks at
   the token that ended, and finished prefetch reads are installed.
2. The policy's `before_layer` hook runs (profile seeding happens here) and, when prefetch is on,
   predicts experts for layers ahead (lazy arrays).
3. Exact mode: the layer's routing and the predictions are evaluated together (the layer's one sync);
   `after_routing` hooks run; finished reads are installed; lookups and hits are counted; misses are
   claimed from the reader if being read ("late"), else read and installed here (`loader.py`); the
   predictions are queued for the reader; the slots go back to the switch (with a scratch stack of the
   routed experts that do not fit, `Loader.overflow`). On the CPU backend a decode layer that misses
   first hands back its resident experts, which compute while the missing ones are read (`_split`).
   A layer whose experts are all resident only counts its lookups (its ids are its slots when the cache
   holds experts in id order) unless a hook or a recording needs the routing; such layers and skip
   mode never sync: their routing is accounted for at the next pass (`settle`); skip mode scales
   missing experts out and loads them then. An optimistic decode pass (`optimistic.py`) does not sync
   at partly resident layers either: each leaves a lazy flag, read once with the logits, and a pass
   that missed runs again from its first missing layer; such passes run only without prefetch
   (prefetching from them was measured and removed: see docs/GPU.md, "Optimistic passes with prefetch").
Every lookup is booked in the ledger (`accounting/ledger.py`) here, once; reads and installs in `loader.py`. A
demand
read that fails raises `ExpertReadError` out of `route` (the request fails; nothing of the read is
installed, so the caches stay consistent). Everything here runs on the generation thread. Not here: the
forward math (`offloaded_switch.py`), reads and installs (`loader.py`), reading ahead (`reader.py`),
choosing how
much to read ahead (`prefetch/governor.py`) or what (`prefetch/policies.py`).
"""

import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import mlx.core as mx
import numpy as np

from ..accounting.ledger import Ledger
from ..caching.layer_cache import LayerCache
from ..memory import backend
from ..model_surgery.routing import routing_weights, tap_router
from ..prefetch import governor as governor_module
from ..prefetch.governor import Governor, PrefetchSettings
from ..prefetch.policies import OnDemand, Prediction, Step
from ..runtime import PathFigures, TwoTierMode
from ..storage.store import ExpertStore
from .loader import Loader, read_into_slots
from .offloaded_switch import OffloadedSwitch
from .optimistic import OptimisticModel
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


class PerLayerRuntime:
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
        self.ledger = Ledger(len(caches))
        self.passes = Passes()
        self.loader = Loader(store, caches, self.ledger, self.passes, settings.read_threads)
        self._blocks = routers or []  # the MoE blocks whose routers are tapped where outputs are needed
        self.taps: list = [None] * len(caches)  # RouterTaps where router outputs are needed
        if settings.miss_policy == "skip":  # skip mode weighs the resident experts by the router's output
            self.taps = [tap_router(block) for block in self._blocks]
        self.settings: PrefetchSettings | None = None
        self._deferred = []
        self._pass_started: float | None = None
        # may decode passes run optimistically (`optimistic.py`): where a sync stalls the device, which
        # then idles; on the CPU a sync costs nothing and a pass run again does (docs/BENCHMARKS.md,
        # "Investigations")
        self.optimistic = backend.syncs_stall_device() if settings.optimistic is None else settings.optimistic
        self.launch_early = settings.launch_early  # a layer the host synced at starts computing at once
        # a decode layer that misses computes its resident experts while the missing ones are read
        # (`_split`): on the CPU backend, for experts large enough that reading them takes time; small
        # experts and GPUs, where a sync stalls the device, lost by it (docs/BENCHMARKS.md, "Investigations")
        large = max(c.layout.expert_nbytes for c in caches) >= SMALL_EXPERT_BYTES
        split = large and not backend.syncs_stall_device()
        self.split_on_miss = split if settings.split_on_miss is None else settings.split_on_miss
        if settings.copy_installs is not None:
            self.loader.copy_installs = settings.copy_installs
        self.token_miss_rate = 1.0  # moving average: did a decode token miss at any layer
        self.pass_missed = False
        # set by an optimistic pass (`optimistic.py`): (layer, indices, phase, absent flag) of its layers;
        # in its second run, the first layer that missed
        self.speculative: list | None = None
        self.resume_from: int | None = None
        self.host_syncs = 0  # evaluations the per-layer path waited for (routing, settling, flags)
        self.optimistic_passes = self.optimistic_misses = 0  # passes run optimistically; those that missed

    # -- configuration ---------------------------------------------------------------------------
    def set_policy(self, policy, settings: PrefetchSettings | None = None, experts_per_layer: int = 0):
        """Use `policy`; with `settings`, a governor has the reader prefetch what it predicts."""
        self.loader.cancel_prefetches()
        self.passes.policy, self.settings, self.loader.governor = policy, settings, None
        if policy.reads_router_outputs:
            self.taps = [tap_router(block) for block in self._blocks]
        if settings is not None:
            per_layer = settings.experts_per_layer or experts_per_layer
            self.loader.governor = Governor(settings, self.ledger, per_layer)

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

    def load(self, cache: LayerCache, ids: Sequence[int], protect: Sequence[int] = (), **kwargs):
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
        self.passes.policy, self.settings = OnDemand(), None

    def reset_counts(self):
        """Zero the ledger; reads still in flight count as issued, so the prefetch invariant holds."""
        self.settle()
        self.ledger.reset()
        self.host_syncs = self.optimistic_passes = self.optimistic_misses = 0
        for cache in self.caches:
            cache.forget_prefetches()
        self.loader.reset_counts()

    def start_prompt(self, prompt):
        """A new prompt: passes count from zero again (oracle traces are indexed by them)."""
        self.passes.in_prompt = 0
        self._pass_started = None  # the time between two prompts is not a token's
        self.policy.prompt_start(prompt)

    def start_recording(self):
        self.passes.recording = []

    def stop_recording(self) -> list[dict[int, np.ndarray]]:
        """The routing of every pass since `start_recording`: [{layer: ids (tokens, k)}, ...]."""
        self.settle()
        recording, self.passes.recording = self.passes.recording, None
        return recording

    def generation_model(self, model):
        """`model` with optimistic decode passes (`optimistic.py`), which run where `optimistic` is on."""
        return OptimisticModel(model, self)

    def read_ahead(self):
        """This runtime itself: its pass clock (`passes`) and read queue (`loader`)."""
        return self

    def figures(self) -> PathFigures:
        """Prefetch reads pending and the governor's state; optimistic passes."""
        if self.governor is None:
            prefetch = dict(pending=0, **governor_module.OFF)
        else:
            prefetch = dict(pending=self.reader.counts()["pending"], **self.governor.stats())
        optimistic = {
            "enabled": self.optimistic,
            "passes": self.optimistic_passes,
            "missed": self.optimistic_misses,
            "token_miss_rate": self.token_miss_rate,
        }
        return PathFigures(prefetch=prefetch, optimistic=optimistic)

    # -- the per-layer path ----------------------------------------------------------------------
    def route(self, layer: int, x: mx.array, indices: mx.array) -> Iterator[Route]:
        """The slots of a layer's routed experts, once they are resident (see the module docstring)."""
        phase = "prefill" if x.ndim >= 2 and x.shape[-2] > 1 else "decode"
        cache, tokens = self.caches[layer], indices.size // indices.shape[-1]
        resuming = self.resume_from is not None  # the second run of an optimistic pass: booked already
        if layer == 0 and not resuming:
            self._between_passes()
            self.passes.index = self.passes.in_prompt
        self.passes.layer = layer
        if cache.is_full() and self._nobody_watches():  # nothing can miss: count, and compute at once
            if layer == 0 and not resuming:
                self._start_pass(tokens, phase)
            if not resuming:
                self.ledger.count_lookups(phase, layer, indices.size, indices.size)
            yield Route(cache.routed_slots(indices))
            return
        if self.speculative is not None:  # optimistic: no sync; a lazy flag says if anything was absent
            if layer == 0:
                self._start_pass(tokens, phase)
            absent = mx.logical_not(cache.resident_mask()[indices]).any()
            self.speculative.append((layer, indices, phase, absent))
            yield Route(cache.routed_slots(indices))
            return
        if resuming and layer < self.resume_from:  # all resident, as the optimistic run found
            yield Route(cache.routed_slots(indices))
            return
        exact = self.miss_policy == "load" and not cache.is_full()
        step, predictions = self._before_layer(layer, x, phase, exact)
        if layer == 0 and not resuming:  # after the hook: seeding belongs to the time of the pass that ended
            self._start_pass(tokens, phase)
        if not exact:  # all resident, or skip mode: accounted for at the next sync
            self._deferred.append((layer, indices, phase))
            skip = self.miss_policy == "skip"
            yield _skipping(cache, self.taps[layer], indices) if skip else Route(cache.routed_slots(indices))
        else:
            yield from self._route_exact(step, indices, predictions)

    def _before_layer(
        self, layer: int, x: mx.array, phase: str, exact: bool
    ) -> tuple[Step, list[Prediction]]:
        """The policy's hook before a layer that may sync: its step, and what it predicts (lazy)."""
        if exact and self.settings is not None and self.settings.synchronous:
            self.loader.drain()
        prefetching = exact and self.governor is not None and (self.governor.active or self.reader.busy)
        tap = self.taps[layer]
        step = Step(
            self.passes.index,
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
        return step, predictions

    def _route_exact(self, step: Step, indices: mx.array, predictions: list[Prediction]) -> Iterator[Route]:
        layer, cache, loader = step.layer, self.caches[step.layer], self.loader
        self._evaluate(layer, indices, predictions)
        ids = np.array(indices).astype(np.int64)
        self._after_routing(step, ids)
        uniq, counts = np.unique(ids, return_counts=True)
        if step.prefetching:  # between layers: the cooperative install point
            self.reader.withdraw(layer)
            loader.install_ready({layer: uniq})
        resident = cache.slot_of[uniq] >= 0
        hits = counts[resident]
        self.ledger.count_lookups(step.phase, layer, ids.size, hits.sum(), uniq.size, hits.size)
        loader.touch(cache, uniq[resident], hits)
        missing = uniq[~resident]
        self.pass_missed |= bool(missing.size)
        if missing.size and step.prefetching:
            missing = loader.claim(layer, missing, uniq, counts)
        fits = missing.size <= cache.room(protect=uniq)
        if self.split_on_miss and fits and 0 < missing.size < uniq.size and ids.size == ids.shape[-1]:
            yield from self._split(cache, indices, ids, uniq, counts, missing, predictions)
            return
        if missing.size and fits:
            loader.load_missing(cache, missing, uniq, counts)
        loader.submit(predictions)
        if fits:  # the cache's lookup table is made anew only when its experts changed
            yield Route(cache.routed_slots(indices), launch=self.launch_early)
        else:
            slots, stacks = loader.overflow(cache, indices, uniq, counts, missing)
            yield Route(slots, stacks=stacks, launch=self.launch_early)

    def _split(self, cache: LayerCache, indices, ids, uniq, counts, missing, predictions) -> Iterator[Route]:
        """A decode token's layer that misses, in two rounds: its resident experts compute while the
        missing ones are read and installed (into slots the first round does not read: the routed
        experts are protected, so no copy waits for the device), then the missing ones compute. Each
        routed expert's output is computed once, as in one round, so the result is the same."""
        absent = np.isin(ids.reshape(-1), missing)
        here, later = np.flatnonzero(~absent), np.flatnonzero(absent)
        yield Route(cache.routed_slots(_take_lanes(indices, here)), lanes=here)
        self.loader.load_missing(cache, missing, uniq, counts, synchronize=False)
        self.loader.submit(predictions)
        yield Route(cache.routed_slots(_take_lanes(indices, later)), launch=self.launch_early, lanes=later)

    def _nobody_watches(self) -> bool:
        """No policy hook and no recording needs the routing (so a full cache need not know it)."""
        return self.passes.recording is None and type(self.policy) is OnDemand

    # -- between passes --------------------------------------------------------------------------
    def _between_passes(self):
        self.settle()
        if self.passes.phase == "decode" and self.passes.clock:  # the pass that ended: did it miss anywhere
            w = MISS_RATE_WEIGHT
            self.token_miss_rate = (1 - w) * self.token_miss_rate + w * float(self.pass_missed)
        now = time.perf_counter()
        if self.governor is not None:  # between tokens: the cooperative install point
            self.governor.end_token(
                self.passes.phase, now - self._pass_started if self._pass_started else None
            )
            self.loader.install_ready({})
        self._pass_started = now

    def _start_pass(self, tokens: int, phase: str):
        self.passes.start(phase)
        self.pass_missed = False
        self.ledger.count_forward(phase, tokens)
        if self.loader.rows is not None:
            self.loader.rows.begin_pass(phase == "decode")

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
            missing, uses = self.book_routing(layer, indices, phase)
            if missing.size and self.miss_policy == "skip":
                cache = self.caches[layer]
                most_used_first = missing[np.argsort(-uses, kind="stable")]
                fit = most_used_first[: cache.room()]
                if fit.size:
                    self.loader.load(cache, np.sort(fit))

    def book_routing(self, layer: int, indices: mx.array, phase: str) -> tuple[np.ndarray, np.ndarray]:
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
            self.ledger.reader["busy_s"] += time.perf_counter() - t0
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
            self.ledger.reader["busy_s"] += time.perf_counter() - t0


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
