"""Reads and installs of the per-layer path: getting experts into a layer's slots, on the generation thread.

- `load`: demand. Read experts now and install them; prefetches of them already in flight are waited
  for ("late"), not read twice. With one read thread and nothing in flight, this thread reads into its
  own staging, with no hand-off at all; otherwise through the reader (`reader.py`), which parallelises.
- `overflow`: a layer that routes to more experts than it has slots reads the rest into a scratch stack.
- `submit`: queue predicted experts for the reader (prefetch); `install_ready` installs finished ones,
  best first, where unprotected slots allow; `drain` makes every read land now (synchronous prefetch).
- `install_rate`, `put_back`: the bytes a second installs take (`PerLayerRuntime.transfer_rates`), and the
  measured layer's experts read back into their slots, booking nothing.
Where the policy knows when each expert is needed next (`Passes.future`: the oracle, the next-use head),
installs evict the expert needed farthest ahead (Belady's MIN), and a prefetched expert goes in only if
it is needed no later than the one it would evict. Every read and install is booked in the ledger here,
once. A demand read that fails raises `ExpertReadError` (nothing of it is installed); a failed prefetch is
only dropped. Not here: when to read (`per_layer_runtime.py`), the reader threads (`reader.py`), the slots'
bookkeeping and arrays (`caching/layer_cache.py`, `caching/slot_arrays.py`).
"""

import time

import mlx.core as mx
import numpy as np

from ..accounting.ledger import Ledger
from ..caching.layer_cache import Installed, LayerCache
from ..errors import ExpertReadError
from ..memory import backend
from ..prefetch.governor import Governor
from ..prefetch.policies import Prediction
from ..runtime import ExpertIds
from ..storage.layout import ExpertRows, flat_rows
from ..storage.store import ExpertStore
from .passes import Passes
from .reader import Read, Reader

READ_BATCH = 16  # experts per read round at most...
STAGING_BYTES = 8 * 2**20  # ...and at most this many bytes: staging and install copies count against budgets
INSTALL_PROBE = 8  # experts a batch where the install rate is measured (`install_rate`), as the bench does


class Loader:
    """Demand reads, prefetch installs and their booking, for every MoE layer of one runtime."""

    def __init__(
        self,
        store: ExpertStore,
        caches: list[LayerCache],
        ledger: Ledger,
        passes: Passes,
        read_threads: int,
        copy_installs: bool,
    ):
        self.store, self.caches, self.ledger, self.passes = store, caches, ledger, passes
        self.read_threads = read_threads
        self.governor: Governor | None = None  # while prefetch runs (`use_governor`)
        self._reader: Reader | None = None
        self._staging: dict[tuple, ExpertRows] = {}  # this thread's buffers for reads it does itself
        self._copy_installs = copy_installs
        for cache in caches:
            cache.use_host_writes(copy_installs)

    @property
    def reader(self) -> Reader:
        """The reader threads (started again if `close` stopped them)."""
        if self._reader is None or self._reader.closed:
            self._reader = Reader(
                self.store,
                [c.layout for c in self.caches],
                self.ledger,
                self.read_threads,
                make_arrays=self.makes_arrays,
            )
        return self._reader

    @property
    def rows(self):
        """The reader's rows of MLX memory (`mlx_rows.py`), where reads land in them."""
        return self._reader.rows if self._reader is not None else None

    @property
    def copy_installs(self) -> bool:
        """Installs copy the read bytes into the slots where the backend allows (`backend.row_writer`:
        numpy views of host memory, the CUDA runtime's copies); off, they are MLX writes from arrays the
        reader threads make (`PerLayerSettings.copy_installs`, settled at construction). On by default
        where arrays are host memory; off on CUDA, where the runtime's copies moved install work off the
        GPU, where lazy MLX writes overlap the host's work, onto the host, and decode was no faster
        (docs/BENCHMARKS.md, "Investigations")."""
        return self._copy_installs

    @property
    def makes_arrays(self) -> bool:
        """The reader threads make an MLX array of every read's bytes for its install (the installs are MLX
        writes)."""
        return not (self._copy_installs and backend.copies_into_arrays())

    def use_governor(self, governor: Governor | None):
        """Prefetch what is submitted as `governor` sizes it from now on; None: no prefetch."""
        self.governor = governor

    def cancel_prefetches(self):
        """Drop the prefetch requests queued (engines that never prefetch start no reader)."""
        if self._reader is not None:
            self._reader.cancel_prefetches()

    def close(self):
        """Stop the reader threads (demand reads start them again)."""
        if self._reader is not None:
            self._reader.close()
        self.use_governor(None)

    def synced(self, layer: int | None = None):
        """A host sync returned (of MoE layer `layer`'s routing, where given): staging rows whose installs
        surely ran may be read into again."""
        if self.rows is not None:
            self.rows.synced(layer)

    def reset_counts(self):
        """The ledger was zeroed: reads still in flight count as issued, so the prefetch invariant holds."""
        if self.governor is not None:
            counts = self.reader.counts()
            self.ledger.set_reader_issued(counts["reading"] + counts["ready"])
            self.governor.reset()

    def touch(self, cache: LayerCache, ids: np.ndarray, uses: np.ndarray):
        """Resident experts `ids` are used `uses` times now; book prefetched ones used for the first time."""
        first_uses = cache.touch(ids, uses, self.passes.clock)
        if first_uses:
            self.ledger.add(self.passes.phase, cache.layer, prefetch_useful=first_uses)

    # -- demand ----------------------------------------------------------------------------------
    def load(
        self,
        cache: LayerCache,
        ids: ExpertIds,
        protect: ExpertIds = (),
        computing: bool = False,
        synchronize: bool = True,
    ):
        """Read experts `ids` of `cache`'s layer and install them, now; prefetches of them already in flight
        are waited for, not read twice. `computing`: the layer computes next in this pass, on these
        installs (the routing path), so their staging rows are free after a later layer's sync.
        `synchronize=False`: nothing in flight reads the slots these installs may take (a decode layer's
        second round, `PerLayerSettings.split_on_miss`)."""
        wanted = np.asarray(ids, dtype=np.int64)
        chunk = self.read_chunk(cache)
        keep = list(protect) + wanted.tolist()
        for start in range(0, len(wanted), chunk):
            t0 = time.perf_counter()
            experts, raw, reads = self.read(cache, wanted[start : start + chunk], keep, synchronize)
            t1 = time.perf_counter()
            if not experts:
                continue
            self.ledger.add(self.passes.phase, cache.layer, **_read_counts(cache, len(experts), t1 - t0))
            try:
                installed = cache.install(
                    experts,
                    raw,
                    protect=keep,
                    clock=self.passes.clock,
                    arrays=_arrays(reads),
                    next_use=self.passes.future(cache.layer),
                    synchronize=synchronize,
                )
            finally:
                self.reader.recycle(reads, computing=computing)
            booked = _install_counts(installed, len(experts), time.perf_counter() - t1, prefetched=False)
            self.ledger.add(self.passes.phase, cache.layer, **booked)
        refused = wanted[cache.slot_of[wanted] < 0]  # late prefetches that found no slot: read as demand
        if refused.size:
            self.load(cache, refused, protect, computing, synchronize)

    def load_missing(self, cache: LayerCache, missing, uniq, counts, synchronize: bool = True):
        """Read and install a layer's missing routed experts (the routed ones protected) and count their
        uses, as the computation about to run makes them."""
        self.load(cache, missing, protect=uniq, computing=True, synchronize=synchronize)
        self.touch(cache, missing, counts[np.searchsorted(uniq, missing)])

    def read_chunk(self, cache: LayerCache) -> int:
        """Experts one read round takes: enough for every reader thread, within the staging bounds."""
        return max(self.read_threads, min(READ_BATCH, STAGING_BYTES // cache.layout.expert_nbytes))

    def read(
        self, cache: LayerCache, ids: np.ndarray, keep: list, synchronize: bool = True
    ) -> tuple[list[int], dict, list[Read]]:
        """Demand reads of `ids`: (experts read, their bytes by part, reads to recycle). With nothing in
        flight and no helper threads, this thread reads them into its own staging, with no hand-off at
        all; otherwise through the reader, which waits for late prefetches (installed here) and
        parallelises the rest."""
        if self.read_threads == 1 and (self.governor is None or not self.reader.busy):
            staging = self._staging.get(cache.layout.shape_key)
            if staging is None or staging.size < len(ids):
                staging = self._staging[cache.layout.shape_key] = ExpertRows(
                    cache.layout, max(len(ids), READ_BATCH)
                )
            try:
                return ids.tolist(), self.store.read(cache.layout, ids, staging), []
            except OSError as e:
                self._failed(cache.layout, ids, e)
        t0 = time.perf_counter()
        reads, late = self.reader.fetch(cache.layer, ids)
        self._take_late(cache.layer, late, 0.0 if reads else time.perf_counter() - t0, keep, synchronize)
        errors = [r.error for r in reads if r.error is not None]
        if errors:
            self.reader.recycle(reads)
            self._failed(cache.layout, [r.expert for r in reads if r.error is not None], errors[0])
        return [r.expert for r in reads], _rows(reads), reads

    def _failed(self, layout, ids, error: BaseException):
        """Raise a failed demand read's error here, on the generation thread: an OSError as the
        `ExpertReadError` that fails the request (nothing of the read was installed)."""
        if isinstance(error, OSError) and not isinstance(error, ExpertReadError):
            raise self.store.read_error(layout, ids, error) from error
        raise error

    def overflow(self, cache: LayerCache, indices: mx.array, uniq, counts, missing) -> tuple[mx.array, dict]:
        """More distinct routed experts than slots (a batch, or a long prefill chunk, at a small capacity):
        the most used missing experts go into the slots the routed ones leave free; the rest are read into
        a scratch stack beside the slots, and the layer computes once on both (`SlotArrays.with_scratch`),
        each expert's rows grouped as stock mlx-lm groups them, so the result is the same. Nothing routed
        is evicted within the layer, and no expert is read twice. Returns the slots of `indices` and the
        stacks to compute on."""
        admit = _admitted(cache, uniq, counts, missing, self.passes.future(cache.layer), self.passes.clock)
        if admit.size:
            self.load_missing(cache, admit, uniq, counts)
        scratch: list[int] = []  # experts read into the scratch stack, in order
        rows: list[dict] = []  # their rows, by chunk
        chunk = self.read_chunk(cache)
        while (rest := np.setdiff1d(uniq[cache.slot_of[uniq] < 0], scratch)).size:
            # (a late prefetch of one may have gone into a slot instead, or found none: read it then)
            t0 = time.perf_counter()
            experts, raw, reads = self.read(cache, rest[:chunk], uniq.tolist())
            t1 = time.perf_counter()
            try:
                rows.append(cache.arrays.scratch_rows(raw, len(experts)))
            finally:
                self.reader.recycle(reads, installed=False)
            scratch += experts
            self.ledger.add(self.passes.phase, cache.layer, **_read_counts(cache, len(experts), t1 - t0))
        self.touch(cache, uniq, counts)  # the resident ones; the scratch ones pass through
        return _scratch_slots(cache, scratch)[indices], cache.arrays.with_scratch(rows)

    # -- prefetch --------------------------------------------------------------------------------
    def submit(self, predictions: list[Prediction]) -> dict[int, list]:
        """Queue the predicted experts that are not resident; the governor says how many per layer, and
        where the policy estimates next uses, only those needed sooner than the experts they would evict.
        Returns the experts asked to be read, by layer."""
        asked: dict[int, list] = {}
        governor = self.governor
        if not predictions or governor is None:
            return asked
        t0 = time.perf_counter()
        floor = governor.min_score
        for layer, experts, scores in predictions:
            experts, scores = np.asarray(experts), np.asarray(scores)
            order = np.argsort(-scores, kind="stable")[: governor.take(len(experts))]
            chosen = {int(experts[n]): float(scores[n]) for n in order}
            cache = self.caches[layer]
            absent = [e for e in chosen if cache.slot_of[e] < 0 and chosen[e] >= floor]
            future = self.passes.future(layer) if absent else None
            if future is not None:  # read only what would go in: needed sooner than what it evicts
                protect = list(chosen) + self.reader.wanted(layer)
                absent = _worth(cache, absent, protect, future, self.passes.clock, strict=True)
            self.reader.submit(layer, chosen, absent)
            asked[layer] = absent
        self.ledger.count_reader(busy_s=time.perf_counter() - t0)
        return asked

    def drain(self):
        """Synchronous prefetch: every read requested so far lands before this layer runs."""
        while self.reader.drain():
            self.install_ready({})
        self.install_ready({})

    def install_ready(self, protect: dict[int, ExpertIds]):
        """Install every finished read, one install per layer."""
        by_layer: dict[int, list[Read]] = {}
        for r in sorted(self.reader.take_ready(), key=lambda r: (-r.score, r.layer, r.expert)):
            # threads finish in any order
            by_layer.setdefault(r.layer, []).append(r)
        for layer, reads in by_layer.items():
            self._install_prefetched(reads, protect.get(layer, ()))

    def claim(self, layer: int, missing: np.ndarray, uniq: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """Late prefetches: wait for misses being read instead of reading them twice; the rest."""
        t0 = time.perf_counter()
        _, late = self.reader.fetch(layer, missing, read=False)
        self._take_late(layer, late, time.perf_counter() - t0, uniq)
        if not late:
            return missing
        cache = self.caches[layer]
        still = missing[cache.slot_of[missing] < 0]
        arrived = np.setdiff1d(missing, still)
        self.touch(cache, arrived, counts[np.searchsorted(uniq, arrived)])
        return still

    def _take_late(
        self, layer: int, late: list[Read], waited_s: float, protect: ExpertIds, synchronize: bool = True
    ):
        """Book and install prefetches a demand miss found in flight (`waited_s` for them)."""
        if late:
            self.ledger.add(self.passes.phase, layer, wait_s=waited_s, prefetch_late=len(late))
            self._install_prefetched(late, protect, synchronize)

    def _install_prefetched(self, reads: list[Read], protect: ExpertIds, synchronize: bool = True):
        """Install finished reads of one layer, best first, as far as unprotected slots allow. A prefetch
        never evicts an expert predicted for the same run of its layer. A failed read is dropped (booked
        as wasted): a layer that needs the expert reads it on demand, and that read's error, if it fails
        again, fails the request that needs it."""
        start = time.perf_counter()
        layer, phase, clock = reads[0].layer, self.passes.phase, self.passes.clock
        cache = self.caches[layer]
        protect = list(protect) + self.reader.wanted(layer)
        self.ledger.add(phase, layer, prefetch_taken=len(reads), prefetch_bytes=sum(r.nbytes for r in reads))
        fresh = [r for r in reads if r.error is None and cache.slot_of[r.expert] < 0]
        future = self.passes.future(layer)
        if future is None:
            fresh = fresh[: cache.room(protect=protect)]
        else:
            fresh = _paying(cache, fresh, protect, future, clock)
        installed, t0 = None, time.perf_counter()
        if fresh:  # demand got there first, or no slot may be evicted for the others: they bought nothing
            installed = cache.install(
                [r.expert for r in fresh],
                _rows(fresh),
                prefetched=True,
                protect=protect,
                clock=clock - 0.5,
                arrays=_arrays(fresh),
                next_use=future,
                synchronize=synchronize,
            )
        t1 = time.perf_counter()
        booked = _install_counts(
            installed, len(fresh), t1 - t0, prefetched=True, refused=len(reads) - len(fresh)
        )
        self.ledger.add(phase, layer, **booked)
        self.reader.recycle(reads)
        # choosing what goes in is prefetch's cost too; the install itself is booked apart (a demand read
        # of the same expert would have cost it as well)
        self.ledger.count_reader(busy_s=(t0 - start) + (time.perf_counter() - t1))


def _read_counts(cache: LayerCache, count: int, seconds: float) -> dict:
    """The ledger's counts of a demand read of `count` experts."""
    nbytes = count * cache.layout.expert_nbytes
    return {"experts_read": count, "bytes_read": nbytes, "read_s": seconds}


def _install_counts(
    installed: Installed | None, count: int, seconds: float, prefetched: bool, refused=0
) -> dict:
    """The ledger's counts of an install (`installed` None: nothing went in); `refused`: prefetches not
    installable."""
    evictions, unused = (installed.evictions, installed.unused_prefetches) if installed else (0, 0)
    kind = "prefetch_" if prefetched else ""
    counts = {f"{kind}installed": count, f"{kind}install_s": seconds}
    return {"evictions": evictions, "prefetch_wasted": unused + refused, **counts}


def _admitted(
    cache: LayerCache, uniq, counts, missing, future: np.ndarray | None, clock: float
) -> np.ndarray:
    """Which missing experts of an overflowing layer go into slots: the most used, as far as the routed
    ones leave room; where next uses are known, each only if needed no later than what it would evict
    (Belady's MIN, bypass allowed)."""
    if future is None:
        order = np.argsort(-counts[np.searchsorted(uniq, missing)], kind="stable")
        return missing[order[: cache.room(protect=uniq)]]
    return np.asarray(_worth(cache, missing, uniq, future, clock), dtype=np.int64)


def _scratch_slots(cache: LayerCache, scratch: list[int]) -> mx.array:
    """(E,) slot of every expert id, the scratch experts' rows following the C slots (row C + j)."""
    table = np.where(cache.slot_of >= 0, cache.slot_of, 0)
    table[np.asarray(scratch, dtype=np.int64)] = cache.capacity + np.arange(len(scratch))
    return mx.array(table.astype(np.int32))


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


def _rows(reads: list[Read]) -> dict:
    """The finished reads' bytes by part, as per-expert rows (what `LayerCache.install` takes)."""
    landed = [r.raw for r in reads if r.raw is not None]  # every one: failed reads never get here
    return {key: [raw[key][0] for raw in landed] for key in landed[0]} if landed else {}


def _arrays(reads: list[Read]) -> list | None:
    """The flat MLX arrays the reader made of the reads' bytes (None for a read it made none of); None if
    it made none at all."""
    made = [r.arrays for r in reads]
    return None if all(a is None for a in made) else made


def read_into_slots(loader: Loader, cache: LayerCache, expert_in_slot: np.ndarray):
    """Read the experts of `expert_in_slot` (-1: empty; a snapshot's) from the model's files into those
    slots, booked as demand reads. A cleared cache fills slots 0..n-1 in order, which is what a saved cache
    filled the same way has; other orders are permuted so slot numbers match."""
    held = np.asarray(expert_in_slot, dtype=np.int64)
    cache.restore(np.full(cache.capacity, -1))
    loader.load(cache, held[held >= 0])
    _into_their_slots(cache, held)


def put_back(store: ExpertStore, cache: LayerCache, expert_in_slot: np.ndarray):
    """`read_into_slots` booking nothing (a measurement's slots refilled): the experts of `expert_in_slot`
    read from the model's files into those slots; their recency starts afresh."""
    held = np.asarray(expert_in_slot, dtype=np.int64)
    ids = held[held >= 0]
    cache.restore(np.full(cache.capacity, -1))
    for start in range(0, ids.size, READ_BATCH):
        chunk = ids[start : start + READ_BATCH]
        cache.install(chunk, store.read(cache.layout, chunk, ExpertRows(cache.layout, chunk.size)))
    _into_their_slots(cache, held)


def _into_their_slots(cache: LayerCache, held: np.ndarray):
    """Move the experts of `held` (-1: empty), resident in some slots, into the slots `held` names."""
    ids, wanted = held[held >= 0], np.flatnonzero(held >= 0)
    current = cache.slot_of[ids]
    if not np.array_equal(current, wanted):
        permutation = np.arange(cache.capacity)
        permutation[wanted] = current
        cache.move(permutation, held)


def install_rate(store: ExpertStore, cache: LayerCache, make_arrays: bool, repeats: int) -> float:
    """Bytes a second at which read experts are installed into `cache`'s slots, measured as
    `bench/roofline.py`'s `install_bandwidth` measures it: up to `INSTALL_PROBE` experts a batch, read
    beforehand, two batches in turn (always fresh bytes), each into the same slots of the cleared cache;
    MLX's writes evaluated, as the layer would; `make_arrays`: from the MLX arrays a reader thread makes
    (their rows); the first install warms the path up, the next `repeats` are timed. Books nothing; the
    cache is left cleared."""
    experts = max(1, min(INSTALL_PROBE, cache.capacity, cache.num_experts // 2))
    batches = [np.arange(experts) + experts * (n % 2) for n in range(repeats + 1)]
    raws = [store.read(cache.layout, ids, ExpertRows(cache.layout, experts)) for ids in batches[:2]]
    seconds = 0.0
    for n, ids in enumerate(batches):
        raw = raws[n % 2]
        made = []  # as the reader threads make them (their rows)
        if make_arrays:
            made = [backend.stage_for_device(mx.array(row)) for row in flat_rows(cache.layout, raw, experts)]
            mx.eval(made)
        cache.restore(np.full(cache.capacity, -1))
        t0 = time.perf_counter()
        cache.install(ids, raw, clock=n, arrays=[*made] if made else None)
        mx.eval(list(cache.stacked_arrays().values()))  # MLX writes are lazy: the layer would evaluate them
        if n:
            seconds += time.perf_counter() - t0
        for array in made:
            backend.unstage(array)
    return cache.slot_nbytes * experts * repeats / seconds
