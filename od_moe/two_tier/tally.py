"""Routing counts kept on the device in two-tier mode, read by the host a few passes late, never waited for.

A two-tier pass (`two_tier_runtime.py`) never learns its routing on the host. What the host needs of it, how
often each expert was routed (admission) and how many routed lanes found their expert in a slot (the ledger's
hits), is added up on the device by each pass: one scatter-add of the pass's expert ids into a (layers x
experts) count and one of its hit lanes into a (phases x layers) count, both lazy, built into the pass's
graph. A decode pass's are computed with its token (`tie`). A prompt pass's output is not evaluated, so
`launch` starts its counts between passes (after that pass, on the same stream). `read` hands the host the
counts as of an earlier pass, one that is sure to be done when the caller says so (`LAG`), with no wait;
`read()` waits (settling the ledger for `stats()`). Lookups need no device data (a layer's lane count is its
ids' shape) and are booked by the caller. `record_routing`'s routing is kept the same way (`RoutingRecord`):
each pass's ids stacked on the device, read by the host when the ledger is settled; and the device-kept rows'
copies and hit lanes (`RunningCounts`), running sums each of their kernel calls carries on.
Not here: what the counts decide (`admission.py`), the ledger itself (`accounting/ledger.py`).
"""

from collections import deque

import mlx.core as mx
import numpy as np

from ..accounting.ledger import PHASES

LAG = 3  # a pass this many passes back is done when the next is built in mlx-lm's pipelined loop


class DeviceTally:
    """Cumulative routing counts and hits of `layers` MoE layers of `experts` experts, on the device."""

    def __init__(self, layers: int, experts: int, phases: int = 2):
        self.layers, self.experts, self.phases = layers, experts, phases
        self.counts = mx.zeros((layers * experts,), mx.int32)
        self.hits = mx.zeros((phases * layers,), mx.int32)
        # staged: `staged_passes.staged_switch`'s counts
        self.union = mx.zeros((phases * layers, 4), mx.int32)
        # evaluated now: another thread may generate, and MLX streams are per thread
        mx.eval(self.counts, self.hits, self.union)
        self._offsets: dict[tuple, mx.array] = {}
        self._added: int | None = None  # the pass whose additions are not launched yet
        self._launched: deque[tuple] = deque()  # (pass, counts, hits, union)
        self._seen = (
            0,
            np.zeros(layers * experts, np.int64),
            np.zeros(phases * layers, np.int64),
            np.zeros((phases * layers, 4), np.int64),
        )

    def _offset(self, rows: tuple[int, ...], stride: int) -> mx.array:
        key = (rows, stride)
        if key not in self._offsets:
            self._offsets[key] = mx.array((np.asarray(rows, np.int32) * stride)[:, None])
        return self._offsets[key]

    def add(
        self,
        clock: int,
        phase: int,
        routed: dict[int, mx.array],
        hit: dict[int, mx.array],
        union: dict[int, mx.array] | None = None,
    ):
        """Pass `clock`'s routed ids of the layers in `routed` (each layer's ids the same shape), the hit
        lanes (bool, the ids' shape) of the layers in `hit`, and the union counts ((4,) int32) of the
        layers in `union`, added lazily."""
        if routed:
            layers = tuple(routed)
            ids = mx.stack([routed[i].reshape(-1) for i in layers]).astype(mx.int32)
            self.counts = self.counts.at[(ids + self._offset(layers, self.experts)).reshape(-1)].add(1)
        if hit:
            layers = tuple(hit)
            lanes = mx.stack([hit[i].reshape(-1) for i in layers]).astype(mx.int32).sum(axis=1)
            where = self._offset(tuple(phase * self.layers + i for i in layers), 1).reshape(-1)
            self.hits = self.hits.at[where].add(lanes)
        if union:
            layers = tuple(union)
            where = self._offset(tuple(phase * self.layers + i for i in layers), 1).reshape(-1)
            self.union = self.union.at[where].add(mx.stack([union[i] for i in layers]))
        if routed or hit or union:
            self._added = clock

    def tie(self, output: mx.array) -> mx.array:
        """`output` (a decode pass's last MoE layer's) made to depend on what this pass added, so that the
        pass's own evaluation (its token) computes the counts: no evaluation of their own. An eval per
        pass cost the host a tenth of a token where the host sets the token's time (`docs/GPU.md`, "Where
        a decoded token's time goes"). Not for a prompt's pass: its output is not evaluated (mlx-lm evaluates
        the caches)."""
        return output if self._added is None else mx.depends(output, self._queue())

    def launch(self):
        """Start computing what the last pass added (call between passes: it is queued after that pass)."""
        if self._added is not None:
            mx.async_eval(*self._queue())

    def _queue(self) -> list[mx.array]:
        """The counts as of the last pass that added, queued for `read`; nothing is left to add for it."""
        arrays = [self.counts, self.hits, self.union]
        self._launched.append((self._added, *arrays))
        self._added = None
        return arrays

    def read(self, done_by: int | None = None) -> tuple | None:
        """(passes covered since the last read, routing counts (layers, experts), hits (phases, layers),
        staged passes' counts (phases, layers, 4)) added since the last read, as of the newest
        launched pass numbered `done_by` or less; None where there is none. `done_by=None`: everything,
        launched or not, waiting for it."""
        if done_by is None:
            self.launch()
            done_by = self._launched[-1][0] if self._launched else -1
        ready = [entry for entry in self._launched if entry[0] <= done_by]
        if not ready:
            return None
        clock, *arrays = ready[-1]
        counts, hits, union = (np.array(a).astype(np.int64) for a in arrays)
        while self._launched and self._launched[0][0] <= clock:
            self._launched.popleft()
        seen_clock, seen_counts, seen_hits, seen_union = self._seen
        self._seen = (clock, counts, hits, union)
        return (
            clock - seen_clock,
            (counts - seen_counts).reshape(self.layers, self.experts),
            (hits - seen_hits).reshape(self.phases, self.layers),
            (union - seen_union).reshape(self.phases, self.layers, 4),
        )


def book_read(ledger, admission, read) -> bool:
    """A tally read (`DeviceTally.read`) into `ledger` (`stats.Ledger`: hits, staged passes' counts) and
    `admission` (`admission.Admission`: routing counts); False where there was none."""
    if read is None:
        return False
    passes, counts, hits, union = read
    for p, phase in enumerate(PHASES):
        for layer in np.flatnonzero(hits[p]):
            ledger.count_lookups(phase, int(layer), 0, int(hits[p, layer]))
        for layer in np.flatnonzero(union[p, :, 0]):
            experts, held, staged, missed = (int(n) for n in union[p, layer])
            ledger.add(
                phase,
                int(layer),
                experts=experts,
                expert_hits=held,
                routings_read=staged,
                staged_misses=missed,
            )
    admission.add(counts, passes)
    return True


class RoutingRecord:
    """The routing of every pass while it is recorded (`Engine.record_routing`): each pass's routed ids by
    layer stacked on the device (`add`), read by the host at `read` (no pass waits for it)."""

    def __init__(self):
        self.passes: list[dict[int, np.ndarray]] = []  # read: [{layer: ids (tokens, k)}, ...]
        self._lazy: list[tuple[mx.array, int]] = []  # (a pass's ids (layers, lanes), k), not read yet

    def add(self, routed: dict[int, mx.array]):
        """A pass's routed ids (each (..., k)) by layer."""
        ids = [ids for _, ids in sorted(routed.items())]
        self._lazy.append((mx.stack([i.reshape(-1) for i in ids]), ids[0].shape[-1]))

    def read(self) -> bool:
        """Wait for the passes not read yet and add them to `passes`; whether there were any."""
        lazy, self._lazy = self._lazy, []
        if lazy:
            mx.eval([ids for ids, _ in lazy])
            self.passes += [
                {i: row.reshape(-1, k) for i, row in enumerate(np.array(ids).astype(np.int64))}
                for ids, k in lazy
            ]
        return bool(lazy)


class RunningCounts:
    """Each layer's copies and hit lanes (of its own calls) so far, as running counts each kernel call takes
    and gives back (`on_device`, (2,) int32 a layer) or the host path adds to (`on_host`): a pass keeps
    nothing of its own for the host to read later, however long the generation."""

    def __init__(self, layers: int, device: bool):
        self.device = device
        self.on_device = [mx.zeros((2,), mx.int32) for _ in range(layers)]
        mx.eval(self.on_device)
        self.on_host = np.zeros((layers, 2), np.int64)
        self._read = np.zeros((layers, 2), np.int64)  # the counts as of the last `read`
        self._passes: deque = deque(maxlen=LAG + 1)  # the counts as of each of the last passes

    def of(self, layer: int) -> mx.array:
        """The layer's running counts on the device, as its next kernel call takes them."""
        return self.on_device[layer]

    def set(self, layer: int, counted: mx.array):
        """The layer's running counts as its last kernel call gave them."""
        self.on_device[layer] = counted

    def add(self, layer: int, copies: int, hits: int):
        """Copies and hit lanes the host path made for the layer."""
        self.on_host[layer] += (copies, hits)

    def end_pass(self):
        """Keep the counts as of this pass, for `read(lagged=True)`."""
        self._passes.append(list(self.on_device) if self.device else self.on_host.copy())

    def read(self, lagged: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(copies, hit lanes) per layer since the last read: as of now, waiting for the passes that made
        them (the layers' counts brought to the host as one array), or `lagged`, as of `LAG` passes back,
        done in mlx-lm's pipelined loop: each layer's count read as it is, no operation queued behind the
        passes in flight (nothing where fewer passes ran since the last read)."""
        layers = len(self.on_device)
        if lagged:
            if len(self._passes) <= LAG:
                return np.zeros(layers, np.int64), np.zeros(layers, np.int64)
            then = self._passes[0]
            now = np.stack([np.array(c) for c in then]) if self.device else then
        else:
            now = np.array(mx.stack(self.on_device)) if self.device else self.on_host
        self._passes.clear()  # older than what is read now
        since, self._read = now.astype(np.int64) - self._read, now.astype(np.int64)
        return since[:, 0], since[:, 1]
