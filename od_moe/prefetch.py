"""The cooperative prefetch queue: predicted experts are ranked, read by a background thread, and
installed by the generation thread between layers and between tokens.

- `submit(layer, experts, scores)`: candidates for a layer ahead; resident or in-flight ones are skipped.
  They supersede the layer's earlier candidates (made from farther back): those not started are withdrawn.
  Pending requests are ranked by score (predicted probability, discounted by distance).
- The reader thread only does file I/O (`ExpertStore.read` into its own buffers), one expert at a time,
  best score first, while the bytes read but not yet installed stay under `max_inflight_bytes`.
- `install_ready()` (generation thread, cooperative): finished reads go into free or evictable slots; an
  expert that became resident meanwhile counts as wasted.
- `drop_stale(layer)`: when a layer runs, pending requests for it that were never started are dropped.
- Installs never evict an expert predicted for the same run of its layer (resident ones are not read,
  so without this a prefetch could push out what the same prediction said to keep).
- `claim(layer, experts)`: at a demand miss, an expert being read is waited for ("late") instead of read
  twice; a pending one is withdrawn so the demand path reads it.
- Self-protection, reported in `stats()`: every `window` decode tokens the precision of the last window
  is checked; below `min_precision` the number of experts predicted per layer is halved (down to none),
  above `recover_precision` it grows back. After `first_check` tokens (and again whenever it resumes),
  the demand reads its useful prefetches saved are weighed against what it cost the generation thread:
  if they do not repay it by `min_gain` of the token time (reads from the page cache of a small model),
  it pauses until the demand stall grows. And after `first_probe` tokens, then every `probe_every`,
  prefetch is switched off for `probe_tokens` tokens: if tokens are faster without it, it costs more
  than it saves and pauses.
Invariant: issued = useful + wasted + in flight (reading, read, or installed and not used yet).
Not here: what to predict (`policies.py`) or the demand path (`switch.py`).
"""

import threading
import time
from dataclasses import dataclass
from typing import Dict, List, NamedTuple, Optional, Sequence

import numpy as np

from .cache import LayerCache, Origin
from .store import ExpertStore, Staging


@dataclass
class _Read:
    layer: int
    expert: int
    score: float
    nbytes: int
    raw: Optional[dict] = None
    staging: Optional[Staging] = None
    read_s: float = 0.0
    error: Optional[BaseException] = None


class _Mark(NamedTuple):  # cumulative counters at the end of a forward pass
    mode: str
    seconds: Optional[float]
    stall_s: float
    useful: int
    reads: int
    read_s: float
    busy_s: float
    per_install_s: float


class PrefetchQueue:
    def __init__(self, store: ExpertStore, caches: List[LayerCache], max_inflight_bytes: int = 32 * 2**20,
                 per_layer: int = 8, window: int = 16, min_precision: float = 0.25, recover_precision: float = 0.5,
                 first_probe: int = 48, probe_every: int = 48, probe_tokens: int = 8, pause_tokens: int = 192, cost_margin: float = 0.03,
                 first_check: int = 2, min_gain: float = 0.02):
        self.store, self.caches = store, caches
        self.max_inflight_bytes = max(max_inflight_bytes, max(c.layout.expert_nbytes for c in caches))
        self.per_layer_max = self.per_layer = per_layer
        self.window, self.min_precision, self.recover_precision = window, min_precision, recover_precision
        self.first_probe, self.probe_every = first_probe, probe_every
        self.probe_tokens, self.pause_tokens = probe_tokens, pause_tokens
        self.cost_margin = cost_margin
        self.first_check, self.min_gain = first_check, min_gain
        self.mode, self._mode_since, self.probe = "on", 0, None
        self._pause_kind = None  # "gain": little to hide, resumes when the stall grows; "cost": probe said so
        self.gain = None  # the last check of what prefetch hides
        self._marks: List[_Mark] = []  # the last 64 forward passes
        self._cv = threading.Condition()
        self._pending: Dict[tuple, _Read] = {}
        self._reading: Dict[tuple, _Read] = {}
        self._ready: Dict[tuple, _Read] = {}
        self._inflight_bytes = 0
        self._wanted: Dict[int, set] = {}  # layer -> experts predicted for its next run: kept at installs
        self._spare: Dict[int, List[Staging]] = {}  # staging buffers of installed reads, by layer
        self._stop = False
        self.issued = self.late = self.dropped = self.bytes_read = self.reads = self.installs = 0
        self.read_s = self.wait_s = self.busy_s = self.install_s = 0.0
        self.backoffs, self.backoff_reason = 0, None
        self._window_start = (0, 0, 0)  # (tokens, useful, wasted) at the start of the window
        self.decode_tokens = 0
        self.account = lambda nbytes, stall_s: None  # the runtime books reads and waits to its phase
        self._thread = threading.Thread(target=self._reader, name="od-moe-prefetch", daemon=True)
        self._thread.start()

    # -- generation thread ------------------------------------------------------------------------
    def submit(self, layer: int, experts: Sequence[int], scores: Sequence[float]):
        """Candidates for `layer`, best first by score. They supersede earlier ones for the same layer (made
        from farther back, so less accurate): those not started are withdrawn, and only these are kept from
        eviction. Backed off, only the first per_layer/per_layer_max share is taken."""
        if not self.active:
            return
        t0 = time.perf_counter()
        cache = self.caches[layer]
        take = -(-len(experts) * self.per_layer // self.per_layer_max)
        order = np.argsort(-np.asarray(scores), kind="stable")[:take]
        chosen = {int(experts[n]): float(scores[n]) for n in order}
        with self._cv:
            self._wanted[layer] = set(chosen)
            superseded = [k for k in self._pending if k[0] == layer and k[1] not in chosen]
            for k in superseded:
                del self._pending[k]
            self.dropped += len(superseded)
            for e, score in chosen.items():
                key = (layer, e)
                if cache.slot_of[e] >= 0 or key in self._reading or key in self._ready:
                    continue
                old = self._pending.get(key)
                if old is None or old.score < score:
                    self._pending[key] = _Read(layer, e, score, cache.layout.expert_nbytes)
            self._cv.notify_all()
        self.busy_s += time.perf_counter() - t0

    def drop_stale(self, layer: int):
        with self._cv:
            self._wanted.pop(layer, None)
            stale = [k for k in self._pending if k[0] == layer]
            for k in stale:
                del self._pending[k]
            self.dropped += len(stale)

    def claim(self, layer: int, experts: Sequence[int], protect: Sequence[int], clock: float) -> np.ndarray:
        """For demand misses of `layer`: wait for those being read and install them; return the experts
        the demand path must still read itself."""
        t0, waited = time.perf_counter(), 0.0
        wanted = [int(e) for e in experts]
        with self._cv:
            for e in wanted:
                self._pending.pop((layer, e), None)
            waiting = [e for e in wanted if (layer, e) in self._reading or (layer, e) in self._ready]
            if waiting:
                start = time.perf_counter()
                while any((layer, e) in self._reading for e in waiting):
                    self._cv.wait()
                waited = time.perf_counter() - start
                self.wait_s += waited
                self.caches[layer].stats.stall_s += waited
                self.account(0, waited)
                reads = [self._ready.pop((layer, e)) for e in waiting]
                self._inflight_bytes -= sum(r.nbytes for r in reads)
                self._cv.notify_all()
            else:
                reads = []
        if reads:
            self._install(reads, protect, clock)
            self.late += len(reads)
        self.busy_s += time.perf_counter() - t0 - waited
        return np.array([e for e in wanted if self.caches[layer].slot_of[e] < 0], dtype=np.int64)

    def install_ready(self, protect: Dict[int, Sequence[int]] = None, clock: float = 0.0):
        """Install every finished read (cooperative point: between layers and between tokens)."""
        t0 = time.perf_counter()
        with self._cv:
            if not self._ready:
                return
            reads = list(self._ready.values())
            self._ready.clear()
            self._inflight_bytes -= sum(r.nbytes for r in reads)
            self._cv.notify_all()
        by_layer: Dict[int, List[_Read]] = {}
        for r in sorted(reads, key=lambda r: -r.score):
            by_layer.setdefault(r.layer, []).append(r)
        for layer, group in by_layer.items():  # one install (one evaluation) per layer
            self._install(group, (protect or {}).get(layer, ()), clock)
        self.busy_s += time.perf_counter() - t0

    def _install(self, reads: List[_Read], protect: Sequence[int], clock: float):
        """Install reads of one layer, best first, as far as unprotected slots allow."""
        for r in reads:
            if r.error is not None:
                raise r.error
        cache = self.caches[reads[0].layer]
        with self._cv:  # a prefetch must not evict an expert predicted for the same run of the layer
            protect = list(protect) + sorted(self._wanted.get(cache.layer, ()))
        for r in reads:
            cache.stats.bytes_read += r.nbytes  # read whether or not it turns out useful
            self.account(r.nbytes, 0.0)
        fresh = [r for r in reads if cache.slot_of[r.expert] < 0]
        fresh = fresh[: cache.room(protect=protect)]
        # demand got there first, or no slot may be evicted for it: the read bought nothing
        cache.stats.prefetch_wasted += len(reads) - len(fresh)
        if fresh:
            raw = {key: [r.raw[key][0] for r in fresh] for key in fresh[0].raw}
            t0 = time.perf_counter()
            cache.install([r.expert for r in fresh], raw, Origin.PREFETCH, protect=protect, clock=clock - 0.5)
            dt = time.perf_counter() - t0
            cache.stats.install_s += dt
            self.install_s += dt
            self.installs += len(fresh)
            cache.stats.experts_loaded += len(fresh)
        with self._cv:  # the bytes are in their slots now (or not wanted): the buffers may be reused
            self._spare.setdefault(cache.layer, []).extend(r.staging for r in reads)

    @property
    def active(self) -> bool:
        return self.per_layer > 0 and self.mode == "on"

    @property
    def idle(self) -> bool:
        """Not predicting and nothing queued, being read or waiting to be installed."""
        return not self.active and not (self._pending or self._reading or self._ready)

    def end_token(self, phase: str, seconds: Optional[float] = None):
        """Between tokens (`seconds`: the wall time of the pass that ended, None where unknown): check
        precision every window, the gain prefetch can make, and whether it pays at all."""
        stall = sum(c.stats.stall_s for c in self.caches)
        self._marks.append(_Mark(self.mode if phase == "decode" else phase, seconds, stall, self._totals()[0],
                                 self.reads, self.read_s, self.busy_s, self.install_s / max(self.installs, 1)))
        del self._marks[:-64]
        if phase != "decode":
            return
        self.decode_tokens += 1
        self._check_precision()
        self._check_gain()
        self._check_cost()

    def _check_precision(self):
        tokens0, useful0, wasted0 = self._window_start
        if self.decode_tokens - tokens0 < self.window:
            return
        useful, wasted = self._totals()
        du, dw = useful - useful0, wasted - wasted0
        self._window_start = (self.decode_tokens, useful, wasted)
        if du + dw == 0:
            return
        precision = du / (du + dw)
        if precision < self.min_precision and self.per_layer > 0:
            self.per_layer //= 2
            self.backoffs += 1
            self.backoff_reason = (f"precision {precision:.2f} over the last {self.window} tokens is below "
                                   f"{self.min_precision}: now {self.per_layer} experts per layer")
        elif precision > self.recover_precision and self.per_layer < self.per_layer_max:
            self.per_layer = min(self.per_layer_max, max(1, self.per_layer * 2))

    def _gain(self, tokens: int) -> Optional[dict]:
        """Over the last `tokens` tokens, per token: the time prefetch saved the demand path (on: its useful
        prefetches times the mean read and install time) or could have saved (paused: the demand stall),
        what it cost the generation thread (on: predicting, queueing, installing), and the token time, in ms."""
        marks = self._marks[-tokens - 1:]
        if len(marks) < tokens + 1 or any(m.mode != self.mode or m.seconds is None for m in marks[1:]):
            return None
        first, last = marks[0], marks[-1]
        if self.mode == "on":
            reads = last.reads - first.reads  # the mean read time of this stretch, else of all reads
            per_read = (last.read_s - first.read_s) / reads if reads else last.read_s / max(last.reads, 1)
            hidden = (last.useful - first.useful) * (per_read + last.per_install_s)
        else:
            hidden = last.stall_s - first.stall_s
        ms = 1e3 / tokens
        return {"tokens": tokens, "hidden_ms": hidden * ms, "cost_ms": (last.busy_s - first.busy_s) * ms,
                "token_ms": sum(m.seconds for m in marks[1:]) * ms}

    @property
    def measuring(self) -> bool:
        """True while the first tokens of a stretch with prefetch on are being measured: the policy's
        compute is then timed apart (one more sync per layer)."""
        return self.mode == "on" and self.decode_tokens - self._mode_since < self.first_check

    def _check_gain(self):
        """Prefetch gains at most the demand reads it saves. When, over its first tokens, that is less than
        what it costs the generation thread (plus `min_gain` of a token), as for a small model read from the
        page cache, it pauses; while paused, a demand stall worth twice that cost brings it back."""
        n = self.decode_tokens - self._mode_since
        if self.mode == "on" and n == self.first_check:
            gain = self._gain(n)
            if gain is None:
                return
            self.gain = gain
            if gain["hidden_ms"] < gain["cost_ms"] + self.min_gain * gain["token_ms"]:
                self.backoffs += 1
                self.backoff_reason = (f"prefetch saves {gain['hidden_ms']:.2f} ms of demand reads per token and costs "
                                       f"{gain['cost_ms']:.2f} ms of a {gain['token_ms']:.1f} ms token: paused "
                                       f"until the demand stall grows")
                self._set_mode("paused", "gain")
        elif self.mode == "paused" and self._pause_kind == "gain" and n >= self.probe_tokens:
            stall = self._gain(self.probe_tokens)
            if stall is not None and stall["hidden_ms"] > max(2 * self.gain["cost_ms"], self.min_gain * stall["token_ms"]):
                self._set_mode("on")

    def _check_cost(self):
        """Every `probe_every` tokens with prefetch on, run `probe_tokens` with it off and compare token
        times (the first two of each stretch skipped: earlier prefetches still land). If off is faster,
        prefetch costs more than it saves: it pauses for `pause_tokens`, then tries again."""
        n = self.decode_tokens - self._mode_since
        every = self.first_probe if self.probe is None else self.probe_every  # decide early, then check
        if self.mode == "on" and n >= every:
            self._set_mode("probe")
        elif self.mode == "probe" and n >= self.probe_tokens:
            on, off = (self._token_seconds(mode)[-(self.probe_tokens - 2):] for mode in ("on", "probe"))
            if on and off:
                self.probe = {"on_ms": 1e3 * float(np.mean(on)), "off_ms": 1e3 * float(np.mean(off))}
            if on and off and np.mean(off) < np.mean(on) * (1 - self.cost_margin):
                self.backoffs += 1
                self.backoff_reason = (f"prefetch costs more than it saves: {self.probe['on_ms']:.1f} ms/token with "
                                       f"it, {self.probe['off_ms']:.1f} without; paused for {self.pause_tokens} tokens")
                self._set_mode("paused", "cost")
            else:
                self._set_mode("on")
        elif self.mode == "paused" and n >= self.pause_tokens:
            self._set_mode("on")

    def _token_seconds(self, mode: str) -> List[float]:
        """Wall times of the recent decode tokens that ran in `mode`."""
        return [m.seconds for m in self._marks if m.mode == mode and m.seconds is not None]

    def _set_mode(self, mode: str, pause_kind: Optional[str] = None):
        self.mode, self._mode_since, self._pause_kind = mode, self.decode_tokens, pause_kind

    # -- reader thread ----------------------------------------------------------------------------
    def _reader(self):
        while True:
            with self._cv:
                while not self._stop and not (self._pending and self._inflight_bytes < self.max_inflight_bytes):
                    self._cv.wait()
                if self._stop:
                    return
                key, r = max(self._pending.items(), key=lambda kv: kv[1].score)
                del self._pending[key]
                self._reading[key] = r
                self._inflight_bytes += r.nbytes
                self.issued += 1
            cache = self.caches[r.layer]
            t0 = time.perf_counter()
            with self._cv:
                spare = self._spare.get(r.layer)
                r.staging = spare.pop() if spare else Staging(cache.layout, 1)
            try:
                r.raw = self.store.read(cache.layout, [r.expert], r.staging)
                self.bytes_read += cache.layout.expert_nbytes
            except BaseException as e:  # raised on the generation thread when installed
                r.error = e
            r.read_s = time.perf_counter() - t0
            with self._cv:
                self.read_s += r.read_s
                self.reads += 1
                del self._reading[key]
                self._ready[key] = r
                self._cv.notify_all()

    def close(self):
        with self._cv:
            self._stop = True
            self._cv.notify_all()

    # -- statistics -------------------------------------------------------------------------------
    def _totals(self):
        return (sum(c.stats.prefetch_useful for c in self.caches), sum(c.stats.prefetch_wasted for c in self.caches))

    def stats(self) -> dict:
        useful, wasted = self._totals()
        with self._cv:
            queued = len(self._reading) + len(self._ready)
            pending = len(self._pending)
        installed_unused = int(sum(c.unused_prefetch.sum() for c in self.caches))
        return {"issued": self.issued, "useful": useful, "late": self.late, "wasted": wasted,
                "in_flight": queued + installed_unused, "pending": pending, "dropped": self.dropped,
                "precision": useful / (useful + wasted) if useful + wasted else None,
                "bytes_read": self.bytes_read, "read_s": self.read_s, "wait_s": self.wait_s,
                "experts_per_layer": self.per_layer, "mode": self.mode, "cost_probe": self.probe, "gain": self.gain,
                "backoffs": self.backoffs, "backoff_reason": self.backoff_reason}

    def reset_stats(self):
        for c in self.caches:
            c.unused_prefetch[:] = False
        with self._cv:
            self.issued = len(self._reading) + len(self._ready)  # still outstanding: keeps the invariant
        self.late = self.dropped = self.bytes_read = self.reads = self.installs = 0
        self.read_s = self.wait_s = self.busy_s = self.install_s = 0.0
        self.backoffs, self.backoff_reason = 0, None
        self.decode_tokens = 0
        self._window_start = (0, 0, 0)
        self.mode, self._mode_since, self.probe = "on", 0, None
        self._pause_kind, self._marks, self.gain = None, [], None
        self.per_layer = self.per_layer_max
