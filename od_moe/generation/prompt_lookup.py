"""Prompt lookup: drafts taken from the text so far, with no second model, and the loop that verifies them.

Where an answer repeats its prompt (code editing: the prompt holds a file, the answer rewrites part of it),
the tokens after the last few generated ones have often been seen already. `History` holds the tokens the
target's KV cache holds and where each occurs; `History.continuation` finds the latest earlier place where
the last `ngram` tokens (then fewer, down to `shortest`) occurred and drafts the tokens that followed there.
`lookup_generate_step` is the drafting loop: unlike mlx-lm's (`speculative_generate_step`, which drafts a
fixed count every pass), it drafts only what a lookup found, so a pass with nothing found is a plain decode
pass of one position and routes to no more experts than undrafted decoding. Each position's token is
sampled from the target's own distribution and a draft is kept while it equals that token, so sampling
keeps the target's distribution (a draft of one certain token accepted with probability p, as speculative
sampling's rule gives). `stream_lookup` wraps it in mlx-lm's `GenerationResponse`s.

`PromptLookup` also serves as a draft "model" for mlx-lm's own loop (it predicts one token a call, the last
token again where nothing matched), which is how stock mlx-lm can be fed the same lookups.
Not here: model drafts and the ledger's drafting counts (`generation/drafts.py`).
"""

import time
from dataclasses import dataclass, field
from typing import cast

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.generate import GenerationResponse, generation_stream
from mlx_lm.models.cache import make_prompt_cache, trim_prompt_cache
from mlx_lm.tokenizer_utils import TokenizerWrapper

from ..accounting.ledger import FOUND_IN
from ..errors import UserError

NGRAM = 3  # the longest run of recent tokens looked up
# The shortest run od-moe's loop drafts from: on an offloaded MoE a rejected draft costs expert reads, and
# drafts from shorter runs were mostly rejected (docs/BENCHMARKS.md, "Drafts")
SHORTEST = 3


class History:
    """A `PromptLookup`'s cache: the tokens seen, rewound as mlx-lm rewinds a draft's KV cache, and where
    each token occurs (so that a lookup visits the earlier places of the last token, not every token)."""

    def __init__(self, tokens=()):
        self.tokens: list[int] = []
        self._at: dict[int, list[int]] = {}  # token -> its positions, ascending
        self.prompt_end = 0  # tokens before this one came with a prompt (`end_prompt`)
        self.extend(tokens)

    @property
    def offset(self) -> int:
        return len(self.tokens)

    @property
    def state(self):
        return mx.array(self.tokens[-1:] or [0], mx.uint32)  # what mlx-lm evaluates after a prefill step

    def is_trimmable(self) -> bool:
        return True

    def extend(self, tokens):
        for token in tokens:
            self._at.setdefault(token, []).append(len(self.tokens))
            self.tokens.append(token)

    def end_prompt(self, end: int):
        """Tokens before position `end` came with the prompt (`lookup_generate_step`, once it is in)."""
        self.prompt_end = end

    def trim(self, n: int) -> int:
        n = min(n, len(self.tokens))
        for _ in range(n):
            self._at[self.tokens.pop()].pop()
        return n

    def next_token(self, ngram: int = NGRAM) -> int:
        """The token after the latest earlier occurrence of the last `ngram` tokens (then fewer); the
        last token where none occurred before."""
        end = self._match(ngram)
        return self.tokens[end + 1] if end is not None else (self.tokens[-1] if self.tokens else 0)

    def continuation(
        self, count: int, ngram: int = NGRAM, shortest: int = SHORTEST
    ) -> tuple[list[int], bool]:
        """Up to `count` tokens that followed the latest earlier occurrence of the last `ngram` tokens (then
        fewer, down to `shortest`), and whether that occurrence lies in the prompt (before `prompt_end`);
        ([], False) where none occurred."""
        end = self._match(ngram, shortest) if count > 0 else None
        if end is None:
            return [], False
        return self.tokens[end + 1 : end + 1 + count], end < self.prompt_end

    def _match(self, ngram: int, shortest: int = 1) -> int | None:
        """Where the latest earlier run of the last `ngram` tokens (then fewer, down to `shortest`) ends,
        or None."""
        tokens = self.tokens
        if not tokens:
            return None
        earlier = self._at[tokens[-1]][:-1]  # where a run ending like this one ends, not the last place
        for n in range(min(ngram, len(tokens) - 1), max(shortest, 1) - 1, -1):
            tail = tokens[-n:]
            for end in reversed(earlier):
                if end >= n - 1 and tokens[end - n + 1 : end + 1] == tail:
                    return end
        return None


class PromptLookup(nn.Module):
    """A draft for mlx-lm's drafting loop that predicts from the tokens so far (`History.next_token`), and
    what od-moe's loop drafts (`continuation`). `vocab_size`: the target's logits per token (`fit_vocab`,
    where it is None)."""

    def __init__(self, vocab_size: int | None = None, ngram: int = NGRAM, shortest: int = SHORTEST):
        super().__init__()
        self.vocab_size, self.ngram, self.shortest = vocab_size, ngram, shortest
        self.counts = LookupCounts()  # what od-moe's loop drafted with it, by source (`lookup_generate_step`)

    def fit_vocab(self, vocab_size: int | None):
        """Draft over `vocab_size` logits, the target's, where no size was given (`drafts.prepare`; None:
        the target's config does not say)."""
        if self.vocab_size is None:
            self.vocab_size = vocab_size

    def make_cache(self) -> list:
        return [History()]

    def continuation(self, history: History, count: int) -> tuple[list[int], bool]:
        """What od-moe's loop drafts after `history`, up to `count` tokens, and whether it was found in the
        prompt: `History.continuation` with this lookup's `ngram` and `shortest`."""
        return history.continuation(count, self.ngram, self.shortest)

    def count(self, counts: "LookupCounts"):
        """Add one generation's `counts` to this lookup's running totals (`self.counts`)."""
        self.counts.add(counts)

    def __call__(self, inputs: mx.array, cache: list) -> mx.array:
        history = cache[0]
        history.extend(inputs.reshape(-1).tolist())
        token = history.next_token(self.ngram)
        if self.vocab_size is None:  # else mx.full fails with no word of why
            raise ValueError(
                "PromptLookup needs the target's vocabulary size before mlx-lm's drafting loop calls it: "
                "give vocab_size"
            )
        logits = mx.full((1, 1, self.vocab_size), -float("inf"))
        logits[..., token] = 0.0
        return logits


@dataclass
class LookupCounts:
    """What a lookup loop drafted and what its target accepted, by where the draft was found: in the prompt
    or in the text generated since (`History.prompt_end`)."""

    drafted: dict = field(default_factory=lambda: dict.fromkeys(FOUND_IN, 0))
    accepted: dict = field(default_factory=lambda: dict.fromkeys(FOUND_IN, 0))
    passes: int = 0  # target passes after the prompt's
    drafting_passes: int = 0  # of those, the ones that verified at least one draft

    def add(self, other: "LookupCounts"):
        for source in self.drafted:
            self.drafted[source] += other.drafted[source]
            self.accepted[source] += other.accepted[source]
        self.passes += other.passes
        self.drafting_passes += other.drafting_passes

    def count_pass(self, source: str, drafted: int):
        """A target pass after the prompt's that verified `drafted` drafts found in `source` (`FOUND_IN`)."""
        self.passes += 1
        self.drafting_passes += bool(drafted)
        self.drafted[source] += drafted

    def count_given(self, source: str, from_draft: bool):
        """A token given to the caller: accepted where it came from a draft found in `source`."""
        self.accepted[source] += from_draft


def lookup_generate_step(
    prompt: mx.array,
    model,
    *,
    num_draft_tokens: int = 2,
    max_tokens: int = 256,
    sampler=None,
    logits_processors=None,
    prompt_cache=None,
    prefill_step_size: int = 2048,
    ngram: int = NGRAM,
    shortest: int = SHORTEST,
    counts: LookupCounts | None = None,
    lookup: PromptLookup | None = None,
):
    """Yield (token, logprobs, from_draft) as mlx-lm's `speculative_generate_step` does, drafting by prompt
    lookup only where a lookup finds something (see the module's docstring). `prompt_cache`: the target's
    caches, then optionally a `History` (mlx-lm's layout of a target's and its draft's caches); `counts`:
    counted in as the loop goes; `lookup`: what drafts (`PromptLookup.continuation`; None: one with `ngram`
    and `shortest`, which a `lookup` given overrides)."""
    lookup = lookup if lookup is not None else PromptLookup(ngram=ngram, shortest=shortest)
    layers = len(model.layers)
    cache = prompt_cache[:layers] if prompt_cache is not None else make_prompt_cache(model)
    history = prompt_cache[layers] if prompt_cache is not None and len(prompt_cache) > layers else History()
    sampler = sampler or (lambda logprobs: mx.argmax(logprobs, axis=-1))
    counts = counts if counts is not None else LookupCounts()
    # a 1-D array: a list of ints (mlx types tolist() for any shape)
    tokens = cast(list[int], prompt.astype(mx.uint32).tolist())
    seen = list(history.tokens) + tokens  # what logits processors are given, as mlx-lm gives its tokens
    for start in range(0, len(tokens) - 1, prefill_step_size):
        chunk = tokens[start : min(start + prefill_step_size, len(tokens) - 1)]
        model(mx.array(chunk, mx.uint32)[None], cache=cache)
        mx.eval([c.state for c in cache])
    history.extend(tokens[:-1])
    history.end_prompt(history.offset + 1)
    last, generated = tokens[-1], 0
    while generated < max_tokens:
        history.extend([last])
        room = min(num_draft_tokens, max_tokens - generated - 1)
        drafts, in_prompt = lookup.continuation(history, room)
        logits = model(mx.array([last, *drafts], mx.uint32)[None], cache=cache)[0]
        chosen, logprobs = _sample(logits, seen, drafts, sampler, logits_processors)
        accepted = 0
        while accepted < len(drafts) and chosen[accepted] == drafts[accepted]:
            accepted += 1
        source = "prompt" if in_prompt else "output"  # `FOUND_IN`
        counts.count_pass(source, len(drafts))
        trim_prompt_cache(cache, len(drafts) - accepted)
        history.extend(drafts[:accepted])
        for i in range(accepted + 1):
            seen.append(chosen[i])
            counts.count_given(source, i < accepted)  # as given: a caller that stops early took no more
            yield chosen[i], logprobs[i], i < accepted
        generated, last = generated + accepted + 1, chosen[accepted]


def _sample(logits: mx.array, seen: list[int], drafts: list[int], sampler, processors):
    """Each position's token and log-probabilities, position by position where logits processors need the
    tokens before it (as mlx-lm's loop does), else in one call."""
    if not processors:
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        chosen = sampler(logprobs)
        mx.eval(chosen, logprobs)
        return chosen.tolist(), logprobs
    rows, chosen = [], []
    for i in range(logits.shape[0]):
        context = mx.array(seen + drafts[:i], mx.uint32)
        row = logits[i : i + 1]
        for processor in processors:
            row = processor(context, row)
        row = row - mx.logsumexp(row, axis=-1, keepdims=True)
        rows.append(row[0])
        chosen.append(sampler(row).item())
    return chosen, mx.stack(rows)


_IGNORED = ("max_kv_size", "prompt_progress_callback")  # mlx-lm's drafting loop drops these too
_TAKEN = (
    "num_draft_tokens",
    "sampler",
    "logits_processors",
    "prompt_cache",
    "prefill_step_size",
    "ngram",
    "shortest",
    "lookup",
)


def stream_lookup(model, tokenizer, prompt: list[int], max_tokens: int, counts: LookupCounts, **kwargs):
    """`mlx_lm.stream_generate`'s responses (text segments, timings, finish reason) over
    `lookup_generate_step` on `prompt` (token ids), on mlx-lm's generation stream. A keyword the loop
    does not take is a UserError, raised here."""
    for name in _IGNORED:
        kwargs.pop(name, None)
    unknown = sorted(set(kwargs) - set(_TAKEN))
    if unknown:
        raise UserError(f"prompt lookup does not take {', '.join(unknown)}: generate without it for those")
    tokenizer = tokenizer if isinstance(tokenizer, TokenizerWrapper) else TokenizerWrapper(tokenizer)
    return _responses(
        tokenizer,
        prompt,
        max_tokens,
        lookup_generate_step(mx.array(prompt), model, max_tokens=max_tokens, counts=counts, **kwargs),
    )


def _responses(tokenizer, prompt: list[int], max_tokens: int, steps):
    detokenizer, eos = tokenizer.detokenizer, tokenizer.eos_token_ids
    tic, prompt_tps, token, logprobs, from_draft, n = time.perf_counter(), 0.0, None, None, False, 0
    with mx.stream(generation_stream):
        for n, (token, logprobs, from_draft) in enumerate(steps):
            if n == 0:
                prompt_tps, tic = len(prompt) / (time.perf_counter() - tic), time.perf_counter()
            if token in eos:
                break
            detokenizer.add_token(token)
            if n + 1 == max_tokens:
                break
            yield _response(
                detokenizer.last_segment, token, logprobs, from_draft, len(prompt), prompt_tps, n, tic
            )
    detokenizer.finalize()
    finish = "stop" if token in eos else "length"
    yield _response(
        detokenizer.last_segment, token, logprobs, from_draft, len(prompt), prompt_tps, n, tic, finish
    )


def _response(text, token, logprobs, from_draft, prompt_tokens, prompt_tps, n, tic, finish=None):
    return GenerationResponse(
        text=text,
        token=token,
        logprobs=logprobs,
        from_draft=from_draft,
        prompt_tokens=prompt_tokens,
        prompt_tps=prompt_tps,
        generation_tokens=n + 1,
        generation_tps=(n + 1) / (time.perf_counter() - tic),
        peak_memory=mx.get_peak_memory() / 1e9,
        finish_reason=finish,
    )
