"""Rows kept by the device in two-tier mode: a layer's misses copied into its least recently used rows
before it reads them, and experts forecast for a layer copied there while earlier layers compute.

Two-tier mode (`two_tier_runtime.py`) reads a miss in place, from host memory, inside the kernel that needs
it, so its bytes cross PCIe after the layers before it and add to the pass's time. Here each MoE layer has
`rows` more device rows after its slots (stack rows E+C .. E+C+S-1, in the kernel's names: E experts, C
slots, S rows, P candidates). During a decode pass, at a source layer some layers before a target, a
forecast (`forecast.py`: the shadow network, or next-gate: the target's router applied to the source's
hidden state) scores the target's experts on the device; the top `predicted` not in a slot are copied into
the rows by one kernel, and the target's expert->row table for this pass is that kernel's output. The copy
depends only on the forecast, so on CUDA it runs beside the layers in between (MLX's CUDA graphs order
kernels by the buffers they read and write, not one after another), and the target reads the experts it
was forecast from device memory. Nothing waits for the host. The layer itself (`demand`) copies its routed
experts not yet in a row the same way, just before it reads them (`two_tier="lru"`: the slots are all such
rows): one copy per miss, the bytes a read in place would cross, and the expert stays for the next tokens.
A decode pass of one position makes that call part of its layer's compiled call (`fused_lanes`); other
passes call it op by op (`lanes`). How the rows are kept is `settings.KeptRowsSettings`.

What a row holds is known only on the device (`held`, an output of each copy that the next pass's copy
takes as input). A row is rewritten only by a pass whose forecast depends on every earlier pass's output,
so no read of the old contents can still be in flight; a forecast that misses costs PCIe bytes, never a
wrong token (an expert not copied is read in place, as before).

On the CPU (and Metal) the stacks are host memory and no kernel runs: `plan` decides in numpy what the
kernel decides, after waiting for the candidates, and writes the rows through numpy views, so the same
tables and rows are exercised by the tests. Not here: the kernel's CUDA source (`kernels.py`), the slots
and their admission (`two_tier_runtime.py`), the forecasts (`forecast.py`).
"""

import functools
from collections.abc import Callable

import mlx.core as mx
import numpy as np

from . import slot_fill, staged_passes
from .kernels import (
    FUSED_OUTPUTS,
    KEPT_ROWS_INPUTS,
    KEPT_ROWS_OUTPUTS,
    THREADS,
    Kernel,
    cuda_kernel,
    kept_rows_source,
    row_units,
)
from .layer_step import Lanes
from .mapped import host_view
from .settings import KeptRowsSettings
from .tally import RunningCounts

AGE_EMPTY = 1 << 30  # the age of an empty row: it goes first


def plan(
    want: list[int],
    base: np.ndarray,
    held: np.ndarray,
    age: np.ndarray,
    E: int,
    C: int,
    demand: bool,
    score: np.ndarray | None = None,
    decay: float | None = None,
):
    """What the kernel decides, in numpy: (rows (E,), held after (S,), ages after (S,), [(expert, row) to
    copy], scores after (E,) float32). `want`: candidate experts, best first; those in a slot or repeated
    are dropped. A row holding a wanted expert keeps it (age 0); each other wanted expert goes to the
    least recently used row not holding a wanted one (empty rows first; ties: the lower row), until none
    is left; a `demand` call (the layer's own routing) ages every other row by one. With a `decay`, a
    demand call keeps decayed routing counts instead (`score`: each expert's, times `decay` a call plus 1
    where wanted) and a wanted expert takes the lowest-counted row (empty first) only where its own count
    is higher; else it is read in place."""
    seen, kept = set(), []
    for e in want:
        if 0 <= e < E and base[e] < E and e not in seen:
            kept.append(e)
        seen.add(e)
    wanted = set(kept)
    counts = decay is not None and demand
    score = np.zeros(E, np.float32) if score is None else score.astype(np.float32)
    if counts:
        score = score * np.float32(decay)
        score[kept] += np.float32(1)
    now, new_age = held.astype(np.int64).copy(), age.astype(np.int64).copy()
    free = np.array([int(h) not in wanted for h in held])
    if demand:
        new_age[free] = np.minimum(new_age[free] + 1, AGE_EMPTY)
    new_age[~free] = 0
    copies = []
    for e in kept:
        if any(not free[s] and now[s] == e for s in range(len(now))):
            continue
        rows_free = np.flatnonzero(free)
        if not rows_free.size:
            break
        if counts:  # argmin / argmax: the first (lowest) row among equals
            empty = rows_free[now[rows_free] < 0]
            v = int(empty[0]) if empty.size else int(rows_free[np.argmin(score[now[rows_free]])])
            if now[v] >= 0 and not score[e] > score[now[v]]:
                continue
        else:
            v = int(rows_free[np.argmax(age[rows_free])])
        free[v], now[v], new_age[v] = False, e, 0
        copies.append((e, E + C + v))
    return _overlay(base, now, E, C), now, new_age, copies, score


def padded_size(lanes: int) -> int:
    """Candidates a demand call takes for `lanes` routed lanes: the next power of two from 8, so that the
    kernel, compiled for each size, has a few sizes (8 to 128 for a batch of 8 at top-10), not one per
    batch size."""
    return max(8, 1 << (lanes - 1).bit_length())


def demand_sizes(lanes: int) -> list[int]:
    """Every size a demand call of 1 to `lanes` routed lanes takes (`padded_size`)."""
    return sorted({padded_size(n) for n in range(1, lanes + 1)})


def padded(ids: mx.array, E: int) -> mx.array:
    """`ids` (routed experts) made `padded_size` long with `E`, an id no call copies or counts."""
    size = padded_size(ids.size)
    return ids if size == ids.size else mx.concatenate([ids, mx.full((size - ids.size,), E, ids.dtype)])


def _overlay(base: np.ndarray, held: np.ndarray, E: int, C: int) -> np.ndarray:
    """`base` with each expert `held` in a row (not in a slot) pointing at that row."""
    rows = base.astype(np.int64).copy()
    for s, e in enumerate(held):
        if e >= 0 and rows[e] < E:
            rows[e] = E + C + s
    return rows


def top(scores: np.ndarray, count: int) -> list[int]:
    """The `count` best-scored experts, best first (ties: the lower id), as the kernel ranks them."""
    return [int(e) for e in np.argsort(-scores, kind="stable")[:count]]


class KeptRows:
    """`rows` rows per layer after its slots (`slots[layer]` of them: `stacks` have num_experts + slots +
    rows rows), least recently used first (or by decayed counts: `settings.decay`), filled on the device:
    by forecasts of the layer's experts made some layers before it (`expect`, `predicted` experts each)
    and, where `settings.demand` is on, by the layer's own routing (copied, then read). `settings.by_kernel`:
    decided by the CUDA kernel (None: where MLX runs on CUDA), else in numpy on the host."""

    def __init__(
        self,
        stacks: list[dict],
        num_experts: int,
        slots: list[int],
        rows: int,
        settings: KeptRowsSettings,
    ):
        self.stacks, self.num_experts, self.slots, self.rows = stacks, num_experts, slots, rows
        self.settings = settings
        self.predicted = rows if settings.predicted is None else settings.predicted
        self.on_device = slot_fill.available() if settings.by_kernel is None else settings.by_kernel
        self._kernels: dict[tuple, Kernel] = {}  # by (unit, units of each array's row, tables)
        self._by_layer: dict[tuple, Kernel] = {}  # (layer, tables) -> its kernel
        self._launches: dict[tuple, Callable] = {}  # compiled kernel calls, by layer and call shape
        self.held = [mx.full((rows,), -1, mx.int32) for _ in stacks]  # device: the last call's outputs
        self.age = [mx.full((rows,), AGE_EMPTY, mx.int32) for _ in stacks]
        self.score = [mx.zeros((num_experts,), mx.float32) for _ in stacks]
        self.counts = RunningCounts(len(stacks), self.on_device)
        # the decay as the kernel's input, made once: an array made from host bytes in a pass costs the GPU
        # a wait (`host_ring.py`)
        self._decay_input = mx.array([settings.decay or 0.0], mx.float32)
        mx.eval(self.held, self.age, self.score, self._decay_input)
        self._held_host = [np.full(rows, -1, np.int64) for _ in stacks]  # host path
        self._age_host = [np.full(rows, AGE_EMPTY, np.int64) for _ in stacks]
        self._score_host = [np.zeros(num_experts, np.float32) for _ in stacks]
        self._predicted: dict[int, mx.array] = {}

    def expect(self, target: int, scores: mx.array):
        """Scores (n, E) for layer `target`'s experts in this pass (lazy): its top `predicted` (for several
        tokens, by summed probability) are copied ahead of it."""
        if scores.shape[0] > 1:
            scores = mx.softmax(scores.astype(mx.float32), axis=-1).sum(axis=0)
        self._predicted[target] = scores.reshape(-1)  # the kernel ranks them: no sort of its own

    def fuses(self) -> bool:
        """Whether a decode pass's layer call and the products after it can be one compiled call
        (`fused_lanes`): on the device, with `demand` on."""
        return self.on_device and self.settings.demand

    def fused_lanes(self, layer: int, base: mx.array) -> Lanes:
        """A decode pass of `layer`'s lanes as part of one compiled call (`layer_step.Lanes`): the layer's
        own kernel call on its routed experts, copying its misses, each lane reading the row it gives; the
        other output, "rows": the rows' state after (`keep` it), with its running counts of copies and hits.
        What forecasts predicted for the layer is copied first, by a call of its own."""
        self._copy_predicted(layer, base)
        key = ("rows", layer, *self._settings())
        arrays = tuple(self.stacks[layer].values())
        return Lanes(key, self._demand_lanes(layer), (base, *self._rows_state(layer), *arrays))

    def lanes(self, layer: int, base: mx.array, copy: bool = True, staged: bool = False) -> Lanes:
        """A pass of `layer`'s lanes op by op (several positions, or rows the host decides): the table
        (`base`, the slots', with the experts in its rows after what forecasts predicted and, with `demand`,
        the routed ones are copied), each lane's row and, where no call of the layer's own counted them, its
        hits ("hit": its expert in a slot or row before; what the layer copied for itself crossed PCIe when
        needed, a miss). `copy` False (a prompt's pass): the rows as they are, nothing copied. `staged`: the
        pass computes on a device copy of its experts from that table (`staged_passes.union`)."""
        read = functools.partial(self._read, layer, base, copy, staged)
        return Lanes(("rows op by op", layer), read, tuple(self.stacks[layer].values()), traced=False)

    def _read(self, layer: int, base: mx.array, copy: bool, staged: bool, indices: mx.array, *arrays):
        table = self._copy_predicted(layer, base, copy)
        if copy and self.settings.demand:  # the kernel writes the lanes' rows and counts their hits itself
            cand = padded(indices.reshape(-1), self.num_experts)
            _, table, read, _ = self._call(layer, cand, base, ahead=False)
            read, outputs = read[: indices.size].reshape(indices.shape), {}
        else:
            table = self.current(layer, base) if table is None else table
            read = table[indices]
            outputs = {"hit": read >= self.num_experts}
        if staged:
            copies, places, counted = staged_passes.union(indices, table, *arrays)
            return copies, places, {**outputs, **counted}
        return arrays, read, outputs

    def _copy_predicted(self, layer: int, base: mx.array, copy: bool = True) -> mx.array | None:
        """Copy what was predicted for `layer` (`expect`), before its own call, so that it is there when the
        layer runs: the layer's table after, or None (no prediction, or `copy` off). Drops the prediction."""
        scores = self._predicted.pop(layer, None)
        return self._call(layer, scores, base, ahead=True)[1] if copy and scores is not None else None

    def keep(self, layer: int, state: tuple):
        """The rows' state a fused pass gave (`fused_lanes`'s "rows"): the next call of the layer takes it."""
        self.held[layer], self.age[layer], self.score[layer], counted = state
        self.counts.set(layer, counted)

    def _demand_lanes(self, layer: int):
        """The lanes of `fused_lanes`: the layer's kernel on its routed experts (as they are, the kernel
        compiled for their padded count), each lane reading the row it gives; the kernel writes no tables
        (`launch_settings`): a pass of one position never reads them."""
        by_counts = self.settings.decay is not None

        def lanes(indices, base, held, age, score, decay, counted, *arrays):
            n = indices.size
            launch = self._kernel_call(layer, padded_size(n), ahead=False, tables=False, lanes=n)
            cand = indices.reshape(-1)
            held, age, counted, scores, read = launch(*arrays, cand, base, held, age, score, decay, counted)
            score = scores if by_counts else score  # by recency the scores stay as they were
            return arrays, read[:n].reshape(indices.shape), {"rows": (held, age, score, counted)}

        return lanes

    def current(self, layer: int, base: mx.array) -> mx.array:
        """`base` with the experts the layer's rows hold now pointing at them (a lazy scatter: no copy, no
        wait), for passes that call no kernel."""
        held = self.held[layer] if self.on_device else mx.array(self._held_host[layer].astype(np.int32))
        E, first = self.num_experts, self.num_experts + self.slots[layer]
        table = mx.concatenate([base, mx.zeros((1,), base.dtype)])  # empty rows write past the end
        at = mx.where(held >= 0, held, E)
        table[at] = mx.where(table[at] < E, mx.arange(first, first + self.rows).astype(base.dtype), table[at])
        return table[:E]

    def compile(self, lanes: int):
        """Build the kernel of each layer for every size a demand call of up to `lanes` routed lanes takes
        (`demand_sizes`), evaluated on candidates that copy nothing, its outputs dropped: on CUDA each new
        size compiles the kernel, which would otherwise stall a pass mid-generation (seconds, when a batch
        first grows)."""
        if not self.on_device:
            return
        for layer in {self._kernel(layer): layer for layer in range(len(self.stacks))}.values():
            base = mx.arange(self.num_experts, dtype=mx.uint32)
            for size in demand_sizes(lanes):
                mx.eval(self._launch(layer, mx.full((size,), self.num_experts, mx.uint32), base, ahead=False))

    def _call(self, layer: int, cand: mx.array, base: mx.array, ahead: bool) -> tuple[mx.array, ...]:
        """One kernel (or `plan` on the host): the layer's tables (before, after) its copies of `cand`, and
        per candidate (of a demand call) its row after and whether it was held before."""
        if not self.on_device:
            return self._on_host(layer, cand, base, ahead)
        rows, found, held, age, counted, score, lane_rows, lane_hit = self._launch(layer, cand, base, ahead)
        self.held[layer], self.age[layer], self.score[layer] = held, age, score
        self.counts.set(layer, counted)
        return found, rows, lane_rows, lane_hit

    def _launch(self, layer: int, cand: mx.array, base: mx.array, ahead: bool) -> list[mx.array]:
        """The layer's kernel on `cand`, through a compiled function made once per layer and call shape:
        MLX builds a custom kernel's call (its whole source) at every call, a compiled function replays it."""
        count = self.predicted if ahead else cand.size
        key = (layer, count, ahead, *self._settings())
        if key not in self._launches:
            self._launches[key] = mx.compile(self._kernel_call(layer, count, ahead))
        return self._launches[key](*self.stacks[layer].values(), cand, base, *self._rows_state(layer))

    def _rows_state(self, layer: int) -> tuple[mx.array, ...]:
        """The kernel's inputs after the candidates and the table, in its order: the rows held, their ages,
        the scores, the decay and the running counts."""
        counted = self.counts.of(layer)
        return self.held[layer], self.age[layer], self.score[layer], self._decay_input, counted

    def _settings(self) -> tuple:
        settings = self.settings
        return settings.copy, settings.decay is not None, settings.blocks, settings.demand_blocks

    def _kernel_call(
        self, layer: int, count: int, ahead: bool, tables: bool = True, lanes: int | None = None
    ):
        kernel = self._kernel(layer, tables)
        settings = self.launch_settings(layer, count, ahead, tables, lanes)
        return lambda *inputs: kernel(inputs=list(inputs), **settings)

    def launch_settings(
        self, layer: int, count: int, ahead: bool, tables: bool = True, lanes: int | None = None
    ) -> dict:
        """The layer's kernel call for `count` candidates (`mx.fast.cuda_kernel`'s keywords but its inputs):
        its template constants, grid (in threads), block and outputs. `lanes`: how many of them the call is
        given (the rest are none; default all `count`). `tables` False (a fused pass, `fused_lanes`, which
        reads only its lanes' rows): the fused kernel (`FUSED_OUTPUTS`: no expert->row tables or lane hits),
        whose scores are one element long where they do not change."""
        units = max(row_units(self.stacks[layer].values())[1])
        settings = self.settings
        blocks = settings.blocks if ahead else max(1, settings.demand_blocks // count)
        threads = min(units, THREADS * blocks)
        E, S = self.num_experts, self.rows
        counts = int(settings.decay is not None and not ahead)
        scores = (E,) if tables or counts else (1,)
        shapes = dict(rows=(E,), found=(E,), held_out=(S,), age_out=(S,), counted_out=(2,), score_out=scores)
        shapes.update(lane_rows=(count,), lane_hit=(count,))
        outputs = KEPT_ROWS_OUTPUTS if tables else FUSED_OUTPUTS
        return dict(
            template=[
                ("E", E),
                ("C", self.slots[layer]),
                ("S", S),
                ("P", count),
                ("N", count if lanes is None else lanes),
                ("SCORES", int(ahead)),
                ("DEMAND", int(not ahead)),
                ("COPY", int(settings.copy)),
                ("COUNTS", counts),
                ("TABLES", int(tables)),
            ],
            grid=(threads, count, len(self.stacks[layer])),
            threadgroup=(min(THREADS, threads), 1, 1),
            output_shapes=[shapes[name] for name in outputs],
            output_dtypes=[KEPT_ROWS_OUTPUTS[name] for name in outputs],
        )

    def end_pass(self):
        """Drop predictions no layer asked for; keep the counts as of this pass (`read(lagged=True)`)."""
        self._predicted = {}
        self.counts.end_pass()

    def read(self, lagged: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(copies, hit lanes of the layers' own calls) per layer since the last read (`RunningCounts`)."""
        return self.counts.read(lagged)

    def book(self, ledger, lagged: bool = False):
        """Into `ledger` (`stats.Ledger`): what `read` gives, as decode's (only a decode pass copies)."""
        copied, hits = self.read(lagged)
        for layer in np.flatnonzero(copied):
            ledger.add("decode", int(layer), installed=int(copied[layer]), evictions=0, install_s=0.0)
        for layer in np.flatnonzero(hits):
            ledger.count_lookups("decode", int(layer), 0, int(hits[layer]))

    def _kernel(self, layer: int, tables: bool = True):
        """The layer's kernel (with tables, else a fused pass's), made once per layer; layers whose rows are
        alike share one kernel."""
        if (layer, tables) not in self._by_layer:
            unit, units = row_units(self.stacks[layer].values())
            key = (unit, units, tables)
            if key not in self._kernels:
                kind = "lookahead" if tables else "fused"
                self._kernels[key] = cuda_kernel(
                    name=f"od_moe_{kind}_{len(self._kernels)}",
                    input_names=[*(f"a{i}" for i in range(len(units))), *KEPT_ROWS_INPUTS],
                    output_names=list(KEPT_ROWS_OUTPUTS if tables else FUSED_OUTPUTS),
                    source=kept_rows_source(unit, units, AGE_EMPTY, tables),
                )
            self._by_layer[layer, tables] = self._kernels[key]
        return self._by_layer[layer, tables]

    def _on_host(self, layer: int, cand: mx.array, base: mx.array, ahead: bool) -> tuple[mx.array, ...]:
        """`_call` where the stacks are host memory: wait for the candidates (which wait for every earlier
        pass, so nothing still reads the rows), decide with `plan` and copy through numpy views."""
        values = np.array(cand.astype(mx.float32))
        want = top(values, self.predicted) if ahead else [int(e) for e in values]
        E, C = self.num_experts, self.slots[layer]
        held, age, score = self._held_host[layer], self._age_host[layer], self._score_host[layer]
        found = _overlay(np.array(base), held, E, C)
        rows, held, age, copies, score = plan(
            want, np.array(base), held, age, E, C, not ahead, score, self.settings.decay
        )
        for array in self.stacks[layer].values():
            view = host_view(array)
            for expert, row in copies:
                view[row] = view[expert]
        self._held_host[layer], self._age_host[layer], self._score_host[layer] = held, age, score
        ids = values.astype(np.int64)  # as the kernel's lanes: an id past the experts reads row E
        valid = (ids >= 0) & (ids < E)
        at = np.where(valid, ids, 0)
        lane_rows, lane_hit = np.where(valid, rows[at], E), valid & (found[at] >= E)
        self.counts.add(layer, len(copies), 0 if ahead else int(lane_hit.sum()))
        tables = (found, rows, lane_rows)
        return (*(mx.array(t.astype(np.uint32)) for t in tables), mx.array(lane_hit))


def wrong_rows(kept: KeptRows) -> int:
    """Device-kept rows whose bytes differ from the expert they are said to hold (want 0): a check for the
    benches, which waits for every pass."""
    wrong = 0
    for layer, stack in enumerate(kept.stacks):
        held = np.array(kept.held[layer]) if kept.on_device else kept._held_host[layer]
        first = kept.num_experts + kept.slots[layer]
        for array in stack.values():
            view = host_view(array)
            wrong += sum(
                int(not np.array_equal(view[first + s], view[e])) for s, e in enumerate(held) if e >= 0
            )
    return wrong
