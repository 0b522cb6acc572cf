"""The KV cache room a server's requests share where the device has memory of its own, and admission by it.

Where `load` planned a device budget (`Engine.device_budget`, CUDA), that budget keeps room for a KV
cache of `Context.tokens` for each of `Context.sequences` (`serve`'s `--max-batch`), beside the slots.
A request holds, from its admission until its reply ends, the KV cache of its prompt and of the tokens it
may generate, counted in mlx-lm's steps of `KV_STEP` tokens. A request that could never fit, even alone,
is a 400 that names the limit; one that fits once others end is a 503 with `Retry-After`; the server keeps
serving either way. Where the device computes in host memory (the CPU, Metal) there is no such room:
memory grows as mlx-lm's does, and `batching.fitting_batch` bounds the batch.
Not here: the budget's arithmetic (`memory/capacity.py`), the generation thread (`worker.py`).
"""

import threading

from .requests import ApiError

KV_STEP = 256  # tokens: mlx-lm grows a KV cache this many at a time
RETRY_AFTER_S = 1  # what a 503 for a full room asks the client to wait: requests end token by token


def _steps(tokens: int) -> int:
    return -(-tokens // KV_STEP) * KV_STEP


class KvRoom:
    """`tokens` of KV cache the running and queued requests share (`limit`: the flags that set it)."""

    def __init__(self, tokens: int, limit: str):
        self.tokens, self.limit = tokens, limit
        self.held = 0
        self.lock = threading.Lock()

    @classmethod
    def of(cls, engine) -> "KvRoom | None":
        """The room `engine`'s device budget keeps, or None where it planned none."""
        if engine.device_budget is None:
            return None
        _, context = engine.device_budget
        limit = f"--context-tokens {context.tokens:,} x --max-batch {context.sequences}"
        return cls(context.tokens * context.sequences, limit)

    def admit(self, prompt_tokens: int, max_tokens: int, max_positions: int):
        """Hold the room a request needs and return what gives it back (idempotent); or raise the 400 or
        503 that says why it cannot be held."""
        need = _steps(min(prompt_tokens + max_tokens, max_positions))
        if need > self.tokens:
            raise ApiError(
                400,
                f"the request needs a KV cache of {need:,} tokens (prompt {prompt_tokens:,} + max_tokens "
                f"{max_tokens:,}, in steps of {KV_STEP}) and this server keeps room for {self.tokens:,} "
                f"tokens in all ({self.limit}): send a shorter prompt or fewer max_tokens, or serve with a "
                "larger --context-tokens",
                "max_tokens",
                "context_length_exceeded",
            )
        with self.lock:
            if self.held + need > self.tokens:
                raise ApiError(
                    503,
                    f"the KV cache room is taken by the requests running ({self.held:,} of {self.tokens:,} "
                    f"tokens held; this one needs {need:,}): send it again shortly",
                    kind="server_error",
                    headers={"Retry-After": str(RETRY_AFTER_S)},
                )
            self.held += need
        given: list[bool] = []

        def release():
            with self.lock:
                if not given:
                    given.append(True)
                    self.held -= need

        return release
