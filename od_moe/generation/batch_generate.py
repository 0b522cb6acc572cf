"""Many prompts decoded together: mlx-lm's `BatchGenerator` run over an od-moe engine's model.

A decode pass of a batch computes one new token for every running sequence. Each MoE layer sees the whole
batch's routing at once (`PerLayerRuntime.route` with one row per sequence), so it looks up the union of
the sequences' experts, reads each missing expert once for all of them, and computes in rounds where the
union is larger than the layer's slots. The arithmetic is mlx-lm's own (left-padded batch KV caches, a
sampler per sequence), so in exact mode the tokens are those `mlx_lm.batch_generate` gives with every
expert resident. Sequences join as the generator admits them and leave when they finish.
Not here: the server's queue of requests (`server/`), the per-layer path (`per_layer/per_layer_runtime.py`).
"""

from collections.abc import Generator, Sequence
from typing import NamedTuple

from mlx_lm.generate import BatchGenerator, BatchResponse, BatchStats

from ..errors import UserError
from .sampling import make_sampler, vocab_size_of


class BatchToken(NamedTuple):
    """One sequence's new token in a batch pass."""

    # the prompt's position in the list given; the public field hides tuple's `index` method, which mypy
    # reads as an incompatible override
    index: int  # type: ignore[assignment]
    token: int
    text: str  # the text this token completes (empty for a stop token, which is not part of the output)
    finish_reason: str | None  # "stop" or "length" on the sequence's last response


def stream_batch_generate(
    engine,
    prompts: Sequence,
    max_tokens: int | Sequence[int] = 128,
    *,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    seed: int | Sequence[int | None] | None = None,
    completion_batch_size: int = 32,
    prefill_batch_size: int = 8,
    stats: BatchStats | None = None,
) -> Generator[list[BatchToken], None, None]:
    """Yield, pass by pass, the new token of every sequence decoded in that pass.

    prompts: texts or token ids. max_tokens: for all, or one per prompt (each capped where prompt and
    completion fill the model's positions). seed: one for all, or one per prompt (None: fresh). At most
    `completion_batch_size` sequences decode at once; `stats`, if given, has the batch's statistics added
    as mlx-lm's add up (`BatchStats +=`).
    """
    ids, limits = _check(engine, prompts, max_tokens)
    seeds = list(seed) if isinstance(seed, (list, tuple)) else [seed] * len(ids)
    if len(seeds) != len(ids):
        raise UserError(f"give one seed or one per prompt ({len(ids)}), got {len(seeds)}")
    vocab = vocab_size_of(engine.model)
    samplers = [make_sampler(temperature, top_p, top_k, min_p, s, vocab) for s in seeds]
    generator = BatchGenerator(
        engine.forward,
        stop_tokens=[[t] for t in engine.tokenizer.eos_token_ids],
        completion_batch_size=completion_batch_size,
        prefill_batch_size=prefill_batch_size,
    )
    runtime = engine.runtime
    runtime.start_prompt(ids[0])
    uids = generator.insert(ids, limits, samplers=samplers)
    index = {uid: i for i, uid in enumerate(uids)}
    detokenizers = {uid: engine.tokenizer.detokenizer for uid in uids}
    try:
        with generator.stats() as window:
            while responses := generator.next_generated():
                runtime.ledger.count_generated(len(responses))
                yield [_token(r, index[r.uid], detokenizers[r.uid]) for r in responses]
        if stats is not None:
            stats += window
    finally:
        generator.close()
        runtime.settle()


def batch_generate(
    engine, prompts: Sequence, max_tokens: int | Sequence[int] = 128, **kwargs
) -> BatchResponse:
    """The completions of `prompts` decoded together, as `mlx_lm.batch_generate` returns them (texts in the
    prompts' order, the batch's statistics, and each completion's token ids); arguments as
    `stream_batch_generate`."""
    stats = BatchStats()
    tokens: list[list[int]] = [[] for _ in prompts]
    for step in stream_batch_generate(engine, prompts, max_tokens, stats=stats, **kwargs):
        for t in step:
            if t.finish_reason != "stop":
                tokens[t.index].append(t.token)
    texts = [engine.tokenizer.decode(t) for t in tokens]
    return BatchResponse(texts, stats, None, tokens, None)


def _check(engine, prompts, max_tokens) -> tuple[list[list[int]], list[int]]:
    """Token ids of each prompt and its own token limit, or a UserError saying what is wrong."""
    if engine.policy_name == "oracle":
        raise UserError("the oracle replays one prompt's routing: batches take another prefetch policy")
    if isinstance(prompts, str) or not len(prompts):
        raise UserError("give a list of prompts (texts or token ids)")
    ids = [engine.encode(p) for p in prompts]
    limits = list(max_tokens) if isinstance(max_tokens, (list, tuple)) else [max_tokens] * len(ids)
    if len(limits) != len(ids):
        raise UserError(f"give one max_tokens or one per prompt ({len(ids)}), got {len(limits)}")
    for i, (p, n) in enumerate(zip(ids, limits)):
        if not p:
            raise UserError(f"prompt {i} is empty: give some text to continue")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UserError(f"max_tokens must be a positive integer, got {n!r} for prompt {i}")
    return ids, [engine.token_limit(len(p), n, f"prompt {i}") for i, (p, n) in enumerate(zip(ids, limits))]


def _token(response, index: int, detokenizer) -> BatchToken:
    if response.finish_reason != "stop":
        detokenizer.add_token(response.token)
    if response.finish_reason is not None:
        detokenizer.finalize()
    return BatchToken(index, response.token, detokenizer.last_segment, response.finish_reason)
