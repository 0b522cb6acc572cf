"""The reader: a queue of expert reads and the background threads that do them, for demand and prefetch.

- `fetch(layer, experts)`: demand. The experts are read now by the calling thread, helped by the reader
  threads when there are several, before any prefetch; those already being read (prefetches, "late")
  are waited for, not read twice. Returns the finished reads for the generation thread to install.
- `submit(layer, wanted, fetch)`: prefetch. The experts predicted for a layer ahead (`wanted`, with
  scores) and those of them to read (`fetch`: not resident). They supersede the layer's earlier
  requests (made from farther back, so less accurate): those not started are withdrawn, and only
  `wanted` is kept from eviction when reads are installed (`wanted(layer)`).
- The threads do file I/O (`ExpertStore.read` into staging buffers from a bounded pool). With
  `make_arrays` (CUDA, where arrays are device memory) each read's bytes must become one flat MLX array
  (`flat_rows`'s row): they are read straight into one (`mlx_rows.py`: rows of MLX memory, reused once
  their installs surely ran), or, past the rows' bound, copied into a new one (`mx.array`, which holds
  the GIL). One expert at a time, demand first, then best score, while the prefetched bytes read and not
  yet taken stay under `max_inflight_bytes`. Several threads keep several reads in flight: SSDs need
  queue depth.
- `withdraw(layer)`: the layer is running; prefetch requests for it never started are useless now.
- `take_ready()`: every finished prefetch, for the generation thread to install.
- `drain()`: wait until nothing is being read (with `synchronous` prefetch: reads then always arrive
  before the next layer runs, as on an infinitely fast disk; deterministic, for comparisons).
Prefetch counts go to the ledger's reader fields (issued, completed, reader seconds, dropped).
Not here: installing (`loader.py`), what to predict (`prefetch/policies.py`) or how much
(`prefetch/governor.py`).
"""

import math
import threading
import time
from dataclasses import dataclass

import mlx.core as mx

from ..accounting.ledger import Ledger
from ..runtime import ExpertIds
from ..storage.layout import BlockLayout, ExpertRows, flat_rows
from ..storage.store import ExpertStore
from .mlx_rows import GROW, MLXRows, Row

MAX_INFLIGHT_BYTES = 32 * 2**20  # prefetched, read and not yet installed: bounds prefetch's staging memory
# Reads in flight at once for large experts: SSDs read faster with a few requests queued (docs/GPU.md,
# "Packed experts"). Small experts come from the page cache, where more threads only contend for the CPU
# (docs/BENCHMARKS.md, "Prefetch on this CPU").
READ_THREADS = 4
SMALL_EXPERT_BYTES = 2**20


def read_threads_for(expert_nbytes: int) -> int:
    """The default queue depth for experts of this size."""
    return 1 if expert_nbytes < SMALL_EXPERT_BYTES else READ_THREADS


DEMAND = math.inf  # the score of a demand read: before any prefetch


@dataclass
class Read:
    layer: int
    expert: int
    score: float
    nbytes: int
    raw: dict | None = None
    arrays: mx.array | None = None  # raw's bytes as one flat MLX array, where the reader makes it
    staging: ExpertRows | None = None
    row: Row | None = None  # where `staging` is an MLX array's memory (`mlx_rows.py`)
    error: BaseException | None = None

    @property
    def demand(self) -> bool:
        return self.score == DEMAND

    def hold(self, row: Row | None, staging: ExpertRows | None):
        """Read into `staging`; `row`: where that is an MLX array's memory (`mlx_rows.py`; `GROW`: one to
        make first); (None, None): nothing held (its buffers gone back)."""
        self.row, self.staging = row, staging

    def land(
        self, raw: dict | None = None, arrays: mx.array | None = None, error: BaseException | None = None
    ):
        """The read is done: its bytes by part (`raw`) and, where made, as one flat MLX array; or its
        error."""
        self.raw, self.arrays, self.error = raw, arrays, error


class Reader:
    def __init__(
        self,
        store: ExpertStore,
        layouts: list[BlockLayout],
        ledger: Ledger,
        threads: int = READ_THREADS,
        max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
        make_arrays: bool = False,
    ):
        self.store, self.layouts, self.ledger = store, layouts, ledger
        self.make_arrays = make_arrays
        self.rows = MLXRows() if make_arrays else None  # reads straight into MLX memory (CUDA)
        self.max_inflight_bytes = max(max_inflight_bytes, max(layout.expert_nbytes for layout in layouts))
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)  # reader threads wait here for requests
        self._done = threading.Condition(self._lock)  # the generation thread waits here for reads
        self._pending: dict[tuple[int, int], Read] = {}
        self._reading: dict[tuple[int, int], Read] = {}
        self._ready: dict[tuple[int, int], Read] = {}
        self._inflight_bytes = 0  # prefetched bytes being read or read and not taken
        self._wanted: dict[int, set] = {}
        self._spare: dict[tuple, list[ExpertRows]] = {}  # staging buffers of taken reads, by expert shape
        self._batch_staging: dict[tuple, ExpertRows] = {}  # the calling thread's batched demand reads
        self._keep_spare = (
            max(self.max_inflight_bytes // min(l.expert_nbytes for l in layouts), threads) + threads
        )
        self._stop = False
        self._threads = [
            threading.Thread(target=self._run, name="od-moe-reader", daemon=True) for _ in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    # -- generation thread: demand ------------------------------------------------------------------
    def fetch(self, layer: int, experts: ExpertIds, read: bool = True) -> tuple[list[Read], list[Read]]:
        """Read `experts` of `layer` now and wait for them: the calling thread reads them itself, the
        reader threads help when there are several (before any prefetch). Returns the demand reads, and the
        prefetches of them that were already being read or were read ("late"). With `read=False` only
        prefetches are waited for: those under way; those not started are withdrawn."""
        keys = [(layer, int(e)) for e in experts]
        batch = []
        with self._lock:
            for key in keys:
                if key in self._reading or key in self._ready:
                    continue
                if read:
                    self._pending[key] = Read(layer, key[1], DEMAND, self.layouts[layer].expert_nbytes)
                else:
                    self._pending.pop(key, None)
            mine = [k for k in keys if k in self._pending and self._pending[k].demand]
            if len(self._threads) > 1 and len(mine) > 1:
                self._work.notify_all()  # helpers; a single read is faster without a hand-off
            elif mine and self.rows is None:  # no helpers: one batched demand read,
                # neighbours in one preadv
                # (with rows, each expert is read into its own MLX array below: no copy on this thread)
                batch = [self._pending.pop(k) for k in mine]
                self._reading.update(zip(mine, batch))
                mine = []
        if batch:
            self._read_batch(layer, batch)
        for key in mine:
            with self._lock:
                r = self._pending.get(key)
                if r is None or not r.demand:
                    continue
                self._start(key, r)
            self._read(key, r)
        with self._lock:
            while any(k in self._pending or k in self._reading for k in keys):
                self._done.wait()
            reads = [self._ready.pop(k) for k in keys if k in self._ready]
            self._inflight_bytes -= sum(r.nbytes for r in reads if not r.demand)
            if self._pending:  # room for more prefetch reads
                self._work.notify_all()
        return [r for r in reads if r.demand], [r for r in reads if not r.demand]

    def cancel_prefetches(self):
        """Forget every prefetch: pending ones are dropped, those being read finish and are discarded."""
        with self._lock:
            stale = [k for k, r in self._pending.items() if not r.demand]
            for k in stale:
                del self._pending[k]
            self._wanted.clear()
            while self._reading:
                self._done.wait()
        self.recycle(self.take_ready(), installed=False)

    # -- generation thread: prefetch ----------------------------------------------------------------
    def submit(self, layer: int, wanted: dict[int, float], fetch: ExpertIds):
        """Request `fetch` (a subset of `wanted`) for `layer`, superseding the layer's earlier requests."""
        with self._lock:
            self._wanted[layer] = set(wanted)
            superseded = [
                k for k, r in self._pending.items() if k[0] == layer and k[1] not in wanted and not r.demand
            ]
            for k in superseded:
                del self._pending[k]
            self.ledger.count_reader(dropped=len(superseded))
            for e in fetch:
                key, score = (layer, int(e)), wanted[int(e)]
                if key in self._reading or key in self._ready:
                    continue
                old = self._pending.get(key)
                if old is None or old.score < score:
                    self._pending[key] = Read(layer, int(e), score, self.layouts[layer].expert_nbytes)
            self._work.notify_all()

    def withdraw(self, layer: int):
        """The layer is running: forget its predictions and its prefetch requests not started."""
        with self._lock:
            self._wanted.pop(layer, None)
            stale = [k for k, r in self._pending.items() if k[0] == layer and not r.demand]
            for k in stale:
                del self._pending[k]
            self.ledger.count_reader(dropped=len(stale))

    def wanted(self, layer: int) -> list[int]:
        """The experts last predicted for the layer's next run (kept from eviction by prefetch installs)."""
        with self._lock:
            return sorted(self._wanted.get(layer, ()))

    def started(self, layer: int, experts: ExpertIds) -> list[bool]:
        """Whether each of `experts` has left the queue of `layer` (being read or read, or withdrawn)."""
        with self._lock:
            return [(layer, int(e)) not in self._pending for e in experts]

    def take_ready(self) -> list[Read]:
        """Every finished prefetch (the caller installs or discards them, then `recycle`s them)."""
        with self._lock:
            reads = list(self._ready.values())
            self._ready.clear()
            self._inflight_bytes -= sum(r.nbytes for r in reads)
            if self._pending:  # room for more prefetch reads
                self._work.notify_all()
        return reads

    def recycle(self, reads: list[Read], installed: bool = True, computing: bool = False):
        """The reads' bytes are in their slots (or not wanted): their buffers may be reused, those that
        are MLX memory once the installs' copies from them surely ran (`installed`: any may have;
        `computing`: installed only into their layer, which computes next in this pass)."""
        with self._lock:
            for r in reads:
                if r.row is not None and self.rows is not None:
                    layer = r.layer if computing else None
                    self.rows.give_back(self.layouts[r.layer], r.row, installed, layer)
                    r.hold(None, None)
                    continue
                spare = self._spare.setdefault(self.layouts[r.layer].shape_key, [])
                if r.staging is not None and len(spare) < self._keep_spare:  # batched reads have none
                    spare.append(r.staging)

    def drain(self) -> bool:
        """Wait until no read is in progress and none can start; True if requests are still pending
        (held back by the bound on bytes in flight: take the ready ones and drain again)."""
        with self._lock:
            while self._reading or (self._pending and self._inflight_bytes < self.max_inflight_bytes):
                self._done.wait()
            return bool(self._pending)

    @property
    def busy(self) -> bool:
        """Requests pending, being read, or read and not taken."""
        return bool(self._pending or self._reading or self._ready)

    def counts(self) -> dict:
        with self._lock:
            return {"pending": len(self._pending), "reading": len(self._reading), "ready": len(self._ready)}

    def close(self):
        with self._lock:
            self._stop = True
            self._work.notify_all()
            self._done.notify_all()
        if self.rows is not None:
            self.rows.release()

    @property
    def closed(self) -> bool:
        return self._stop

    # -- reader threads -----------------------------------------------------------------------------
    def _next(self) -> tuple[tuple[int, int], Read] | None:
        """The best request that may start now (demand first; prefetch within the bound on bytes)."""
        if not self._pending:
            return None
        key, r = max(self._pending.items(), key=lambda kv: kv[1].score)
        return (key, r) if r.demand or self._inflight_bytes < self.max_inflight_bytes else None

    def _start(self, key, r: Read):
        """Move a request from pending to reading (the caller holds the lock)."""
        del self._pending[key]
        self._reading[key] = r
        if not r.demand:
            self._inflight_bytes += r.nbytes
            self.ledger.count_reader(issued=1)
        layout = self.layouts[r.layer]
        row = self.rows.reserve(layout) if self.rows is not None else None
        if row is None:
            spare = self._spare.get(layout.shape_key)
            r.hold(None, spare.pop() if spare else ExpertRows(layout, 1))
        else:
            r.hold(row, None if row is GROW else row.staging)

    def _read_batch(self, layer: int, batch: list[Read]):
        """Demand reads of one layer in one `ExpertStore.read` (the calling thread, no helpers)."""
        layout = self.layouts[layer]
        staging = self._batch_staging.get(layout.shape_key)
        if staging is None or staging.size < len(batch):
            staging = self._batch_staging[layout.shape_key] = ExpertRows(layout, max(len(batch), 16))
        raw, error = None, None
        try:
            raw = self.store.read(layout, [r.expert for r in batch], staging)
        except BaseException as e:  # raised on the generation thread when taken
            error = e
        with self._lock:
            for i, r in enumerate(batch):
                r.land(None if raw is None else raw.rows(i, i + 1), error=error)
                key = (layer, r.expert)
                del self._reading[key]
                self._ready[key] = r

    def _read(self, key, r: Read):
        """Do the read (no lock held), then file it as ready."""
        t0 = time.perf_counter()
        layout = self.layouts[r.layer]
        try:
            staging = r.staging
            if r.row is GROW and self.rows is not None:
                r.hold(None, None)  # until made
                row = self.rows.make(layout)
                staging = row.staging if row is not None else ExpertRows(layout, 1)
                r.hold(row, staging)
            assert staging is not None  # `_start` gave it, or the row made here
            raw = self.store.read(layout, [r.expert], staging)
            arrays = None
            if r.row is not None:
                arrays = r.row.array  # the bytes were read into it
            elif self.make_arrays:
                arrays = mx.array(flat_rows(layout, raw, 1)[0])  # not advised: MLX recycles it
            r.land(raw, arrays)
        except BaseException as e:  # raised on the generation thread when taken
            r.land(error=e)
        with self._lock:
            if not r.demand:
                self.ledger.count_reader(reader_s=time.perf_counter() - t0)
                self.ledger.count_reader(completed=1)
            del self._reading[key]
            self._ready[key] = r
            self._done.notify_all()

    def _run(self):
        while True:
            with self._lock:
                while not self._stop and (job := self._next()) is None:
                    self._work.wait()
                if self._stop:
                    return
                key, r = job
                self._start(key, r)
            self._read(key, r)
