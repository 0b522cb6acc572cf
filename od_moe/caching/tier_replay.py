"""Replaying recorded routing through three tiers against a clock: device slots, a bounded host tier and
the disk, per MoE layer, and what a read-ahead policy would read, waste and wait for.

A decode pass runs its MoE layers in order, each taking `TierClock.layer_ms` of compute (the all-in-host
token's time over its layers, measured on the machine the figures are for). The tiers do not overlap, as
`two_tier/host_tier.py` keeps them: a routed expert in a device slot is a device lane, one in a host row
that has landed a host lane, any other a disk lane. The disk is one queue at the rate the bench's probe
measured with the reader threads' reads in flight (`TierClock.disk_rate`): a read starts when the disk is
free of earlier reads and takes `expert_bytes / disk_rate`.

How the product learns that an expert is absent (`two_tier/disk_passes.py`) is modelled: a pass runs
flagged on the tables made at its start, so an expert landing during the pass is still absent to it; at
its first layer with an absent expert the pass stops, having run `lag` layers past it (their compute
wasted), and from that layer on each layer waits for its reads (exact layers). A forecast made at a
flagged layer reaches the reader threads `lag` layers later (it is read with the flags), one made at an
exact layer at once.

Policies: demand only (no forecast); `Forecast`s for layers ahead (the shadow network's or next-gate's top
experts, ranked); the `oracle`, reading the routing of the next `distance` layers (on into the next pass)
and evicting by true next use (Belady). Reads are served first come, first served (as a pool of reader
threads serves them) or a layer's own first (`demand_first`); a read ahead still queued when its layer ran
without it is taken off the queue. Host eviction: least recent use (`lru`), decayed use counts (`lfu`),
forecast rank (`predicted`: unpredicted experts first, least recently used first, then the lowest-ranked
prediction; a read ahead is not issued where only better-ranked predictions could give it a row), or the
next-use head's estimates (`next-use`: the expert estimated to be routed again last goes first, a live
prediction's experts last). A row being read, or used by the pass in flight, is not evicted (the product
frees rows at pass boundaries). Device slots are kept by recency (every routed expert into a slot, the
slot's victim taking the host row it left) or admitted as the product admits them (`admitted`,
`SlotAdmission`: every few passes, the most used by decayed counts, a newcomer by a margin; the two
swap tiers).

Not here: the live tiers, prompts (decode passes only), copies from host to device ahead of need, the
bus's time (a host lane costs what it cost in the all-in-host token).
"""

import bisect
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from .layer_cache import LFU_HALF_LIFE

EVICTIONS = ("lru", "lfu", "predicted", "next-use")
SLOTS = ("recency", "admitted")
LFU_DECAY = 0.5 ** (1 / LFU_HALF_LIFE)  # a use count's factor a pass, as the caches decay them


@dataclass(frozen=True)
class SlotAdmission:
    """How "admitted" slots are chosen, as the product admits them past the host's memory (`two_tier/
    settings.py`): every `every` passes, by routing counts that halve every `half_life` passes, a newcomer
    only where its count exceeds the slot holder's by `margin`."""

    # the product's (`ADMIT_EVERY_PAST_HOST`, `HALF_LIFE`, `MARGIN`; caching sits below two_tier, and a test
    # holds the two equal)
    every: int = 8
    half_life: float = 32.0
    margin: float = 2.0

    @property
    def decay(self) -> float:
        """A count's factor a pass."""
        return 0.5 ** (1 / self.half_life)


@dataclass(frozen=True)
class TierClock:
    """What a replay's time is made of: compute a MoE layer (ms), the disk's rate (bytes a second), an
    expert's bytes, and the layers a flagged pass runs past its first miss (`TwoTierSettings.flag_lag`)."""

    layer_ms: float
    disk_rate: float
    expert_bytes: int
    lag: int = 2

    @property
    def read_ms(self) -> float:
        return self.expert_bytes / self.disk_rate * 1000


@dataclass(frozen=True)
class Forecast:
    """Experts to read ahead, made from a layer's input: `ahead[t][layer]` maps each target layer (later in
    the pass) to (expert ids best first, their ranks: the chance each is routed, discounted with distance)."""

    name: str
    ahead: Sequence[Sequence[dict[int, tuple[np.ndarray, np.ndarray]]]]


@dataclass
class TierFigures:
    """Counts over the replayed passes and the modelled time (ms)."""

    passes: int = 0
    device_lanes: int = 0
    host_lanes: int = 0  # landed in a host row before its layer needed it
    disk_lanes: int = 0  # read or waited for at the layer that needed it
    demand_reads: int = 0
    ahead_reads: int = 0
    ahead_used: int = 0  # routed while in the host tier (on time or late)
    ahead_late: int = 0  # of those, still on its way when its layer needed it
    ahead_wasted: int = 0  # evicted before any use
    ahead_skipped: int = 0  # not issued: no row could be given
    ahead_cancelled: int = 0  # taken off the queue unstarted: its layer ran without it (not in `reads`)
    stopped: int = 0  # passes stopped at their first absent expert
    compute_ms: float = 0.0
    wasted_ms: float = 0.0  # layers a stopped pass ran past its miss
    stall_ms: float = 0.0  # waited for reads

    @property
    def reads(self) -> int:
        return self.demand_reads + self.ahead_reads

    @property
    def token_ms(self) -> float:
        return (self.compute_ms + self.wasted_ms + self.stall_ms) / max(self.passes, 1)

    def per_token(self, name: str) -> float:
        return getattr(self, name) / max(self.passes, 1)

    @property
    def wasted_of_reads(self) -> float:
        return self.ahead_wasted / self.reads if self.reads else 0.0

    def as_dict(self) -> dict:
        return {f.name: getattr(self, f.name) for f in fields(self)} | {
            "reads": self.reads,
            "token_ms": self.token_ms,
            "wasted_of_reads": self.wasted_of_reads,
        }


class _NextUse:
    """(expert, time) -> the next time a layer routes the expert after `time` (time: pass x L + layer)."""

    def __init__(self, routing: Sequence[Sequence[np.ndarray]], layer: int):
        L = len(routing[0])
        self.times: dict[int, list[int]] = {}
        for t, step in enumerate(routing):
            for e in step[layer]:
                self.times.setdefault(int(e), []).append(t * L + layer)

    def __call__(self, expert: int, time: int) -> float:
        seq = self.times.get(expert, [])
        i = bisect.bisect_right(seq, time)
        return seq[i] if i < len(seq) else float("inf")


class _Layer:
    """One MoE layer's device slots (by recency) and host rows (expert -> when it lands, ms)."""

    def __init__(
        self,
        device: int,
        host: int,
        eviction: str,
        next_use: _NextUse | None,
        layers: int,
        admission: SlotAdmission | None,
    ):
        self.device_slots, self.host_rows, self.layers, self.admission = device, host, layers, admission
        # use counts decay as admission's where slots are admitted (`lfu` eviction then counts the same way)
        self.decay = LFU_DECAY if admission is None else admission.decay
        self.eviction, self.next_use = eviction, next_use
        self.estimate: np.ndarray | None = None  # `next-use`: each expert's estimated next pass here
        self.device: OrderedDict[int, None] = OrderedDict()
        self.host: dict[int, float] = {}
        self.last: dict[int, float] = {}  # expert -> last use or landing (ms)
        self.ahead: set[int] = set()  # read ahead and not used since
        self.rank: dict[int, float] = {}  # live predictions for this layer's next run
        self.busy: set[int] = set()  # used by the pass in flight
        self.uses: dict[int, tuple[float, int]] = {}  # `lfu`: expert -> (decayed use count, at pass)

    def key(self, e: int, index: int) -> tuple:
        """Lower is evicted first."""
        if self.next_use is not None:
            return (-self.next_use(e, index), e)
        if self.eviction == "next-use" and self.estimate is not None:
            return (np.inf if e in self.rank else -float(self.estimate[e]), e)
        if self.eviction == "lfu":
            return (self.count(e, index // self.layers), self.last.get(e, 0.0), e)
        if self.eviction == "predicted" and e in self.rank:
            return (1, self.rank[e], self.last.get(e, 0.0), e)
        return (0, 0.0, self.last.get(e, 0.0), e)

    def count(self, e: int, t: int) -> float:
        """`e`'s use count here, decayed to pass `t`."""
        count, at = self.uses.get(e, (0.0, t))
        return count * self.decay ** (t - at)

    def victim(self, now: float, index: int) -> int | None:
        """The host row's expert to evict (None: a row is free, or every row is being read or used by the
        pass in flight)."""
        if len(self.host) < self.host_rows:
            return None
        free = [e for e, landed in self.host.items() if landed <= now and e not in self.busy]
        return min(free, key=lambda e: self.key(e, index)) if free else None

    def use(self, ids: list[int], now: float, t: int):
        """The layer ran on `ids`: each moves to a device slot (slots kept by recency), the slot's victim to
        the row it left (if there is one: none where the host tier has no room)."""
        for e in ids:
            self.last[e] = now
            self.uses[e] = (self.count(e, t) + 1.0, t)
            self.busy.add(e)
            if e in self.device:
                self.device.move_to_end(e)
                continue
            if not self.device_slots or self.admission is not None:
                continue
            del self.host[e]
            self.device[e] = None
            if len(self.device) > self.device_slots:
                victim = next(x for x in self.device if x not in ids)
                del self.device[victim]
                if len(self.host) < self.host_rows:
                    self.host[victim] = now
        self.rank.clear()  # the predictions were for the run that just happened

    def admit(self, now: float, t: int):
        """Slots admitted by counts: the most used experts in a slot or a landed host row take the slots, a
        newcomer only where it was used the admission's margin more than the one it replaces; the two swap
        tiers."""
        assert self.admission is not None
        outside = sorted(
            (e for e, landed in self.host.items() if landed <= now), key=lambda e: (-self.count(e, t), e)
        )
        for e in outside:
            if len(self.device) < self.device_slots:
                del self.host[e]
                self.device[e] = None
                continue
            weakest = min(self.device, key=lambda x: (self.count(x, t), x))
            if self.count(e, t) <= self.count(weakest, t) + self.admission.margin:
                break
            del self.device[weakest], self.host[e]
            self.device[e] = None
            self.host[weakest] = now

    def begin_pass(self, now: float, t: int) -> int:
        """Pass `t` begins: nothing in use, slots admitted where due, rows over the tier's size given up
        (a pass needing more than it holds); how many of those were read ahead and never used."""
        self.busy.clear()
        if self.admission is not None and t and t % self.admission.every == 0:
            self.admit(now, t)
        wasted = 0
        while len(self.host) > self.host_rows and (victim := self.victim(now, t * self.layers)) is not None:
            wasted += self.drop(victim)
        return wasted

    def hold(self, ids: list[int]):
        """The layer's routed experts, in use by the pass in flight (a read for one takes no row from
        another)."""
        self.busy.update(ids)

    def predict(self, e: int, rank: float):
        """A forecast names `e` for this layer's next run, with `rank`."""
        self.rank[e] = max(rank, self.rank.get(e, 0.0))

    def start_ahead(self, e: int, issued: float):
        """A read ahead of `e` is queued at `issued`: its row is taken, landing when the disk reaches it."""
        self.last[e] = issued
        self.ahead.add(e)
        self.host[e] = np.inf

    def land(self, e: int, when: float):
        """The read of `e` started: it lands at `when`."""
        self.host[e] = when

    def used_ahead(self, e: int) -> bool:
        """`e` is routed: whether it was read ahead and not used since."""
        if e not in self.ahead:
            return False
        self.ahead.discard(e)
        return True

    def cancel(self, e: int):
        """A read ahead of `e` taken off the queue unstarted: its row is free."""
        del self.host[e]
        self.ahead.discard(e)

    def forget_ahead(self):
        """Reads ahead made so far are no longer followed (the warm-up ended)."""
        self.ahead.clear()

    def estimate_from(self, t: int, distances: np.ndarray):
        """The next-use head's estimates after pass `t`'s routing: the pass each expert is due at."""
        self.estimate = t + distances

    def drop(self, e: int) -> bool:
        """Give up `e`'s host row; whether it was read ahead and never used (a wasted read)."""
        del self.host[e]
        return self.used_ahead(e)


class _Disk:
    """One queue at the disk's rate. A read ahead waits in the queue (its row's landing time unknown, inf)
    until the disk reaches it; a demand read goes behind every queued read (`demand_first` False, as a
    pool of reader threads serves them) or before the queued reads ahead (True)."""

    def __init__(self, read_ms: float, layers: list, demand_first: bool):
        self.read_ms, self.layers, self.demand_first = read_ms, layers, demand_first
        self.free = 0.0  # when the read in progress ends
        self.queue: list[tuple[float, int, int]] = []  # reads ahead not started: (issued, layer, expert)

    def advance(self, now: float):
        """Start the queued reads the disk reaches by `now`."""
        while self.queue and max(self.free, self.queue[0][0]) <= now:
            self._start(*self.queue.pop(0))

    def ahead(self, issued: float, layer: int, expert: int):
        """Queue a read ahead (the layer has taken its row, `_Layer.start_ahead`)."""
        self.queue.append((issued, layer, expert))
        self.advance(issued)

    def demand(self, now: float, layer: int, expert: int):
        """Read `expert` of `layer` for a layer waiting at `now` (a queued read ahead of it is started)."""
        if not self.demand_first:
            while self.queue:
                self._start(*self.queue.pop(0))
        if self.layers[layer].host.get(expert, np.inf) < np.inf:  # a read ahead, started just now
            return
        self.cancel(layer, expert)  # queued ahead of need: read now instead
        self._start(now, layer, expert)

    def cancel(self, layer: int, expert: int) -> bool:
        """Take a read ahead not yet started off the queue; whether there was one."""
        queued = next((q for q in self.queue if q[1:] == (layer, expert)), None)
        if queued is not None:
            self.queue.remove(queued)
        return queued is not None

    def _start(self, issued: float, layer: int, expert: int):
        self.free = max(self.free, issued) + self.read_ms
        self.layers[layer].land(expert, self.free)


def replay_tiers(
    routing: Sequence[Sequence[np.ndarray]],
    device: int,
    host: int,
    clock: TierClock,
    forecast: Forecast | None = None,
    eviction: str = "lru",
    oracle_distance: int = 0,
    warm: int = 0,
    live_tables: bool = False,
    demand_first: bool = False,
    distances: np.ndarray | None = None,
    routed_ahead: bool = False,
    slots: str = "recency",
    admission: SlotAdmission = SlotAdmission(),
) -> TierFigures:
    """Replay decode passes' routing (`routing[t][layer]`: the routed expert ids) through `device` slots and
    `host` rows a layer, the rest on disk, under a forecast (None: demand only), host `eviction` ("lru",
    "predicted"), or the oracle reading `oracle_distance` layers ahead (Belady in the host tier). The
    first `warm` passes fill the tiers and are not counted. `live_tables`: a flagged pass sees a read that
    landed before its layer ran (tables the device reads as the host writes them), not only those that
    landed before the pass began. `demand_first`: a layer's own reads go before queued reads ahead. A read
    ahead not started when its layer runs without it is taken off the queue (`ahead_cancelled`).
    `distances` (passes, layers, experts): the next-use head's estimated passes until each expert is routed
    again, after each pass's routing, which eviction "next-use" evicts by (the farthest first; a forecast's
    experts count as needed at once). `routed_ahead`: a stopped pass also reads ahead what its flagged run
    routed to in the `lag` layers past its miss (`disk_prefetch="routed"`; modelled as their true routing,
    where the product's flagged run routed them from inputs that were wrong past the miss). `slots`:
    "recency" (every routed expert into a slot, the least recently used out) or "admitted" (as the
    product's, by `admission`: `_Layer.admit`)."""
    if slots not in SLOTS:
        raise ValueError(f"slots must be one of {SLOTS}, got {slots!r}")
    if eviction not in EVICTIONS:
        raise ValueError(f"eviction must be one of {EVICTIONS}, got {eviction!r}")
    if (eviction == "next-use") != (distances is not None):
        raise ValueError("eviction 'next-use', and only it, evicts by distances")
    if forecast is not None and oracle_distance:
        raise ValueError("a replay reads ahead by a forecast or by the oracle, not both")
    layers = len(routing[0])
    tiers = [
        _Layer(
            device,
            host,
            eviction,
            _NextUse(routing, j) if oracle_distance else None,
            layers,
            admission if slots == "admitted" else None,
        )
        for j in range(layers)
    ]
    disk = _Disk(clock.read_ms, tiers, demand_first)
    ranked = eviction != "lru" or bool(oracle_distance)
    replay = _Replay(routing, tiers, disk, clock, forecast, ranked, oracle_distance, distances)
    return replay.run(warm, live_tables, routed_ahead)


class _Replay:
    """One replay's tiers per layer, its disk queue, its clock (ms) and its counts (`TierFigures`' fields)."""

    def __init__(
        self, routing, layers, disk: _Disk, clock: TierClock, forecast, ranked, oracle_distance, distances
    ):
        self.routing, self.layers, self.disk, self.clock = routing, layers, disk, clock
        self.forecast, self.oracle_distance, self.distances = forecast, oracle_distance, distances
        self.ranked = ranked  # a read ahead may be refused a row held by a better one
        self.counts: Counter[str] = Counter()
        self.times = dict.fromkeys(("compute_ms", "wasted_ms", "stall_ms"), 0.0)
        self.now = 0.0

    def read_ahead(self, made: list, issued: float):
        """Issue forecasts `made` ((target layer, ids, ranks, time index)) at `issued`."""
        self.disk.advance(issued)
        for j, ids, ranks, index in made:
            tier = self.layers[j]
            for e, r in zip((int(e) for e in ids), ranks):
                if self.forecast is not None:
                    tier.predict(e, float(r))
                if e in tier.device or e in tier.host:
                    continue
                victim = tier.victim(issued, index)
                full = len(tier.host) >= tier.host_rows
                if full and (victim is None or self.ranked and tier.key(victim, index) >= tier.key(e, index)):
                    self.counts["ahead_skipped"] += 1
                    continue
                if victim is not None:
                    self.counts["ahead_wasted"] += tier.drop(victim)
                tier.start_ahead(e, issued)
                self.disk.ahead(issued, j, e)
                self.counts["ahead_reads"] += 1

    def run(self, warm: int, live_tables: bool, routed_ahead: bool) -> TierFigures:
        for t, step in enumerate(self.routing):
            if t == warm:  # counted from here: reads ahead made before are no longer followed
                self.counts = Counter()
                self.times = dict.fromkeys(self.times, 0.0)
                for tier in self.layers:
                    tier.forget_ahead()
            self.disk.advance(self.now)
            for tier in self.layers:
                self.counts["ahead_wasted"] += tier.begin_pass(self.now, t)
            self.run_pass(t, step, live_tables, routed_ahead)
        times = self.times
        return TierFigures(
            **self.counts,
            compute_ms=times["compute_ms"],
            wasted_ms=times["wasted_ms"],
            stall_ms=times["stall_ms"],
        )

    def run_pass(self, t: int, step, live_tables: bool, routed_ahead: bool):
        clock, disk, counts, L = self.clock, self.disk, self.counts, len(self.layers)
        start, flagged, stopped_at = self.now, True, -1
        delayed: list[tuple[int, list]] = []  # (due layer, forecasts) made at flagged layers, not yet read
        for j in range(L):
            index = t * L + j
            made = _forecasts(self.routing, t, j, index, self.forecast, self.oracle_distance)
            if flagged:
                delayed.append((j + clock.lag, made))
            else:
                self.read_ahead(made, self.now)
            while delayed and delayed[0][0] <= j:
                self.read_ahead(delayed.pop(0)[1], self.now)
            disk.advance(self.now)
            tier, ids = self.layers[j], [int(e) for e in step[j]]
            seen = self.now if live_tables else start
            if flagged and any(e not in tier.device and tier.host.get(e, np.inf) > seen for e in ids):
                counts["stopped"] += 1  # the pass stops here and runs again, exact, from this layer
                self.times["wasted_ms"] += clock.lag * clock.layer_ms
                self.now += clock.lag * clock.layer_ms
                flagged, stopped_at = False, j
                for _, made in delayed:
                    self.read_ahead(made, self.now)
                delayed = []
                disk.advance(self.now)
            tier.hold(ids)
            for e in ids:
                if e in tier.device:
                    counts["device_lanes"] += 1
                elif e not in tier.host:
                    victim = tier.victim(self.now, index)  # None: over by a row till the pass ends
                    if victim is not None:
                        counts["ahead_wasted"] += tier.drop(victim)
                    disk.demand(self.now, j, e)
                    counts["demand_reads"] += 1
                elif tier.host[e] == np.inf:  # read ahead, still queued: read now
                    disk.demand(self.now, j, e)
            if routed_ahead and stopped_at == j:  # what the flagged run routed to past its miss
                later = range(j + 1, min(j + clock.lag, L - 1) + 1)
                self.read_ahead([(i, step[i], np.ones(len(step[i])), index) for i in later], self.now)
            ready = self.now
            for e in ids:
                if e in tier.device:
                    continue
                landed = tier.host[e]
                counts["host_lanes" if landed <= self.now else "disk_lanes"] += 1
                if tier.used_ahead(e):
                    counts["ahead_used"] += 1
                    counts["ahead_late"] += landed > self.now
                ready = max(ready, landed)
            self.times["stall_ms"] += ready - self.now
            self.now = ready
            for e in [e for e in tier.rank if e in tier.ahead and e not in ids]:
                if disk.cancel(j, e):  # predicted for this run, not routed, never started
                    tier.cancel(e)
                    counts["ahead_reads"] -= 1
                    counts["ahead_cancelled"] += 1
            tier.use(ids, self.now, t)
            if self.distances is not None:
                tier.estimate_from(t, self.distances[t, j])
            self.now += clock.layer_ms
            self.times["compute_ms"] += clock.layer_ms
        for _, made in delayed:  # read with the logits
            self.read_ahead(made, self.now)
        counts["passes"] += 1


def _forecasts(routing, t: int, j: int, index: int, forecast: Forecast | None, distance: int) -> list:
    """(target layer, ids, ranks, time index) to read ahead from layer j's input in pass t."""
    if forecast is not None:
        return [(target, ids, ranks, index) for target, (ids, ranks) in forecast.ahead[t][j].items()]
    made = []
    L = len(routing[0])
    for d in range(1, distance + 1):
        tp, target = divmod(j + d, L)
        if t + tp < len(routing):
            ids = routing[t + tp][target]
            made.append((target, ids, np.ones(len(ids)), index))
    return made
