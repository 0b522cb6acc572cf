"""Prompt lookup: drafts taken from the text so far, with no second model.

Where an answer repeats its prompt (code editing: the prompt holds a file, the answer rewrites part of it),
the tokens after the last few generated ones have often been seen already. `PromptLookup` drafts them: it
is a draft "model" for mlx-lm's drafting loop (`speculative_generate_step`, which od-moe's drafting runs:
`drafts.py`). Its cache (`History`) holds the tokens the loop has given it (the prompt, then each verified
token) and is rewound with the target's; called on new tokens, it finds the latest earlier place where the
last `ngram` tokens (then fewer, down to one) occurred and predicts the token that followed there, as
logits that are 0 there and -inf elsewhere, so that any sampler drafts exactly that token. Where nothing
matches it predicts the last token again (the target rejects what is wrong: a draft costs verify width,
never a wrong token). Stock mlx-lm fed the same `PromptLookup` makes the same verify passes, which is how
the tests hold od-moe's tokens to it.
Not here: the drafting loop and its ledger (`drafts.py`).
"""

import mlx.core as mx
import mlx.nn as nn

NGRAM = 3  # the longest run of recent tokens looked up


class History:
    """A `PromptLookup`'s cache: the tokens seen, rewound as mlx-lm rewinds a draft's KV cache, and where
    each token occurs (so that a lookup visits the earlier places of the last token, not every token)."""

    def __init__(self, tokens=()):
        self.tokens: list[int] = []
        self._at: dict[int, list[int]] = {}  # token -> its positions, ascending
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

    def trim(self, n: int) -> int:
        n = min(n, len(self.tokens))
        for _ in range(n):
            self._at[self.tokens.pop()].pop()
        return n

    def next_token(self, ngram: int = NGRAM) -> int:
        """The token after the latest earlier occurrence of the last `ngram` tokens (then fewer); the
        last token where none occurred before."""
        tokens = self.tokens
        if not tokens:
            return 0
        earlier = self._at[tokens[-1]][:-1]  # where a run ending like this one ends, not the last place
        for n in range(min(ngram, len(tokens) - 1), 0, -1):
            tail = tokens[-n:]
            for end in reversed(earlier):
                if end >= n - 1 and tokens[end - n + 1 : end + 1] == tail:
                    return tokens[end + 1]
        return tokens[-1]


class PromptLookup(nn.Module):
    """A draft for mlx-lm's drafting loop that predicts from the tokens so far (`History.next_token`).
    `vocab_size`: the target's logits per token (`drafts.prepare` sets it where it is None)."""

    def __init__(self, vocab_size: int | None = None, ngram: int = NGRAM):
        super().__init__()
        self.vocab_size, self.ngram = vocab_size, ngram

    def make_cache(self) -> list:
        return [History()]

    def __call__(self, inputs: mx.array, cache: list) -> mx.array:
        history = cache[0]
        history.extend(inputs.reshape(-1).tolist())
        token = history.next_token(self.ngram)
        logits = mx.full((1, 1, self.vocab_size), -float("inf"))
        logits[..., token] = 0.0
        return logits
