import pytest
from mlx_lm import load as mlx_lm_load
from mlx_lm import stream_generate as mlx_lm_stream_generate

import od_moe
from od_moe import backend

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n", "class Stack:\n    def __init__(self):"]
NEW_TOKENS = 64


def reference_tokens(path, prompts, max_tokens, dtype="auto"):
    """Greedy tokens from stock mlx-lm, with the same backend cast od-moe applies (float32 on CPU)."""
    model, tokenizer = mlx_lm_load(str(path))
    target = backend.compute_dtype(dtype)
    if target is not None:
        model.set_dtype(target)
    return [
        [r.token for r in mlx_lm_stream_generate(model, tokenizer, p, max_tokens=max_tokens)] for p in prompts
    ]


def od_moe_tokens(engine, prompts, max_tokens):
    return [[r.token for r in engine.stream_generate(p, max_tokens=max_tokens)] for p in prompts]


@pytest.fixture(scope="session")
def bundled_reference():
    return reference_tokens(od_moe.DEFAULT_MODEL, PROMPTS, NEW_TOKENS)
