"""Decode passes past the host's memory: one host sync a token where every routed expert was in memory, and
an exact second run where one was on disk.

Where some experts are on disk (`host_tier.py`), a layer cannot compute a lane whose expert is not in a
device slot or a host row, and learning its routing before it computes costs a host sync per layer, which
a GPU pays in full (docs/GPU.md, "The per-layer path on CUDA"). `DiskPasses` runs a decode pass as mlx-lm
calls the model, through the runtime's methods (`TwoTierRuntime`, "past the host's memory"):
1. `begin_flagged_pass`: no layer waits (but the first `exact_layers` MoE layers, which learn their routing
   and read first); a lane whose expert is on disk reads a wrong row (a finite, wrong result) and is counted
   on the device.
2. `first_missing_layer`: the counts are read once, with the logits (the sync mlx-lm makes for the token
   anyway). None: the pass stands.
3. Else (`Missed`) the experts its first missing layer routed to are read (its inputs were right, so its
   routing is known), and with `disk_prefetch` "routed" those it routed to past that layer (a forecast:
   their inputs were wrong), all at once on the reader threads; with `flag_stop` off the pass ran on to its
   end and started each layer's reads as its count was read (`TwoTierRuntime._watch_flags`). Its KV caches
   are trimmed from the first missing layer's decoder layer on and it runs again (`resume`): the decoder
   layers before that one give the outputs they gave (recorded: the same inputs, so the same routing and
   rows), or, where the model's caches or layers are not mlx-lm's plain ones (a mask or offset made from a
   cache the skipped layers would leave one position on), every cache is trimmed and those layers compute
   again; from that layer on, with `disk_rerun` "flagged", flagged again once the reads landed (a layer
   whose routing changed may miss again: it runs again from there, the `FLAGGED_RUNS`th time exactly), or
   with "exact" each layer learning its routing (a host sync) and reading what is on disk before it
   computes, finding the reads ahead landed or in flight.
A pass of several positions (a prompt), or one whose caches cannot be trimmed, runs exactly from its first
layer. The tokens are stock mlx-lm's in every case: no lane computes on a wrong row in a pass that stands.
Not here: the tiers and the reads (`host_tier.py`), the layer passes (`two_tier_runtime.py`).
"""

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache, QuantizedKVCache

from ..model_surgery.moe_blocks import decoder_layer_of
from .settings import FLAGGED_RUNS


class StoppedAt(Exception):
    """A flagged pass stopped at its first layer with an absent lane (`TwoTierRuntime._watch_flags`)."""

    def __init__(self, layer: int):
        super().__init__(f"a flagged pass met an expert on disk at MoE layer {layer}")
        self.layer = layer


@dataclass(frozen=True)
class Missed:
    """A flagged pass that met an expert on disk: the first layer that did, and the experts the pass routed
    to by layer from there on (flat ids; exact at `first`)."""

    first: int
    routed: dict[int, np.ndarray]


class DiskPasses:
    """The model as mlx-lm's generation loop calls it (`model(inputs, cache=...)`), its decode passes flagged
    and run again where they met an expert on disk; every other attribute is the model's. `block_paths`: the
    module path of each MoE layer's switch, in order (where its decoder layer is)."""

    def __init__(
        self, model, runtime, block_paths: list[str], prefetch: str = "routed", rerun: str = "flagged"
    ):
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "runtime", runtime)
        object.__setattr__(self, "prefetch", prefetch)
        object.__setattr__(self, "rerun", rerun)
        # the decoder layers a run again may skip, and each MoE layer's index among them (None: none skipped)
        layers, decoder_of = _decoder_layers(model, block_paths)
        object.__setattr__(self, "skippable_layers", layers)  # not `layers`: that name is the model's
        object.__setattr__(self, "decoder_of", decoder_of)

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, inputs: mx.array, cache=None, **kwargs) -> mx.array:
        runtime, tokens = self.runtime, inputs.shape[-1]
        if cache is None or tokens != 1 or not all(hasattr(c, "trim") and c.is_trimmable() for c in cache):
            return self.model(inputs, cache=cache, **kwargs)  # every layer exact
        offsets = [getattr(c, "offset", None) for c in cache]
        # a run may stop early where each cache says how far it was written (a batch's caches do not)
        runtime.begin_flagged_pass(stop_early=all(isinstance(o, int) for o in offsets))
        layers = self._skippable(cache)
        outputs: dict[int, object] = {}  # decoder layer -> its output in this pass, as last run
        try:
            missed, runs = self._run(inputs, cache, kwargs, layers, outputs, 0), 1
            while not isinstance(missed, mx.array):
                exact = self.rerun == "exact" or runs >= FLAGGED_RUNS
                self._read_ahead(missed)
                if not exact:  # the run's tables hold what landed before it
                    runtime.wait_for_reads()
                start = self.decoder_of[missed.first] if layers is not None else 0
                _trim(cache, offsets, tokens, start)
                runtime.resume(missed.first, exact, skipped=start > 0)
                missed, runs = self._run(inputs, cache, kwargs, layers, outputs, start), runs + 1
        except BaseException:
            runtime.cancel_flagged_pass()
            raise
        return missed

    def _skippable(self, cache) -> list | None:
        """The model's decoder layers where a pass run again may skip those before its first miss (mlx-lm's
        own, `_decoder_layers`) and each has a plain KV cache, whose mask for one position is made from no
        offset; else None (every cache trimmed, every layer run again)."""
        layers = self.skippable_layers
        if layers is None or len(layers) != len(cache):
            return None
        return layers if all(type(c) in (KVCache, QuantizedKVCache) for c in cache) else None

    def _run(self, inputs: mx.array, cache, kwargs, layers, outputs: dict, start: int) -> "mx.array | Missed":
        """A flagged run of the model from decoder layer `start` (those before it give their `outputs`): its
        logits where it stands, else what it missed (where it stopped early, or where its flags said so
        with the logits)."""
        try:
            if layers is None:
                logits = self.model(inputs, cache=cache, **kwargs)
            else:
                with _recorded(layers, outputs, start):
                    logits = self.model(inputs, cache=cache, **kwargs)
        except StoppedAt as stopped:
            return self.runtime.stopped_pass(stopped.layer)
        missed = self.runtime.first_missing_layer(logits)
        return logits if missed is None else missed

    def _read_ahead(self, missed: "Missed"):
        """Start the reads the next run will want: the first missing layer's experts (its routing, known),
        then (`routed`) those the run routed to past it (a forecast: their inputs were wrong)."""
        first, *later = sorted(missed.routed)
        self.runtime.fetch_ahead(first, missed.routed[first], ahead=False)
        if self.prefetch == "routed":
            for layer in later:
                self.runtime.fetch_ahead(layer, missed.routed[layer])


class _Recorded:
    """A decoder layer in a flagged run: computed, its output kept (`outputs[index]`). Its own names are
    underscored: any other attribute is the layer's (a model's loop may read one)."""

    def __init__(self, layer, outputs: dict, index: int):
        self._layer, self._outputs, self._index = layer, outputs, index

    def __getattr__(self, name):
        return getattr(self._layer, name)

    def __call__(self, *args, **kwargs):
        out = self._layer(*args, **kwargs)
        self._outputs[self._index] = out
        return out


class _Skipped:
    """A decoder layer before a run's first miss, in the run again: the output it gave, its cache as is."""

    def __init__(self, layer, output):
        self._layer, self._output = layer, output

    def __getattr__(self, name):
        return getattr(self._layer, name)

    def __call__(self, *args, **kwargs):
        return self._output


def _decoder_layers(model, block_paths: list[str]) -> tuple[list | None, list[int]]:
    """(The list that holds the model's decoder layers, per MoE layer its index there), found from the MoE
    blocks' paths (`decoder_layer_of`); the list None where a pass run again cannot skip layers: blocks in
    no one `layers` list, or a layer that is not mlx-lm's own (a pipeline's stand-in)."""
    found = [decoder_layer_of(path) for path in block_paths]
    places = [f for f in found if f is not None]
    if len(places) != len(found) or len({prefix for prefix, _ in places}) != 1:
        return None, []
    prefix = places[0][0]
    owner = dict(model.named_modules())[prefix] if prefix else model
    layers = getattr(owner, "layers", None)
    if not isinstance(layers, list) or not all(type(x).__module__.startswith("mlx_lm.") for x in layers):
        return None, []
    return layers, [index for _, index in places]


@contextmanager
def _recorded(layers: list, outputs: dict, start: int) -> Iterator[None]:
    """For one run of the model, its decoder `layers` before `start` give their recorded `outputs`, those
    from `start` on are computed and recorded; the model's own layers are back afterwards."""
    own = list(layers)
    layers[:] = [
        _Skipped(layer, outputs[i]) if i < start else _Recorded(layer, outputs, i)
        for i, layer in enumerate(own)
    ]
    try:
        yield
    finally:
        layers[:] = own


def _trim(cache, offsets: list, tokens: int, start: int = 0):
    """Take back what a run wrote into the KV caches from decoder layer `start` on: back to `offsets` (a run
    that stopped early wrote only the layers it reached), or `tokens` from each where a cache's offset is
    not a count (a batch's runs do not stop early)."""
    for c, offset in list(zip(cache, offsets))[start:]:
        written = c.offset - offset if isinstance(offset, int) else tokens
        if written:
            c.trim(written)
