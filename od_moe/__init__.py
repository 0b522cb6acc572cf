"""od-moe: run Mixture-of-Experts models larger than memory with MLX.

A bounded cache of experts stays resident per MoE layer; the rest are read from SSD when needed.

    import od_moe
    engine = od_moe.load(capacity=0.25)          # the embedded default model, 25% of experts resident
    print(engine.generate("def fib(n):", max_tokens=32))
    print(engine.stats()["total"]["hit_rate"])

    od_moe.generate("import os", max_tokens=16)  # one-liner on the embedded default
"""

import os
from collections.abc import Generator

# predictor/ and training/ sit beside this folder in a source checkout and install as od_moe.predictor and
# od_moe.training (pyproject's package-dir). Run from a checkout (`python3 -m od_moe` there puts the checkout
# ahead of any installed copy on sys.path), this folder has neither: they are found beside it instead.
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if not os.path.isdir(os.path.join(__path__[0], "predictor")) and os.path.isfile(
    os.path.join(_checkout, "predictor", "__init__.py")
):
    __path__.append(_checkout)

# first to import MLX: says which backend to install where none runs
from .memory import backend  # noqa: E402, F401, I001
from .engine import DEFAULT_MODEL, DEFAULT_PREDICTOR, Engine, load  # noqa: E402 (after the path above)
from .errors import ExpertReadError, UserError  # noqa: E402
from .generation.prompt_lookup import PromptLookup  # noqa: E402
from .prefetch.governor import PrefetchSettings  # noqa: E402
from .storage.model_files import DEFAULT_DRAFT  # noqa: E402

__all__ = [
    "load",
    "generate",
    "stream_generate",
    "Engine",
    "PrefetchSettings",
    "PromptLookup",
    "UserError",
    "ExpertReadError",
    "DEFAULT_MODEL",
    "DEFAULT_PREDICTOR",
    "DEFAULT_DRAFT",
]
__version__ = "0.1.0"

_engines = {}


def _engine_for(model, load_kwargs) -> Engine:
    if isinstance(model, Engine):
        return model
    key = (str(model), tuple(sorted(load_kwargs.items())))
    if key not in _engines:
        _engines[key] = load(model, **load_kwargs)
    return _engines[key]


def stream_generate(
    prompt, model=None, *, capacity=None, memory_budget=None, miss_policy="load", **kwargs
) -> Generator:
    """Stream a completion of `prompt`; `model` is an `Engine`, a model path, or None (embedded default);
    kwargs as `Engine.stream_generate` takes them (`draft_model=`, `num_draft_tokens=` too).

    Engines loaded here are kept for the next call with the same arguments.
    """
    engine = _engine_for(
        model, {"capacity": capacity, "memory_budget": memory_budget, "miss_policy": miss_policy}
    )
    return engine.stream_generate(prompt, **kwargs)


def generate(prompt, model=None, *, capacity=None, memory_budget=None, miss_policy="load", **kwargs) -> str:
    """The completion of `prompt` as a string; arguments as `stream_generate`."""
    return "".join(
        r.text
        for r in stream_generate(
            prompt, model, capacity=capacity, memory_budget=memory_budget, miss_policy=miss_policy, **kwargs
        )
    )
