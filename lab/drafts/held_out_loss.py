"""Lab (issue #70, item 11): held-out loss of the draft model and of the MoE it drafts for, like with like.

Every row scores the same windows of the same held-out text with the same arithmetic: the standard library
files that `train_draft.py` and `../shared/tools/train_tiny_moe.py` both hold out (5% of this Python's
stdlib .py files, chosen with `random.Random(0).shuffle`; the same files where this is CPython 3.11.7),
encoded with the bundled tokenizer, each model loaded with stock `mlx_lm.load` and its floating weights
(norms, quantization scales) cast to float32, so all compute is float32. The loss is the mean cross entropy
of each window's next tokens; a row says what its weights are.

`--windows draft` (the default) draws windows of 512 + 1 tokens as `train_draft.py` does
(`np.random.default_rng(1)`, `--batches` of `--size` windows; `--batches 32 --size 64` are the windows of the
draft's training report). `--windows moe` takes `train_tiny_moe.py`'s: `np.random.RandomState(1)`, 20 of 16
windows of 512 tokens, 511 predictions each. The MoE rows also give the router's load-balancing loss as
transformers computes it, and cross entropy + 0.01 x that: what `train_tiny_moe.py` printed as its loss
(it trained with `output_router_logits=True`, `router_aux_loss_coef=0.01`).

    python lab/drafts/held_out_loss.py [--windows draft|moe] [--batches 6] [--size 8]
"""

import argparse
import hashlib
import platform
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
from train_draft import SEQUENCE, batches, encoder, stdlib_split

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SHARED = ROOT.parent / "shared" / "models"
AUX_COEF = 0.01  # train_tiny_moe.py's router_aux_loss_coef
MODELS = (
    ("draft", ROOT / "od_moe/models/tiny-qwen3-draft-4bit", "4-bit affine, group 64 (as shipped)"),
    ("MoE", ROOT / "od_moe/models/tiny-qwen3-moe-4bit", "4-bit affine, group 64 (as shipped)"),
    ("MoE", SHARED / "tiny-qwen3-moe", "bf16, not quantized (the checkpoint the 4-bit was made from)"),
)


class RecordedGate(nn.Module):
    """A router that hands its logits to `record` as it runs."""

    def __init__(self, gate, record):
        super().__init__()
        self.gate = gate
        self.record = record

    def __call__(self, x):
        logits = self.gate(x)
        self.record(logits)
        return logits


def router_aux_loss(logits: list[mx.array], top_k: int) -> float:
    """transformers' `load_balancing_loss_func` over every layer's router logits of one batch: the number
    of experts x sum over experts of (share of top-k picks) x (mean router probability)."""
    experts = logits[0].shape[-1]
    picks, probs, rows = mx.zeros(experts), mx.zeros(experts), 0
    for layer in logits:
        p = mx.softmax(layer.reshape(-1, experts).astype(mx.float32), axis=-1)
        top = mx.argpartition(-p, kth=top_k - 1, axis=-1)[:, :top_k]
        picks = picks + (top[..., None] == mx.arange(experts)).sum(axis=(0, 1))
        probs, rows = probs + p.sum(axis=0), rows + p.shape[0]
    return (experts * ((picks / rows) * (probs / rows)).sum()).item()


def windows(ids: np.ndarray, kind: str, count: int, size: int):
    """(inputs, targets) batches, the same for every model."""
    if kind == "draft":
        rng = np.random.default_rng(1)
        return [next(batches(ids, rng, size)) for _ in range(count)]
    rng, out = np.random.RandomState(1), []  # train_tiny_moe.py's sample(val, 16, rng), 20 times
    for _ in range(20):
        starts = rng.randint(0, len(ids) - SEQUENCE - 1, 16)
        rows = np.stack([ids[s : s + SEQUENCE] for s in starts]).astype(np.int32)
        out.append((mx.array(rows[:, :-1]), mx.array(rows[:, 1:])))
    return out


def score(path: Path, data) -> dict:
    model = mlx_lm.load(str(path))[0]
    model.set_dtype(mx.float32)
    recorded = []
    top_k = getattr(model.args, "num_experts_per_tok", None)
    if top_k:
        for layer in model.layers:
            layer.mlp.gate = RecordedGate(layer.mlp.gate, recorded.append)
    losses, aux, start = [], [], time.time()
    for inputs, targets in data:
        recorded.clear()
        logits = model(inputs)
        assert logits.dtype == mx.float32, logits.dtype
        losses.append(nn.losses.cross_entropy(logits, targets, reduction="mean").item())
        if top_k:
            aux.append(router_aux_loss(recorded, top_k))
    return dict(losses=losses, aux=aux, seconds=time.time() - start)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--windows", choices=("draft", "moe"), default="draft")
    parser.add_argument("--batches", type=int, default=6, help="with --windows draft")
    parser.add_argument("--size", type=int, default=8, help="windows a batch, with --windows draft")
    args = parser.parse_args(argv)

    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True)
    print(
        f"python {platform.python_version()}, mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}, "
        f"{mx.default_device()}, commit {commit.stdout.decode().strip()}"
    )
    held_files = stdlib_split()[1]
    ids = np.concatenate(encoder(ROOT / "od_moe/models/tiny-qwen3-moe-4bit")(held_files))
    digest = hashlib.sha256(ids.tobytes()).hexdigest()[:16]
    print(f"held out: {len(held_files)} stdlib files, {len(ids):,} tokens (uint16 sha256 {digest}...)")
    data = windows(ids, args.windows, args.batches, args.size)
    shape = data[0][1].shape
    print(
        f"windows: {args.windows} ({len(data)} x {shape[0]} x {shape[1]} predictions); "
        "float32 compute, mean next-token cross entropy"
    )
    for name, path, weights in MODELS:
        if not (path / "config.json").exists():
            print(f"{name:5} {path}: not here")
            continue
        row = score(path, data)
        losses = np.array(row["losses"])
        error = losses.std(ddof=1) / np.sqrt(len(losses)) if len(losses) > 1 else float("nan")
        line = f"{name:5} {weights}: loss {losses.mean():.3f} (+-{error:.3f} s.e. over batches)"
        if row["aux"]:
            aux = float(np.mean(row["aux"]))
            line += f", router aux {aux:.3f}, loss + {AUX_COEF} x aux {losses.mean() + AUX_COEF * aux:.3f}"
        print(f"{line}  [{path.relative_to(ROOT.parent)}, {row['seconds']:.0f} s]")
        print("      per batch: " + " ".join(f"{v:.3f}" for v in losses), flush=True)
    print(
        "The draft's float32 weights (train_draft.py's held-out loss 1.981, 32 x 64 x 512 windows) and their "
        "float16 save were not kept: only the 4-bit conversion ships."
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
