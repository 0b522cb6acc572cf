"""Record routing traces: run the model over documents and store, for every token and MoE layer, what a
shadow predictor reads and what it must predict.

Per token and MoE layer a trace holds the hidden state entering the MoE block (`features`, float16), the
router's logits (`logits`, float16), the routed top-k expert ids (`ids`, sorted) and their router
probabilities (`probs`: the softmax over all experts at those ids). Per token it holds the token id and
the sequence it belongs to. Traces stream to safetensors shards of `shard_tokens` tokens with a JSON
manifest, so memory stays bounded whatever the dataset size. The model runs through od-moe's engine (any
capacity: recording works for models larger than memory), and the forward stops at the last MoE block's
input: the final experts, norm and LM head are never computed. Not here: training or evaluation.
"""

import json
from collections.abc import Iterator
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import make_prompt_cache
from safetensors.numpy import load_file, save_file

from ..errors import UserError
from ..model_surgery.routing import tap_router
from ..per_layer.offloaded_switch import OffloadedSwitch
from ..progress import Progress
from .data import Documents

TRACE_FORMAT = "od-moe-traces/1"


class _StopForward(Exception):
    pass


class _SwitchTap(nn.Module):
    """Stands in for a block's switch while recording: keeps (input, expert ids), then runs the switch
    or, at the last MoE layer, stops the forward."""

    def __init__(self, inner, sink: dict, index: int, stop: bool):
        super().__init__()
        self.inner = inner
        object.__setattr__(self, "_sink", sink)  # a plain attribute, not a child module
        self._index, self._stop = index, stop

    def __call__(self, x, indices):
        self._sink[("x", self._index)] = x
        self._sink[("ids", self._index)] = indices
        if self._stop:
            raise _StopForward
        return self.inner(x, indices)


class _Taps:
    """Puts a `_SwitchTap` in front of every MoE block's switch (removed again on exit) and reads the
    routers' outputs through their `RouterTap`s."""

    def __init__(self, engine):
        self.engine, self.sink, self.saved = engine, {}, []
        self.routers = [tap_router(block) for block in engine.moe_blocks]

    def __enter__(self):
        blocks = self.engine.moe_blocks
        for i, block in enumerate(blocks):
            # the switch is the block's child, or deeper where the router sits on the layer (Gemma 4)
            parent, attr, switch = next(
                (m, k, v)
                for _, m in block.named_modules()
                for k, v in m.children().items()
                if isinstance(v, OffloadedSwitch)
            )
            self.saved.append((parent, attr, switch))
            setattr(parent, attr, _SwitchTap(switch, self.sink, i, stop=i == len(blocks) - 1))
        return self

    def __exit__(self, *exc):
        for parent, attr, switch in self.saved:
            setattr(parent, attr, switch)

    def clear(self):
        """Forget what the switch taps caught (before a chunk runs)."""
        self.sink.clear()

    def rows(self, piece: list[int], cache, seq_index: int) -> dict:
        """Run `piece` (the next tokens of a sequence, after what `cache` holds) and return its trace rows."""
        self.clear()
        try:
            self.engine.model(mx.array(piece)[None], cache=cache)
        except _StopForward:
            pass
        L = len(self.routers)
        outputs = [self.router_output(i) for i in range(L)]
        logits = [self.router_logits(i) for i in range(L)]
        mx.eval([v for v in list(self.sink.values()) + outputs + logits if isinstance(v, mx.array)])
        return _rows(self.sink, outputs, logits, L, piece, seq_index)

    def router_output(self, layer: int):
        tap = self.routers[layer]
        return tap.output if tap is not None else None

    def router_logits(self, layer: int):
        tap = self.routers[layer]
        return tap.logits if tap is not None else None


def _tokenize(engine, docs: Documents, context: int, max_tokens: int | None) -> list[list[int]]:
    """Documents as token sequences of at most `context` tokens, `max_tokens` in all."""
    sequences, total = [], 0
    for text in docs.texts:
        ids = engine.tokenizer.encode(text)
        for s in range(0, len(ids), context):
            seq = ids[s : s + context]
            if max_tokens is not None:
                seq = seq[: max_tokens - total]
            if len(seq) >= 2:
                sequences.append(seq)
                total += len(seq)
            if max_tokens is not None and total >= max_tokens:
                return sequences
    return sequences


def _router_outputs(out, ids_np, logits=None):
    """(logits, probs at the routed ids) from a router's output; routers that return (ids, scores) give
    their scores, and the logits of their projection (`RouterTap.logits`) where there is one."""
    if isinstance(out, mx.array) and out.shape[-1] > ids_np.shape[-1]:
        logits = np.array(out.astype(mx.float32)).reshape(-1, out.shape[-1])
        z = np.exp(logits - logits.max(axis=-1, keepdims=True))
        probs = z / z.sum(axis=-1, keepdims=True)
        return logits, np.take_along_axis(probs, ids_np, axis=-1)
    if isinstance(out, (tuple, list)) and len(out) == 2:  # (indices, scores) routers
        gi, scores = (np.array(a.astype(mx.float32) if a.dtype != mx.int32 else a) for a in out)
        gi, scores = gi.reshape(ids_np.shape), scores.reshape(ids_np.shape)
        order = np.argsort(gi, axis=-1)
        if logits is not None:
            logits = np.array(logits.astype(mx.float32)).reshape(-1, logits.shape[-1])
        return logits, np.take_along_axis(scores, order, axis=-1)
    return None, np.zeros(ids_np.shape, np.float32)


def record_traces(
    engine,
    docs: Documents,
    out_dir,
    max_tokens: int | None = None,
    context: int = 512,
    chunk: int = 128,
    shard_tokens: int = 8192,
    label: str = "recording",
) -> dict:
    """Run `engine` over `docs` and write trace shards and `manifest.json` to `out_dir`; the manifest."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sequences = _tokenize(engine, docs, context, max_tokens)
    total = sum(len(s) for s in sequences)
    if total == 0:
        raise UserError(f"{docs.source} gives no token sequences of two or more tokens: give more text")
    L, k = len(engine.caches), engine.top_k
    manifest = {
        "format": TRACE_FORMAT,
        "model_identity": engine.identity,
        "model": str(engine.model_path),
        "num_layers": L,
        "num_experts": engine.num_experts,
        "top_k": k,
        "hidden_size": None,
        "context": context,
        "tokens": 0,
        "sequences": len(sequences),
        "shards": [],
        "data": docs.describe(),
    }
    buffer: dict = {}
    buffered = 0

    def flush():
        nonlocal buffer, buffered
        if not buffered:
            return
        name = f"shard-{len(manifest['shards']):05d}.safetensors"
        save_file({key: np.concatenate(parts) for key, parts in buffer.items()}, str(out / name))
        manifest["shards"].append({"file": name, "tokens": buffered})
        manifest["tokens"] += buffered
        buffer, buffered = {}, 0

    with _Taps(engine) as taps, Progress(label, total) as bar:
        for seq_index, seq in enumerate(sequences):
            cache = make_prompt_cache(engine.model)
            for s in range(0, len(seq), chunk):
                piece = seq[s : s + chunk]
                rows = taps.rows(piece, cache, seq_index)
                manifest["hidden_size"] = rows["features"].shape[-1]
                for key, value in rows.items():
                    buffer.setdefault(key, []).append(value)
                buffered += len(piece)
                bar.update(len(piece))
                if buffered >= shard_tokens:
                    flush()
            engine.runtime.settle()
        flush()
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def record_sequence(engine, tokens: list[int], chunk: int = 128) -> dict:
    """One token sequence's trace rows (the keys `record_traces` stores), recorded as its shards are:
    teacher-forced through the per-layer engine `engine`, `chunk` tokens a forward."""
    with _Taps(engine) as taps:
        cache = make_prompt_cache(engine.model)
        parts = [taps.rows(tokens[s : s + chunk], cache, 0) for s in range(0, len(tokens), chunk)]
    engine.runtime.settle()
    return {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}


def _rows(sink, outputs, router_logits, L, piece, seq_index) -> dict:
    n = len(piece)
    features, logits, ids, probs = [], [], [], []
    for i in range(L):
        ids_i = np.sort(np.array(sink[("ids", i)]).reshape(n, -1).astype(np.int64), axis=-1)
        lg, pr = _router_outputs(outputs[i], ids_i, router_logits[i])
        features.append(np.array(sink[("x", i)].astype(mx.float32)).reshape(n, -1))
        ids.append(ids_i)
        probs.append(pr)
        if lg is not None:
            logits.append(lg)
    rows = {
        "features": np.stack(features, 1).astype(np.float16),
        "ids": np.stack(ids, 1).astype(np.int32),
        "probs": np.stack(probs, 1).astype(np.float16),
        "tokens": np.array(piece, np.int32),
        "sequence": np.full(n, seq_index, np.int32),
    }
    if len(logits) == L:
        rows["logits"] = np.stack(logits, 1).astype(np.float16)
    return rows


class TraceSet:
    """A recorded trace folder: its manifest and its shards, read one at a time."""

    def __init__(self, path):
        self.path = Path(path)
        manifest = self.path / "manifest.json"
        if not manifest.is_file():
            raise UserError(f"{self.path} holds no traces (no manifest.json): record them first")
        self.manifest = json.loads(manifest.read_text())
        if self.manifest.get("format") != TRACE_FORMAT:
            raise UserError(f"{manifest} is not an od-moe trace manifest ({TRACE_FORMAT})")

    @property
    def tokens(self) -> int:
        return self.manifest["tokens"]

    def shards(self) -> Iterator[dict]:
        for shard in self.manifest["shards"]:
            yield load_file(str(self.path / shard["file"]))

    def shard(self, index: int) -> dict:
        return load_file(str(self.path / self.manifest["shards"][index]["file"]))

    def load(self, keys=None, max_tokens: int | None = None) -> dict:
        """The shards concatenated (for evaluation sets that fit in memory)."""
        parts: dict = {}
        n = 0
        for shard in self.shards():
            for key, value in shard.items():
                if keys is None or key in keys:
                    parts.setdefault(key, []).append(value)
            n += len(shard["tokens"])
            if max_tokens is not None and n >= max_tokens:
                break
        out = {key: np.concatenate(v) for key, v in parts.items()}
        return {key: v[:max_tokens] for key, v in out.items()} if max_tokens else out
