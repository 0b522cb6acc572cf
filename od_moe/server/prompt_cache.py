"""The KV cache a finished request leaves for the next one whose prompt starts with the same tokens.

One cache is kept, with the tokens it holds; a request takes it whole (trimmed to the prefix it shares) or
gets a new one, so two requests never share a cache. Used by the worker's one-at-a-time path and by the
running batch (`batching.py`). Not here: which request's cache is kept (the worker and the batch decide).
"""

from mlx_lm.models.cache import can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache


class PromptCache:
    """The KV cache left by the previous request and the tokens it holds."""

    def __init__(self):
        self.cache, self.tokens = None, []

    def take(self, model, prompt: list[int]):
        """(cache, tokens still to prefill, tokens reused) for `prompt`."""
        n = 0
        if self.cache is not None:
            limit = min(len(self.tokens), len(prompt) - 1)  # at least one prompt token must be fed
            while n < limit and self.tokens[n] == prompt[n]:
                n += 1
            if n < len(self.tokens) and not (can_trim_prompt_cache(self.cache) and n > 0):
                n = 0
        if n == 0:
            self.cache, self.tokens = make_prompt_cache(model), []
        elif n < len(self.tokens):
            trim_prompt_cache(self.cache, len(self.tokens) - n)
        cache, self.cache, self.tokens = self.cache, None, []  # held by the running request only
        return cache, prompt[n:], n

    def keep(self, cache, tokens: list[int]) -> bool:
        """Keep `cache`, which holds a prefix of `tokens` (False: it cannot be kept). Where it is a target's
        caches and its draft's, which mlx-lm's drafting leaves a token apart, they are trimmed to the tokens
        both hold."""
        offsets = [c.offset for c in cache if hasattr(c, "offset")]
        if not offsets or min(offsets) > len(tokens):
            return False
        offset = min(offsets)
        if max(offsets) > offset:
            if not can_trim_prompt_cache(cache):
                return False
            for c in cache:
                if c.offset > offset:
                    c.trim(c.offset - offset)
        self.cache, self.tokens = cache, tokens[:offset]
        return True
