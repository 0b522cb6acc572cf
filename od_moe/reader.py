"""The prefetch reader: a queue of expert reads and the background thread that does them.

- `submit(layer, wanted, fetch)`: the experts predicted for a layer ahead (`wanted`, with scores) and
  those of them to read (`fetch`: not resident). They supersede the layer's earlier requests (made from
  farther back, so less accurate): those not started are withdrawn, and only `wanted` is kept from
  eviction when reads are installed (`wanted(layer)`).
- The thread does file I/O only (`ExpertStore.read` into its own staging buffers), one expert at a
  time, best score first, while the bytes read and not yet taken stay under `max_inflight_bytes`.
- `withdraw(layer)`: the layer is running; requests for it never started are useless now.
- `claim(layer, experts)`: at a demand miss, a read in progress is waited for ("late") instead of
  read twice; a pending one is withdrawn so the demand path reads it. Returns the finished reads.
- `take_ready()`: every finished read, for the generation thread to install.
- `drain()`: wait until nothing is being read (with `synchronous` prefetch: reads then always arrive
  before the next layer runs, as on an infinitely fast disk; deterministic, for comparisons).
Counts go to the ledger's reader fields (issued, completed, reader seconds, dropped).
Not here: installing (`runtime.py`), what to predict (`policies.py`) or how much (`governor.py`).
"""

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from .stats import Ledger
from .store import BlockLayout, ExpertStore, Staging

MAX_INFLIGHT_BYTES = 32 * 2**20  # read and not yet installed: bounds the staging memory of prefetch


@dataclass
class Read:
    layer: int
    expert: int
    score: float
    nbytes: int
    raw: dict | None = None
    staging: Staging | None = None
    error: BaseException | None = None


class Reader:
    def __init__(
        self,
        store: ExpertStore,
        layouts: list[BlockLayout],
        ledger: Ledger,
        max_inflight_bytes: int = MAX_INFLIGHT_BYTES,
    ):
        self.store, self.layouts, self.ledger = store, layouts, ledger
        self.max_inflight_bytes = max(max_inflight_bytes, max(l.expert_nbytes for l in layouts))
        self._cv = threading.Condition()
        self._pending: dict[tuple[int, int], Read] = {}
        self._reading: dict[tuple[int, int], Read] = {}
        self._ready: dict[tuple[int, int], Read] = {}
        self._inflight_bytes = 0
        self._wanted: dict[int, set] = {}
        self._spare: dict[int, list[Staging]] = {}  # staging buffers of taken reads, by layer
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="od-moe-prefetch", daemon=True)
        self._thread.start()

    # -- generation thread ------------------------------------------------------------------------
    def submit(self, layer: int, wanted: dict[int, float], fetch: Sequence[int]):
        """Request `fetch` (a subset of `wanted`) for `layer`, superseding the layer's earlier requests."""
        with self._cv:
            self._wanted[layer] = set(wanted)
            superseded = [k for k in self._pending if k[0] == layer and k[1] not in wanted]
            for k in superseded:
                del self._pending[k]
            self.ledger.reader["dropped"] += len(superseded)
            for e in fetch:
                key, score = (layer, int(e)), wanted[int(e)]
                if key in self._reading or key in self._ready:
                    continue
                old = self._pending.get(key)
                if old is None or old.score < score:
                    self._pending[key] = Read(layer, int(e), score, self.layouts[layer].expert_nbytes)
            self._cv.notify_all()

    def withdraw(self, layer: int):
        """The layer is running: forget its predictions and its requests not started."""
        with self._cv:
            self._wanted.pop(layer, None)
            stale = [k for k in self._pending if k[0] == layer]
            for k in stale:
                del self._pending[k]
            self.ledger.reader["dropped"] += len(stale)

    def wanted(self, layer: int) -> list[int]:
        """The experts last predicted for the layer's next run (kept from eviction by prefetch installs)."""
        with self._cv:
            return sorted(self._wanted.get(layer, ()))

    def claim(self, layer: int, experts: Sequence[int]) -> tuple[list[Read], float]:
        """For demand misses of `layer`: withdraw pending requests for `experts`, wait for those being
        read; returns their finished reads (and those already finished) and the seconds waited."""
        waited = 0.0
        with self._cv:
            for e in experts:
                self._pending.pop((layer, int(e)), None)
            keys = [
                (layer, int(e))
                for e in experts
                if (layer, int(e)) in self._reading or (layer, int(e)) in self._ready
            ]
            if not keys:
                return [], 0.0
            start = time.perf_counter()
            while any(k in self._reading for k in keys):
                self._cv.wait()
            waited = time.perf_counter() - start
            reads = [self._ready.pop(k) for k in keys]
            self._inflight_bytes -= sum(r.nbytes for r in reads)
            self._cv.notify_all()
        return reads, waited

    def take_ready(self) -> list[Read]:
        """Every finished read (the caller installs or discards them, then `recycle`s them)."""
        with self._cv:
            reads = list(self._ready.values())
            self._ready.clear()
            self._inflight_bytes -= sum(r.nbytes for r in reads)
            self._cv.notify_all()
        return reads

    def recycle(self, reads: list[Read]):
        """The reads' bytes are in their slots (or not wanted): their buffers may be reused."""
        with self._cv:
            for r in reads:
                self._spare.setdefault(r.layer, []).append(r.staging)

    def drain(self) -> bool:
        """Wait until no read is in progress and none can start; True if requests are still pending
        (held back by the bound on bytes in flight: take the ready ones and drain again)."""
        with self._cv:
            while self._reading or (self._pending and self._inflight_bytes < self.max_inflight_bytes):
                self._cv.wait()
            return bool(self._pending)

    @property
    def busy(self) -> bool:
        """Requests pending, being read, or read and not taken."""
        return bool(self._pending or self._reading or self._ready)

    def counts(self) -> dict:
        with self._cv:
            return {"pending": len(self._pending), "reading": len(self._reading), "ready": len(self._ready)}

    def close(self):
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    # -- reader thread ----------------------------------------------------------------------------
    def _run(self):
        while True:
            with self._cv:
                while not self._stop and not (
                    self._pending and self._inflight_bytes < self.max_inflight_bytes
                ):
                    self._cv.wait()
                if self._stop:
                    return
                key, r = max(self._pending.items(), key=lambda kv: kv[1].score)
                del self._pending[key]
                self._reading[key] = r
                self._inflight_bytes += r.nbytes
                self.ledger.reader["issued"] += 1
                spare = self._spare.get(r.layer)
                r.staging = spare.pop() if spare else Staging(self.layouts[r.layer], 1)
            t0 = time.perf_counter()
            try:
                r.raw = self.store.read(self.layouts[r.layer], [r.expert], r.staging)
            except BaseException as e:  # raised on the generation thread when taken
                r.error = e
            with self._cv:
                self.ledger.reader["reader_s"] += time.perf_counter() - t0
                self.ledger.reader["completed"] += 1
                del self._reading[key]
                self._ready[key] = r
                self._cv.notify_all()
