"""Validation of OpenAI-style request bodies into a `GenerationParams`, and the API's error type.

Every user mistake becomes an `ApiError` with an HTTP status and an OpenAI-shaped JSON body. Not here:
tokenizing prompts (the app does it, because it needs the tokenizer) or generating.
"""

import math
import reprlib
from dataclasses import dataclass, field

from ..generation.sampling import MAX_SEED, OPENAI_MAX_TEMPERATURE, out_of_range

ROLES = ("system", "user", "assistant", "tool", "developer")
MAX_DRAFT_TOKENS = 64  # a request's num_draft_tokens: more drafts a pass than any draft model gets accepted


class _ShortRepr(reprlib.Repr):
    """A value as an error message quotes it: at most about 60 characters of it."""

    def __init__(self):
        super().__init__()
        self.maxstring = self.maxlong = self.maxother = 60


_REPR = _ShortRepr()


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        kind: str = "invalid_request_error",
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
        self.headers = headers or {}  # sent with the error (a 503's Retry-After)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class GenerationParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    num_draft_tokens: int | None = None  # with a draft model loaded; None: the server's --num-draft-tokens


def shown(value, limit: int = 60) -> str:
    """`value` as an error message quotes it: a repr of its first items and levels, cut short (a body may
    hold megabytes, and a full repr would be made before it is cut)."""
    text = _REPR.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _number(body, name, default, low, high, integer=False, low_open=False):
    value = body.get(name, default)
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or (integer and not isinstance(value, int))
        or (isinstance(value, float) and not math.isfinite(value))
    ):
        raise ApiError(
            400, f"'{name}' must be {'an integer' if integer else 'a number'}, got {shown(value)}", name
        )
    # compared as given: an integer of 400 digits has no float
    if value < low or value > high or (low_open and value == low):
        raise ApiError(400, out_of_range(f"'{name}'", shown(value), low, high, low_open), name)
    return value + 0  # -0.0 becomes 0.0


def parse_params(
    body: dict,
    max_tokens_cap: int,
    default_max_tokens: int,
    vocab_size: int | None = None,
    max_temperature: float = OPENAI_MAX_TEMPERATURE,
) -> GenerationParams:
    """Sampling and length settings shared by completions and chat, checked so that generation cannot
    fail on them: `top_k` must be below `vocab_size`, `seed` within 0 to 2**63 - 1, the temperature
    within the API's own range (OpenAI's by default)."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        max_tokens = min(default_max_tokens, max_tokens_cap)
    elif isinstance(value, bool) or not isinstance(value, int):
        raise ApiError(400, f"'{name}' must be an integer, got {shown(value)}", name)
    elif value < 1:
        raise ApiError(400, f"'{name}' must be at least 1, got {value}", name)
    elif value > max_tokens_cap:
        raise ApiError(
            400,
            f"'{name}' {shown(value)} is above this server's limit of {max_tokens_cap} (--max-tokens)",
            name,
        )
    else:
        max_tokens = value
    n = body.get("n")
    if n is not None and (isinstance(n, bool) or n != 1):
        raise ApiError(400, "only n=1 is supported", "n")
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and len(stop) <= 4 and all(isinstance(s, str) for s in stop)):
        raise ApiError(400, "'stop' must be a string or a list of up to 4 strings", "stop")
    stop = [s for s in stop if s]
    stream = body.get("stream")
    stream = False if stream is None else stream
    if not isinstance(stream, bool):
        raise ApiError(400, f"'stream' must be true or false, got {shown(stream)}", "stream")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise ApiError(400, "'stream_options' must be an object", "stream_options")
    include_usage = options.get("include_usage")
    if include_usage is not None and not isinstance(include_usage, bool):
        raise ApiError(
            400,
            f"'stream_options.include_usage' must be true or false, got {shown(include_usage)}",
            "stream_options",
        )
    seed = body.get("seed")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED
    ):
        raise ApiError(400, f"'seed' must be an integer from 0 to 2**63 - 1, got {shown(seed)}", "seed")
    for name in ("logprobs", "top_logprobs"):
        if body.get(name) not in (None, False, 0):
            raise ApiError(400, f"'{name}' is not supported by this server: leave it out", name)
    top_k_limit = vocab_size - 1 if vocab_size else 1_000_000
    return GenerationParams(
        max_tokens=max_tokens,
        temperature=float(_number(body, "temperature", 1.0, 0, max_temperature)),
        top_p=float(_number(body, "top_p", 1.0, 0, 1, low_open=True)),
        top_k=int(_number(body, "top_k", 0, 0, top_k_limit, integer=True)),
        seed=seed,
        stop=stop,
        stream=stream,
        include_usage=bool(include_usage),
        num_draft_tokens=_number(body, "num_draft_tokens", None, 0, MAX_DRAFT_TOKENS, integer=True),
    )


def check_draft(body: dict, draft: str | None):
    """A request's `draft_model` (mlx-lm's server takes one), if given, must be the one this server loaded
    (`draft`, its --draft-model; mlx-lm's "default_model" names it too): a request cannot pick another."""
    asked = body.get("draft_model")
    if asked is None or draft is not None and asked in (draft, "default_model"):
        return
    loaded = f"drafts with {draft!r} (--draft-model)" if draft else "was started without --draft-model"
    raise ApiError(
        400,
        f"'draft_model' {shown(asked)}: this server {loaded}, and a request cannot pick another",
        "draft_model",
    )


def check_model(body: dict, served: tuple[str, ...]):
    """A request's `model`, if given, must be one of the names this server answers to (the first is shown)."""
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string, got {shown(model)}: give {served[0]!r}", "model")
    if model not in served:
        raise ApiError(
            404,
            f"model {shown(model)} is not served here; this server serves {served[0]!r}",
            "model",
            "model_not_found",
            kind="not_found_error",
        )


def parse_prompt(body: dict):
    """The prompt of a completions request: text, or token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "'prompt' is empty", "prompt")
        return prompt
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt)
    ):
        return prompt
    if prompt is None:
        raise ApiError(400, "'prompt' is required", "prompt")
    raise ApiError(400, "'prompt' must be a non-empty string (or one list of token ids)", "prompt")


def parse_messages(body: dict) -> list[dict]:
    """The messages of a chat request, as {role, content} with text content."""
    messages = body.get("messages")
    if messages is None:
        raise ApiError(400, "'messages' is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ApiError(
                400, f"messages[{i}] must be an object with a role ({', '.join(ROLES)})", "messages"
            )
        content = m.get("content")
        if isinstance(content, list):  # content parts: keep the text ones
            if not all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content
            ):
                raise ApiError(400, f"messages[{i}].content parts must be text parts", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string", "messages")
        out.append({"role": m["role"], "content": content})
    if not any(m["content"] for m in out):
        raise ApiError(400, "'messages' has no content", "messages")
    return out
