"""Per-request token samplers: sampling settings checked up front, and a random key of the request's own.

mlx-lm's samplers draw from MLX's global random state inside compiled functions; one that fails (a top_k
the vocabulary cannot satisfy) leaves that state unusable and every later sampled request fails too. Here
the settings are checked before anything runs, and a sampler splits its own key (from the seed, or fresh
entropy), so a request's sampling neither depends on nor disturbs any other's. Not here: the generation
loop (mlx-lm's) or the server's request parsing (`server/requests.py`).
"""

import math
import numbers
import secrets

import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from ..errors import UserError

MAX_SEED = 2**63 - 1
# Temperature ranges as each API's specification states them: OpenAI's (also the command line's) and
# Anthropic's Messages API's. The Python API keeps a wide range of its own, as mlx-lm sets none.
OPENAI_MAX_TEMPERATURE = 2.0
ANTHROPIC_MAX_TEMPERATURE = 1.0
MAX_TEMPERATURE = 100.0


def out_of_range(name: str, shown: str, low, high, low_open: bool = False) -> str:
    """The one wording of a number outside its range (`shown`: the value as the message shows it), on the
    command line, in Python and over HTTP."""
    lower = f"above {low:g} and at most" if low_open else f"from {low:g} to"
    return f"{name} must be a number {lower} {high:g}, got {shown}"


def vocab_size_of(model) -> int | None:
    """The number of logits the model produces per token, from its config (None when it does not say)."""
    args = getattr(model, "args", None)
    text_config = getattr(args, "text_config", None)
    size = getattr(args, "vocab_size", None) or getattr(text_config, "vocab_size", None)
    if size is None and isinstance(text_config, dict):
        size = text_config.get("vocab_size")
    return int(size) if size else None


def _number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def check_sampling(
    temperature=0.0,
    top_p=1.0,
    top_k=0,
    min_p=0.0,
    seed=None,
    vocab_size: int | None = None,
    max_temperature: float = MAX_TEMPERATURE,
) -> None:
    """Raise a UserError naming the first setting that cannot be sampled with."""
    if not _number(temperature) or not 0 <= temperature <= max_temperature:
        raise UserError(out_of_range("temperature", repr(temperature), 0, max_temperature))
    if not _number(top_p) or not 0 < top_p <= 1:
        raise UserError(out_of_range("top_p", repr(top_p), 0, 1, low_open=True))
    if not _number(min_p) or not 0 <= min_p <= 1:
        raise UserError(out_of_range("min_p", repr(min_p), 0, 1))
    limit = f" and below the vocabulary size {vocab_size}" if vocab_size else ""
    if (
        isinstance(top_k, bool)
        or not isinstance(top_k, numbers.Integral)
        or top_k < 0
        or (vocab_size and int(top_k) >= vocab_size)  # `numbers.Integral` declares only < and <=
    ):
        raise UserError(f"top_k must be an integer >= 0 (0: off){limit}, got {top_k!r}")
    if seed is not None and (
        isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= int(seed) <= MAX_SEED
    ):
        raise UserError(f"seed must be an integer from 0 to 2**63 - 1, got {seed!r}")


def make_sampler(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, seed=None, vocab_size: int | None = None):
    """A sampler of log-probabilities for one request (greedy at temperature 0), checked first."""
    check_sampling(temperature, top_p, top_k, min_p, seed, vocab_size)
    if temperature == 0:
        return lambda logprobs: mx.argmax(logprobs, axis=-1)
    key = [mx.random.key(secrets.randbits(63) if seed is None else int(seed))]
    scale = 1.0 / float(temperature)

    def sampler(logprobs: mx.array) -> mx.array:
        if 0 < top_p < 1:
            logprobs = apply_top_p(logprobs, float(top_p))
        if min_p:
            logprobs = apply_min_p(logprobs, float(min_p))
        if top_k:
            logprobs = apply_top_k(logprobs, int(top_k))
        key[0], draw = mx.random.split(key[0])
        return mx.random.categorical(logprobs * scale, key=draw)

    return sampler
