"""The host tier of three tiers: a bounded number of each layer's experts in host memory (rows 0..H-1 of
its stack, which the device reads in place), the rest on disk, read into those rows by reader threads.

Where every expert fits in host memory the stack's host rows are the experts in expert order (two tiers).
Past the host's memory they are H rows per layer (`TwoTierSettings.host_experts`) holding any H of its
experts: `row_of` says which row holds an expert (-1: on disk), and the runtime's tables send a lane to
that row, to a device slot, or mark it absent (`ABSENT`: the pass flags the lane and is run again, exactly,
once its experts are read: `disk_passes.py`). The tiers do not overlap: an expert copied into a device slot
leaves its host row to the expert the slot held (`swap`), or gives it back.

A row is written only while no pass can read it: a read goes into a free row (never in a table), and a row
given back (evicted, or its expert promoted to a slot) is free only from the next pass boundary on
(`boundary`), once the passes that may still read it are computed (the runtime waits for each pass's flags
before the next begins). Reads run on `threads` reader threads (disk bytes to the rows' in-memory bytes
with numpy: `slot_arrays.host_bits`), never on MLX's thread; a failed read leaves its row free and its
expert on disk (the error reaches the pass that waits for it). Not here: the tables and passes
(`two_tier_runtime.py`), when reads are asked for (`disk_passes.py`), reading the files (`storage/store.py`).
"""

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx
import numpy as np

from ..caching.layer_cache import LayerCache
from ..caching.slot_arrays import host_bits
from ..storage.layout import ExpertRows
from ..storage.store import ExpertStore
from .mapped import host_view

ABSENT = 0xFFFFFFFF  # a table entry (uint32): the expert is on disk, its lanes flagged


class NoRoomError(RuntimeError):
    """Every host row of a layer holds an expert the running pass needs (or a read in flight)."""


class HostTier:
    """Per layer, which expert each host row holds and when it was last used, the free rows, and the reads
    in flight. `initial[layer]`: the experts the load read into rows 0.. (in that order). `book(layer,
    **counts)` counts into the ledger (`accounting/ledger.py`'s fields), on the thread that calls the
    methods: reads started (`experts_read`, `bytes_read`, `prefetch_reads` of them ahead of need), their
    seconds once landed (`disk_read_s`), and reads ahead used before eviction (`prefetch_useful`) or not
    (`prefetch_wasted`). `due` (layers, experts): where given and estimated, the row whose expert is due
    last is evicted first (`host_eviction.NextUseOrder`), else the least recently used."""

    def __init__(
        self,
        store: ExpertStore,
        caches: list[LayerCache],
        stacks: list[dict],
        rows: int,
        initial: list[np.ndarray],
        book: Callable[..., None],
        threads: int = 4,
        due: np.ndarray | None = None,
        span: int = 0,
    ):
        self.store, self.caches, self.rows, self._book = store, caches, rows, book
        self.span = span  # an expert's read in requests of at most this many bytes at once; 0: one
        self.due = due  # per layer and expert, the pass it is estimated to be needed at (`host_eviction.py`)
        layers, experts = len(caches), caches[0].num_experts
        self.expert_in_row = np.full((layers, rows), -1, dtype=np.int64)
        self.row_of = np.full((layers, experts), -1, dtype=np.int64)
        for layer, ids in enumerate(initial):
            self.expert_in_row[layer, : len(ids)] = ids
            self.row_of[layer, ids] = np.arange(len(ids))
        self.last_use = np.zeros((layers, rows), dtype=np.int64)
        self.ahead = np.zeros((layers, rows), dtype=bool)  # read ahead of need, not used yet
        self.changed = False  # which expert a row holds changed since `take_changed`
        self._given_back: list[tuple[int, int]] = []  # (layer, row): free from the next boundary
        self._pending: dict[tuple[int, int], tuple[int, Future]] = {}  # (layer, expert) -> (row, read)
        self._stacks = stacks
        # per layer, the host's views of its stack (made at its first read): let go before MLX writes a
        # stack (`let_go`), since a view held would make MLX copy the stack it fills
        self._views: dict[int, dict] = {}
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="od-moe-disk")

    # -- where experts are -------------------------------------------------------------------------
    def in_host(self, layer: int) -> np.ndarray:
        """Per expert of `layer`, its host row (-1: on disk or a read in flight)."""
        return self.row_of[layer]

    def on_disk(self, layer: int, ids: np.ndarray, slot_of: np.ndarray) -> np.ndarray:
        """Those of experts `ids` of `layer` in neither a device slot (`slot_of`, the layer's) nor a host
        row."""
        return ids[(slot_of[ids] < 0) & (self.row_of[layer, ids] < 0)]

    def touch(self, layer: int, ids: np.ndarray, clock: int):
        """Experts `ids` of `layer` were read by a pass at `clock` (least recently used rows go first)."""
        rows = self.row_of[layer, ids]
        rows = rows[rows >= 0]
        self.last_use[layer, rows] = clock
        useful = int(self.ahead[layer, rows].sum())
        if useful:
            self.ahead[layer, rows] = False
            self._book(layer, prefetch_useful=useful)

    def pending_ahead(self, layer: int, ids) -> int:
        """How many of experts `ids` of `layer` are being read ahead of need (a forecast's, not landed)."""
        keys = [(layer, int(i)) for i in np.asarray(ids).tolist()]
        return sum(bool(self.ahead[layer, self._pending[k][0]]) for k in keys if k in self._pending)

    def take_changed(self) -> bool:
        """Whether any row changed its expert since the last call."""
        changed, self.changed = self.changed, False
        return changed

    def give_back(self, layer: int, ids: np.ndarray):
        """Experts `ids` of `layer` leave the host tier (copied into a device slot): their rows are free
        from the next boundary."""
        for expert in np.asarray(ids, dtype=np.int64):
            row = int(self.row_of[layer, expert])
            if row >= 0:
                self.row_of[layer, expert] = -1
                self.expert_in_row[layer, row] = -1
                self.ahead[layer, row] = False
                self._given_back.append((layer, row))
                self.changed = True

    def swap(self, layer: int, leaving: np.ndarray, arriving: np.ndarray, clock: int):
        """Experts `leaving` of `layer` go to device slots and the experts `arriving` (their slots' last
        holders) take their host rows, in order; the caller copies the bytes both ways."""
        for out, into in zip(np.asarray(leaving, np.int64), np.asarray(arriving, np.int64)):
            row = int(self.row_of[layer, out])
            self.row_of[layer, out] = -1
            self.row_of[layer, into] = row
            self.expert_in_row[layer, row] = into
            self.last_use[layer, row] = clock
            self.ahead[layer, row] = False
            self.changed = True

    def boundary(self):
        """A pass boundary: no pass is in flight, so rows given back are free; reads that landed are in."""
        self._given_back = []
        self.landed()

    # -- reads -------------------------------------------------------------------------------------
    def fetch(
        self, layer: int, ids, protect=(), clock: int = 0, ahead: bool = False
    ) -> list[tuple[int, int, Future]]:
        """Start reading experts `ids` of `layer` (those neither in host rows nor being read) into free
        rows, else the least recently used rows whose experts are not in `protect` or ids; returns every
        asked expert's (expert, row, read) in flight. `ahead`: read ahead of need (a forecast's).
        `NoRoomError` where no row is left."""
        keep = set(np.asarray(protect, dtype=np.int64).tolist()) | set(np.asarray(ids).tolist())
        started = []
        for expert in np.asarray(ids, dtype=np.int64).tolist():
            if self.row_of[layer, expert] >= 0:
                continue
            if (layer, expert) not in self._pending:
                row = self._free_row(layer, keep)
                self.expert_in_row[layer, row] = -2  # taken by a read
                self.last_use[layer, row] = clock
                self.ahead[layer, row] = ahead
                future = self._start_read(layer, expert, row)
                self._pending[(layer, expert)] = (row, future)
                nbytes = self.caches[layer].layout.expert_nbytes
                self._book(layer, experts_read=1, bytes_read=nbytes, prefetch_reads=int(ahead))
            row, future = self._pending[(layer, expert)]
            started.append((expert, row, future))
        return started

    def wait(self, started: list[tuple[int, int, Future]]) -> float:
        """Wait for `started` reads (`fetch`'s) and put their experts in; the seconds waited.
        A failed read raises its error once its row is free again and its expert still on disk."""
        t0 = time.perf_counter()
        error = None
        for _, _, future in started:
            try:
                future.result()
            except BaseException as e:  # every read is waited for, the first error raised
                error = error or e
        self.landed()
        if error is not None:
            raise error
        return time.perf_counter() - t0

    def landed(self):
        """Put the experts of finished reads into their rows (a failed one's row freed)."""
        for (layer, expert), (row, future) in list(self._pending.items()):
            if not future.done():
                continue
            del self._pending[(layer, expert)]
            if future.exception() is None:
                assert self.expert_in_row[layer, row] == -2
                self.expert_in_row[layer, row] = expert
                self.row_of[layer, expert] = row
                self.changed = True
                self._book(layer, disk_read_s=future.result())
            else:
                self.expert_in_row[layer, row] = -1
                self.ahead[layer, row] = False

    def _views_of(self, layer: int) -> dict:
        if layer not in self._views:
            self._views[layer] = {key: host_view(array) for key, array in self._stacks[layer].items()}
        return self._views[layer]

    def let_go(self):
        """Wait for every read and let go of the views of the stacks (before MLX writes one)."""
        self.drain()
        self._views = {}

    def wait_all(self) -> float:
        """`wait` for every read in flight."""
        return self.wait(self.wait_list())

    def drain(self, started: list[tuple[int, int, Future]] | None = None):
        """Wait for `started` reads (every read in flight where None); errors dropped: their rows freed."""
        for _, _, future in started if started is not None else self.wait_list():
            future.exception()
        self.landed()

    def wait_list(self) -> list[tuple[int, int, Future]]:
        """Every read in flight, as `fetch` gives them."""
        return [(expert, row, future) for (_, expert), (row, future) in self._pending.items()]

    def close(self):
        self.drain()
        self._pool.shutdown(wait=True)

    def _free_row(self, layer: int, keep: set) -> int:
        given_back = {row for at, row in self._given_back if at == layer}
        held = self.expert_in_row[layer]
        free = [r for r in np.flatnonzero(held == -1).tolist() if r not in given_back]
        if free:
            return free[0]
        evictable = [
            r for r in np.flatnonzero(held >= 0).tolist() if int(held[r]) not in keep and r not in given_back
        ]
        if not evictable:
            in_flight = [(e, r, f) for (at, e), (r, f) in self._pending.items() if at == layer]
            if in_flight:  # reads ahead hold the other rows: once landed, their experts may go
                self.drain(in_flight)
                return self._free_row(layer, keep)
            raise NoRoomError(f"layer {layer}: all {self.rows} host rows are needed by this pass")
        due = self.due[layer] if self.due is not None else None
        if due is not None and not np.isnan(due).all():  # the one estimated to be needed last goes
            row = max(evictable, key=lambda r: (due[held[r]], -self.last_use[layer, r]))
        else:
            row = min(evictable, key=lambda r: self.last_use[layer, r])
        self.row_of[layer, held[row]] = -1
        held[row] = -1
        self.changed = True
        if self.ahead[layer, row]:
            self.ahead[layer, row] = False
            self._book(layer, prefetch_wasted=1)
        return row

    def _start_read(self, layer: int, expert: int, row: int) -> Future:
        """Read expert `expert` of `layer` into host row `row`: its bytes in requests of at most `span`
        (`ExpertStore.spans`) run at once on the reader threads into staging memory, then, once the last has
        landed (on its thread), converted into the row; with no span, by one thread (one request a part).
        The read's future gives the seconds from its first request's start to the row written."""
        layout = self.caches[layer].layout
        staging = ExpertRows(layout, 1)
        views = self._views_of(layer)
        if not self.span:
            return self._pool.submit(self._read_whole, layer, expert, row, staging, views)
        spans = self.store.spans(layout, expert, staging, self.span)
        read = _SpanRead(len(spans), lambda: self._into_row(layer, row, staging, views))
        for span in spans:
            self._pool.submit(read.run, self.store.read_span, layout, expert, span)
        return read.future

    def _read_whole(self, layer: int, expert: int, row: int, staging: ExpertRows, views: dict) -> float:
        """On a reader thread: expert `expert` of `layer` read and put into host row `row`; the seconds."""
        t0 = time.perf_counter()
        self.store.read(self.caches[layer].layout, np.array([expert]), staging)
        self._into_row(layer, row, staging, views)
        return time.perf_counter() - t0

    def _into_row(self, layer: int, row: int, staging: ExpertRows, views: dict):
        """A landed expert's staging bytes into its host row, in the computing dtype."""
        cache = self.caches[layer]
        for part in cache.layout.parts:
            key = (part.proj, part.name)
            bits = host_bits(staging.buffers[key][0], part.dtype, cache.targets[key])
            if bits is None:
                raise RuntimeError(
                    f"{cache.layout.module_path}.{part.proj}.{part.name}: numpy cannot cast {part.dtype} to"
                    f" {cache.targets[key]} exactly; three tiers cannot read this model from disk"
                )
            view = views[key]
            view[row] = np.ascontiguousarray(bits).view(view.dtype).reshape(view.shape[1:])


class _SpanRead:
    """One expert's read as `spans` requests on the reader threads: the last to finish writes the row
    (`finish`) and settles `future` (the seconds, or the first request's error)."""

    def __init__(self, spans: int, finish: Callable[[], None]):
        self.future: Future = Future()
        self._left, self._finish, self._lock = spans, finish, threading.Lock()
        self._error: BaseException | None = None
        self._start: float | None = None

    def run(self, read: Callable, *args):
        start = time.perf_counter()
        try:
            read(*args)
        except BaseException as e:  # the read's error, for whoever waits on the future
            error: BaseException | None = e
        else:
            error = None
        with self._lock:
            self._start = start if self._start is None else min(self._start, start)
            self._error = self._error or error
            self._left -= 1
            last = self._left == 0
        if not last:
            return
        if self._error is None:
            try:
                self._finish()
            except BaseException as e:
                self._error = e
        if self._error is not None:
            self.future.set_exception(self._error)
        else:
            self.future.set_result(time.perf_counter() - self._start)


def table_rows(slot_of: np.ndarray, row_of: np.ndarray, host_rows: int) -> np.ndarray:
    """Per layer and expert, the stack row a lane reads: host_rows + its slot where it has one, else its
    host row (`row_of`: its own id where every expert is in host memory, -1 on disk), else `ABSENT`."""
    host = np.where(row_of >= 0, row_of, ABSENT)
    return np.where(slot_of >= 0, host_rows + slot_of, host).astype(np.uint32)


def flagged_through_table(boundary: int, indices: mx.array, table: mx.array, *arrays):
    """Lanes through a three-tier table: each lane reads its expert's row (an absent one reads row 0: a wrong
    but finite result); other outputs: hit lanes (a device slot, a row from `boundary` on) and how many
    lanes found their expert absent ("missing", the pass runs again where it is not 0)."""
    read = table[indices]
    missing = read == ABSENT
    rows = mx.where(missing, mx.array(0, dtype=read.dtype), read)
    return arrays, rows, {"hit": (read >= boundary) & ~missing, "missing": missing.sum()}
