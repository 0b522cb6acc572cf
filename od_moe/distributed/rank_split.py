"""A model's decoder layers split over the ranks of an `mx.distributed` group: a pipeline.

Started under `mlx.launch` (a group of more than one process), `od_moe.load` gives each rank a contiguous
run of the decoder layers, in mlx-lm's order (`mlx_lm/models/pipeline.py`): rank 0 runs the last layers,
the highest rank the first, hidden states flow from the highest rank down to rank 0 and are then gathered
to every rank, so each computes the same logits and samples the same token (rank 0 prints and streams).
It works on any family's `layers` list, not only on those mlx-lm gives a `pipeline` method:
- another rank's layer is replaced by a `PassThrough` that holds no weight, hands the hidden state on in
  the structure the layer returns, and advances the layer's attention cache by one dummy key per position,
  so masks and offsets the model makes from that cache are the real ones;
- the rank's first and last layers are wrapped in a `Seam` that receives the hidden state from the rank
  before and sends it to the rank after (`mx.distributed.recv_like` / `send`); the model's last layer
  gathers it to every rank.
The split balances MoE layers, where the experts (so the memory and the reads) are: a dense layer goes with
the MoE layer after it. Each rank then loads, caches and reads only its own layers' experts, exactly as one
process does (`engine.load` finds only the blocks left in the model). A pipeline does no arithmetic
differently: the tokens are single-process mlx-lm's.
Not here: the expert cache, reads or prefetch (each rank's engine runs them over its own layers).
"""

import hashlib
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from ..errors import RankLost, UserError
from ..memory import backend
from ..model_surgery.mlx_lm_private import BaseCache
from ..model_surgery.moe_blocks import decoder_layer_of
from ..model_surgery.routing import router_matrices
from ..units import format_bytes
from . import heartbeat


def group_for(ranks) -> mx.distributed.Group | None:
    """The group `load(ranks=...)` splits over: "auto" is the launcher's (`mlx.launch` sets MLX_RANK; MPI
    its own variables), None or 1 none; a `Group` itself. None where there is one process."""
    if ranks in (None, 1):
        return None
    if ranks == "auto":
        launched = any(k in os.environ for k in ("MLX_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"))
        group = mx.distributed.init() if launched else None
    elif isinstance(ranks, mx.distributed.Group):
        group = ranks
    else:
        raise UserError(f"ranks must be 'auto', None or an mx.distributed.Group, got {ranks!r}")
    return group if group is not None and group.size() > 1 else None


def layers_of(model: nn.Module, block_paths: list[str]) -> tuple[str, list[int]]:
    """(the module path that holds the decoder `layers` list, the indices of the layers with an MoE block)."""
    prefixes, moe = set(), set()
    for p in block_paths:
        found = decoder_layer_of(p)
        if found is None:
            raise UserError(
                f"the MoE block {p} is not inside a `layers` list: od-moe cannot split this model"
            )
        prefixes.add(found[0])
        moe.add(found[1])
    if len(prefixes) != 1:
        raise UserError(
            f"MoE blocks sit in several layer lists ({sorted(prefixes)}): cannot split this model"
        )
    return prefixes.pop(), sorted(moe)


def _layer_number(block_path: str) -> int:
    """The decoder layer of the MoE block at `block_path`, one `layers_of` found inside a `layers` list."""
    found = decoder_layer_of(block_path)
    assert found is not None  # `layers_of` refused the model otherwise
    return found[1]


def stage_ranges(moe_layers: list[int], num_layers: int, size: int) -> list[tuple[int, int]]:
    """Per rank, the decoder layers [start, end) it runs: MoE layers shared as evenly as they go (low ranks
    take one more, as in mlx-lm), rank 0 the last layers, each dense layer with the MoE layer after it."""
    if len(moe_layers) < size:
        raise UserError(
            f"the model has {len(moe_layers)} MoE layers: it cannot be split over {size} ranks (at most "
            f"{len(moe_layers)})"
        )
    base, extra = divmod(len(moe_layers), size)
    counts = [base + (1 if r < extra else 0) for r in range(size)]
    starts, first = [], 0  # stage s (first layers first) is rank size - 1 - s
    for stage in range(size):
        starts.append(0 if stage == 0 else moe_layers[first])
        first += counts[size - 1 - stage]
    ends = starts[1:] + [num_layers]
    return [(starts[size - 1 - r], ends[size - 1 - r]) for r in range(size)]


def _flags(layer) -> dict:
    """A layer's plain attributes (`is_linear`, `block_type`, `layer_type`...) that models read in their loop
    or when making caches."""
    return {
        k: v
        for k, v in vars(layer).items()
        if not k.startswith("_") and isinstance(v, (bool, int, float, str))
    }


def _caches(args, kwargs) -> list:
    return [a for a in (*args, *kwargs.values()) if isinstance(a, BaseCache)]


def _advance(cache, x: mx.array):
    """Grow an attention cache by one dummy key per position of `x` (tied to `x`, so evaluating the cache
    evaluates what `x` depends on: a send before it)."""
    if isinstance(cache, ArraysCache) or not hasattr(cache, "update_and_fetch"):
        return
    dummy = mx.depends(mx.zeros((x.shape[0], 1, x.shape[1], 1), dtype=x.dtype), x)
    cache.update_and_fetch(dummy, dummy)


def _tie(cache, h: mx.array):
    """Make evaluating `cache` evaluate `h` (a send): a prefill evaluates the caches, not the logits."""
    if isinstance(cache, ArraysCache) and cache[0] is not None:
        cache[0] = mx.depends(cache[0], h)
    elif getattr(cache, "keys", None) is not None:
        cache.keys = mx.depends(cache.keys, h)


def _gather(h: mx.array, group) -> mx.array:
    """Rank 0's hidden state (the model's last layer ran there) on every rank, kept in the graph."""
    return mx.distributed.all_gather(h, group=group)[: h.shape[0]]


class PassThrough(nn.Module):
    """Another rank's decoder layer: hands the hidden state on unchanged, in the structure the layer
    returns (`outputs` items, the hidden state first; 0: the bare array), and advances its attention cache.
    The model's last layer also gathers rank 0's hidden state (`gather`: the group). Holds no weight."""

    def __init__(self, layer: nn.Module, outputs: int, gather=None):
        super().__init__()
        for k, v in _flags(layer).items():
            setattr(self, k, v)
        self._outputs, self._gather = outputs, gather

    def __call__(self, x, *args, **kwargs):
        for c in _caches(args, kwargs):
            _advance(c, x)
        if self._gather is not None:
            x = _gather(x, self._gather)
        return x if self._outputs == 0 else (x,) + (None,) * (self._outputs - 1)


class Seam(nn.Module):
    """One of this rank's layers at an edge of its stage: it receives the hidden state from the rank before
    (`receive`), sends its output to the rank after (`send`), and, the model's last layer, gathers rank 0's
    output to every rank (`gather`). Wrapped after the rank's experts are located: parameter paths below it
    gain a `layer.` that nothing reads any more. `watch_with` a callback: it is called once the hidden state
    has been received (it is evaluated there: one more sync, to measure `seams.py`)."""

    def __init__(self, layer: nn.Module, group, receive: bool, send: bool, gather: bool):
        super().__init__()
        for k, v in _flags(layer).items():
            setattr(self, k, v)
        self.layer = layer
        self._group, self._rank = group, group.rank()
        self._receive, self._send, self._gather = receive, send, gather
        self._watch: Callable[[], None] | None = None

    def watch_with(self, callback: Callable[[], None] | None):
        """Call `callback` once the hidden state has been received (None: nothing, no sync)."""
        self._watch = callback

    def __call__(self, x, *args, **kwargs):
        if self._receive:
            x = mx.distributed.recv_like(x, self._rank + 1, group=self._group)
            if self._watch is not None:
                mx.eval(x)
                self._watch()
        out = self.layer(x, *args, **kwargs)
        h = out[0] if isinstance(out, tuple) else out
        if self._send:
            h = mx.distributed.send(h, self._rank - 1, group=self._group)
            for c in _caches(args, kwargs):
                _tie(c, h)
        if self._gather:
            h = _gather(h, self._group)
        return (h, *out[1:]) if isinstance(out, tuple) else h


class Handover(nn.Module):
    """A stage's first layer on every rank, where point-to-point sends do not run: the hidden state entering
    it is the one rank `sender` (the stage before) computed, taken from an `all_gather` every rank joins
    (each rank's own input there is a stand-in, or the sender's real one). Costs the group's size times the
    state's bytes per pass instead of one copy; the arithmetic is the same."""

    def __init__(self, layer: nn.Module, group, sender: int):
        super().__init__()
        for k, v in _flags(layer).items():
            setattr(self, k, v)
        self.layer = layer
        self._group, self._sender = group, sender

    def __call__(self, x, *args, **kwargs):
        n = x.shape[0]
        x = mx.distributed.all_gather(x, group=self._group)[self._sender * n : (self._sender + 1) * n]
        return self.layer(x, *args, **kwargs)


class _Probe:
    """Stands where a layer is for one lazy forward pass and records how many outputs it returns."""

    def __init__(self, layer, seen: list):
        self._layer, self._seen = layer, seen

    def __getattr__(self, name):
        return getattr(self._layer, name)

    def __call__(self, *args, **kwargs):
        out = self._layer(*args, **kwargs)
        self._seen.append(len(out) if isinstance(out, tuple) else 0)
        return out


def _outputs_of(model: nn.Module, layers: list) -> int:
    """How many outputs the decoder layers return (0: the hidden state alone), from one lazy forward pass
    (a graph is built, nothing is computed or read)."""
    seen: list[int] = []
    originals = list(layers)
    layers[:] = [_Probe(layer, seen) for layer in originals]
    try:
        model(mx.array([[0]]))
    finally:
        layers[:] = originals
    if len(set(seen)) != 1:
        raise UserError("the model's decoder layers return different structures: od-moe cannot split it")
    return seen[0]


@dataclass
class Stage:
    """This rank's part of a pipeline: its decoder layers [start, end) and every rank's (`ranges`)."""

    group: mx.distributed.Group
    start: int
    end: int
    ranges: list
    layers_path: str
    supervisor: heartbeat.Supervisor  # the ranks' heartbeat: pipeline work runs inside its `busy`
    next_router: tuple | None = None  # the next rank's first MoE router (weights, biases): `seams.py`
    moe_offset: int = 0  # the model's MoE layers before this rank's first (a predictor's layer numbers)

    @property
    def rank(self) -> int:
        return self.group.rank()

    @property
    def size(self) -> int:
        return self.group.size()

    def share_tokens(self, tokens: list[int]) -> list[int]:
        """Rank 0's prompt on every rank (the others follow it)."""
        n = self._sum([len(tokens) if self.rank == 0 else 0])[0]
        return self._sum(tokens if self.rank == 0 else [0] * n)

    def share_seed(self, seed: int | None) -> int | None:
        """The sampling seed every rank uses: the one given (the same command on every rank), else one rank
        0 draws."""
        if seed is not None:
            return seed
        return self._sum([random.getrandbits(31) if self.rank == 0 else 0])[0]

    def gather_numbers(self, values: list[float]) -> list[list[float]]:
        """Every rank's `values` (the same count on each), rank by rank."""
        mine = mx.array(values, dtype=mx.float32)
        with self.supervisor.busy():
            gathered = mx.distributed.all_gather(mine, group=self.group).reshape(self.size, -1)
            return gathered.tolist()  # type: ignore[return-value]  # mlx types tolist() for any shape

    def _sum(self, values: list[int]) -> list[int]:
        summed = mx.distributed.all_sum(mx.array(values, dtype=mx.int32), group=self.group)
        return summed.tolist()  # type: ignore[return-value]  # mlx types tolist() for any shape


def rank_lines(engine) -> list[str]:
    """One line per rank: its layers, decode hit rate and bytes read (gathered: every rank must call it)."""
    stats, stage = engine.stats(), engine.stage
    total = stats["total"]
    mine = [stage.start, stage.end, total["hits"], total["lookups"], total["bytes_read"]]
    rows = stage.gather_numbers([float(v) for v in mine])
    return [
        f"rank {r}: layers {int(a)}-{int(b) - 1}, hit rate {hits / max(lookups, 1):.3f}, "
        f"{format_bytes(int(read))} read"
        for r, (a, b, hits, lookups, read) in enumerate(rows)
    ]


def join(ranks, settings: dict, predictor=None) -> mx.distributed.Group | None:
    """The group `load` splits over (`group_for`), once every rank is known to have been started with the
    same `settings` (`check_same`: before any other collective, so a rank started otherwise stops the rest
    instead of hanging them) and the ranks' heartbeat runs (`heartbeat.supervise`); None on one process."""
    group = group_for(ranks)
    if group is not None:
        try:
            check_same(group, dict(settings, ranks=group.size(), predictor=str(predictor)))
        except RuntimeError as e:  # the backend's error: a rank ended before the others had started
            raise RankLost(f"a rank ended while the ranks were starting ({e}): start every rank again")
        heartbeat.supervise(group)
    return group


def check_same(group, what: dict):
    """Refuse to start where another rank was started with another model, budget or settings: every rank
    compares a digest of `what` with rank 0's (one all_gather) and raises the same one-line UserError."""
    digest = hashlib.sha256(repr(sorted(what.items())).encode()).digest()[:16]
    gathered = mx.distributed.all_gather(mx.array(list(digest), dtype=mx.int32), group=group)
    # a 2-D int32 array: a list of lists of ints (mlx types tolist() for any shape)
    every = cast(list[list[int]], gathered.reshape(group.size(), -1).tolist())
    others = [r for r, d in enumerate(every) if d != every[0]]
    if others:
        raise UserError(
            f"rank {others[0]} was started with another model, budget or settings than rank 0 (this is "
            f"rank {group.rank()}: {', '.join(f'{k}={v}' for k, v in sorted(what.items()))}): start every "
            "rank with the same command"
        )


def split(model: nn.Module, group, blocks: list) -> Stage:
    """Replace the decoder layers other ranks run by `PassThrough`s (their weights dropped with them) and
    return this rank's `Stage`; `wrap_seams` finishes the split once the rank's experts are located."""
    block_paths = [b.path for b in blocks]  # `surgery.MoEBlock`s
    path, moe_layers = layers_of(model, block_paths)
    owner = dict(model.named_modules())[path] if path else model
    layers = owner.layers
    outputs = _outputs_of(model, layers)
    ranges = stage_ranges(moe_layers, len(layers), group.size())
    start, end = ranges[group.rank()]
    last = len(layers) - 1
    after = [b.block for b in blocks if _layer_number(b.path) == end]  # the next rank's
    next_router = _router(after[0]) if after and group.rank() > 0 else None
    for i, layer in enumerate(layers):
        if not start <= i < end:
            layers[i] = PassThrough(layer, outputs, gather=group if i == last else None)
    offset = sum(1 for m in moe_layers if m < start)
    return Stage(group, start, end, ranges, path, heartbeat.supervise(group), next_router, offset)


def _router(block: nn.Module) -> tuple | None:
    """A block's router as dense float32 (weights (1, E, H), biases (1, E)), or None where it has no
    linear router (then no prediction crosses the seam)."""
    try:
        return router_matrices([block])
    except UserError:
        return None


def wrap_seams(model: nn.Module, stage: Stage):
    """Wrap this rank's first and last layers to receive, send and gather the hidden state. Where sends do
    not run on the device (`backend.sends_between_ranks`), every rank instead hands the state over at each
    stage's first layer with a collective (`Handover`)."""
    owner = dict(model.named_modules())[stage.layers_path] if stage.layers_path else model
    layers, last, rank = owner.layers, len(owner.layers) - 1, stage.rank
    sends = backend.sends_between_ranks()
    edges = {stage.start, stage.end - 1}
    for i in sorted(edges):
        receive = i == stage.start and stage.start > 0 and sends
        send = i == stage.end - 1 and rank > 0 and sends
        layers[i] = Seam(layers[i], stage.group, receive, send, gather=i == last)
    if not sends:
        for sender, (start, _) in enumerate(stage.ranges):
            if start > 0:  # rank `sender - 1` starts there, from rank `sender`'s output
                layers[start] = Handover(layers[start], stage.group, sender + 1)
