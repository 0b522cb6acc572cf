"""Lab (issue #57, item 3): a recipe for a draft model that is not the target in disguise, not yet run to
the end. A small dense Qwen3 (4 layers, hidden 192: 3.2M parameters; the bundled MoE has
21.4M, 4.9M of them active a token) trained with MLX on the data the bundled MoE was trained on, with its
8192-token tokenizer.

The bundled MoE's corpus (`../shared/tools/train_tiny_moe.py`) was CPython 3.11.7's standard library, 5% of
its files held out (chosen with `random.Random(0).shuffle`), plus Python sources of common site-packages,
25M tokens in all. Its token files were not kept, so `--write-corpus` makes a corpus the same way: this
Python's standard library (9.0M training tokens, 0.42M held out, on 3.11.7) plus the .py files of the
site-packages beside it (shuffled with the same seed) up to 25M tokens, saved as uint16 ids in one .npz.
Training reads that file (no tokenizer needed where it runs), trains for a fixed time and saves float16
weights in mlx-lm's layout with the tokenizer.
On this project's 2-core CPU it is too slow to be useful: 9 s a step of 4,096 tokens (MLX's CPU matmul ran
1024^3 at 7.6 GFLOP/s). It needs MLX on a GPU (Metal or CUDA).

    python lab/drafts/train_draft.py --write-corpus corpus.npz
    python lab/drafts/train_draft.py OUT --corpus corpus.npz [--seconds 1200] [--distill]

`--distill` trains on the bundled model's own next-token probabilities instead of the text's next token,
so that the draft learns to agree with the model it drafts for; both ways, the end reports how often the
draft's most likely token is the bundled model's on held-out text.
"""

import argparse
import json
import math
import random
import shutil
import sys
import sysconfig
import time
from functools import partial
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import mlx_lm
import numpy as np
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import qwen3

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
CONFIG = dict(
    model_type="qwen3",
    vocab_size=8192,
    hidden_size=192,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=48,
    max_position_embeddings=2048,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
)
SEQUENCE, BATCH, PEAK_LR, WARMUP = 512, 64, 3e-3, 100
CORPUS_TOKENS = 25_000_000


def stdlib_split() -> tuple[list[Path], list[Path]]:
    """This Python's standard library .py files, split 95/5 by file: (training, held out)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.rglob("*.py") if "site-packages" not in p.parts)
    random.Random(0).shuffle(files)
    held = len(files) // 20
    return files[held:], files[:held]


def encoder(tokenizer_path: Path):
    """Token ids of files, one uint16 array each, 0 ending each file."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(tokenizer_path / "tokenizer.json"))

    def encode(paths) -> list[np.ndarray]:
        texts = [p.read_text(errors="replace") for p in paths]
        return [np.array(e.ids + [0], dtype=np.uint16) for e in tokenizer.encode_batch(texts)]

    return encode


def write_corpus(path: Path, tokenizer_path: Path):
    """The standard library's .py files split 95/5 by file, then site-packages' .py files added to the
    training split up to `CORPUS_TOKENS`, as token ids (0 ends each file) in one .npz."""
    encode = encoder(tokenizer_path)
    train_files, held_files = stdlib_split()
    train, val = encode(train_files), encode(held_files)
    site = sorted(Path(sysconfig.get_paths()["purelib"]).rglob("*.py"))
    random.Random(0).shuffle(site)
    total = sum(map(len, train))
    for start in range(0, len(site), 500):
        if total >= CORPUS_TOKENS:
            break
        for ids in encode(site[start : start + 500]):
            if total < CORPUS_TOKENS:
                train.append(ids)
                total += len(ids)
    np.savez_compressed(path, train=np.concatenate(train), val=np.concatenate(val))
    print(f"{path}: {total:,} training tokens, {sum(map(len, val)):,} held out")


def batches(data: np.ndarray, rng: np.random.Generator, batch: int = BATCH):
    while True:
        start = rng.integers(0, len(data) - SEQUENCE - 1, batch)
        rows = np.stack([data[s : s + SEQUENCE + 1] for s in start]).astype(np.int32)
        yield mx.array(rows[:, :-1]), mx.array(rows[:, 1:])


def loss_fn(model, inputs, targets):
    """Cross entropy against the next token, or, where `targets` are the teacher's probabilities (one
    row of the vocabulary per position: `--distill`), against those."""
    logits = model(inputs)
    if targets.ndim == inputs.ndim:
        return nn.losses.cross_entropy(logits, targets, reduction="mean")
    return -(targets * nn.log_softmax(logits.astype(mx.float32), axis=-1)).sum(axis=-1).mean()


def teacher_probabilities(teacher, inputs: mx.array) -> mx.array:
    return mx.softmax(teacher(inputs).astype(mx.float32), axis=-1)


def agreement(model, teacher, data: np.ndarray, sequences: int) -> float:
    """How often the draft's most likely next token is the teacher's, on held-out text: what greedy
    drafting accepts a position at a time."""
    rng, same, total = np.random.default_rng(2), 0, 0
    for _ in range(max(1, sequences // 8)):
        inputs, _ = next(batches(data, rng, min(sequences, 8)))
        same += (model(inputs).argmax(-1) == teacher(inputs).argmax(-1)).sum().item()
        total += inputs.size
    return same / total


def validation_loss(model, data: np.ndarray, sequences: int) -> float:
    rng, size = np.random.default_rng(1), min(sequences, BATCH)
    losses = [loss_fn(model, *next(batches(data, rng, size))).item() for _ in range(sequences // size)]
    return float(np.mean(losses))


def train(
    out: Path,
    seconds: float,
    corpus: Path,
    tokenizer_path: Path,
    batch: int = BATCH,
    distill: bool = False,
    held_out: int = 2048,
):
    mx.random.seed(0)
    teacher = mlx_lm.load(str(tokenizer_path))[0]  # the bundled MoE, the model drafted for
    with np.load(corpus) as data:
        train_ids, val_ids = data["train"], data["val"]
    print(f"corpus: {len(train_ids):,} training tokens, {len(val_ids):,} held out", flush=True)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(CONFIG))
    params = sum(v.size for _, v in tree_flatten(model.parameters()))
    optimizer = optim.AdamW(learning_rate=PEAK_LR, betas=[0.9, 0.95], weight_decay=0.1)
    step_fn = nn.value_and_grad(model, loss_fn)

    state = [model.state, optimizer.state]

    @partial(mx.compile, inputs=state, outputs=state)
    def step(inputs, targets):
        loss, grads = step_fn(model, inputs, targets)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss

    rng, start, n, tokens = np.random.default_rng(0), time.time(), 0, 0
    for inputs, targets in batches(train_ids, rng, batch):
        elapsed = time.time() - start
        if elapsed > seconds:
            break
        cosine = 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * elapsed / seconds))
        optimizer.learning_rate = PEAK_LR * min(1.0, (n + 1) / WARMUP) * cosine
        if distill:
            targets = teacher_probabilities(teacher, inputs)
            mx.eval(targets)
        loss = step(inputs, targets)
        mx.eval(state, loss)
        n, tokens = n + 1, tokens + inputs.size
        if n % 100 == 0 or n == 1:
            print(f"step {n} loss {loss.item():.3f} {tokens / (time.time() - start):,.0f} tok/s", flush=True)
    val, agree = validation_loss(model, val_ids, held_out), agreement(model, teacher, val_ids, held_out // 16)
    print(
        f"{params:,} parameters, {n} steps, {tokens:,} tokens, held-out loss {val:.3f}, "
        f"top-1 agreement with the bundled model {agree:.3f}",
        flush=True,
    )
    trained = dict(steps=n, tokens=tokens, seconds=seconds, held_out_loss=val, distilled=distill)
    save(model, out, tokenizer_path, dict(trained, top1_agreement=agree))


def save(model, out: Path, tokenizer_path: Path, trained: dict):
    out.mkdir(parents=True, exist_ok=True)
    weights = dict(tree_flatten(tree_map(lambda v: v.astype(mx.float16), model.parameters())))
    mx.save_safetensors(str(out / "model.safetensors"), weights, metadata={"format": "mlx"})
    (out / "config.json").write_text(json.dumps(dict(CONFIG, torch_dtype="float16"), indent=2) + "\n")
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_path / name, out / name)
    (out / "training.json").write_text(json.dumps(trained, indent=2) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, nargs="?")
    parser.add_argument("--corpus", type=Path, help="the .npz --write-corpus made")
    parser.add_argument("--write-corpus", type=Path, help="make the corpus here and stop")
    parser.add_argument("--seconds", type=float, default=1200)
    parser.add_argument("--batch", type=int, default=BATCH, help="sequences of 512 tokens a step")
    parser.add_argument(
        "--distill", action="store_true", help="learn the bundled model's next-token probabilities"
    )
    parser.add_argument("--held-out", type=int, default=2048, help="held-out sequences the loss is taken on")
    args = parser.parse_args(argv)
    import od_moe

    tokenizer_path = Path(od_moe.DEFAULT_MODEL)  # the bundled model's tokenizer
    if args.write_corpus:
        write_corpus(args.write_corpus, tokenizer_path)
    elif args.out and args.corpus:
        train(args.out, args.seconds, args.corpus, tokenizer_path, args.batch, args.distill, args.held_out)
    else:
        parser.error("give OUT and --corpus, or --write-corpus")
    return 0


if __name__ == "__main__":
    sys.exit(main())
