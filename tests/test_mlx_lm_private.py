"""mlx-lm's private names od-moe relies on (`od_moe/model_surgery/mlx_lm_private.py`) are still where it reads
them: an mlx-lm release that moves one fails here by name."""

import mlx.core as mx
from mlx_lm.generate import BatchGenerator
from mlx_lm.models.cache import KVCache, make_prompt_cache

import od_moe
from od_moe.model_surgery import mlx_lm_private


def test_every_kv_cache_is_a_base_cache():
    engine = od_moe.load(capacity=8)
    caches = make_prompt_cache(engine.model)
    assert caches and all(isinstance(c, mlx_lm_private.BaseCache) for c in caches)
    assert issubclass(KVCache, mlx_lm_private.BaseCache)


def test_a_config_names_its_model_classes():
    model_class, args_class = mlx_lm_private.model_classes({"model_type": "qwen3_moe"})
    assert model_class.__module__ == "mlx_lm.models.qwen3_moe" and args_class.__name__ == "ModelArgs"


def test_hub_downloads_are_a_function_of_a_name():
    assert callable(mlx_lm_private.download) and mlx_lm_private.download.__module__ == "mlx_lm.utils"


def test_a_batch_generator_step_leaves_its_next_tokens_readable():
    """The server reads a joining sequence's first token from the step that computed it
    (`server/batching.py`): the generator must keep the step's sequences and tokens where it reads them."""
    engine = od_moe.load(capacity=8)
    generator = BatchGenerator(engine.forward, stop_tokens=[[t] for t in engine.tokenizer.eos_token_ids])
    (uid,) = generator.insert([engine.tokenizer.encode("def add(a, b):")], max_tokens=[4])
    seen = []
    for _ in range(3):  # the prompt's prefill, then the step whose pass computes its first token
        generator.next()
        found = mlx_lm_private.pending_tokens(generator)
        assert found is not None, (
            "mlx-lm no longer keeps _generation_batch._next_tokens: see model_surgery/mlx_lm_private.py"
        )
        seen.append(found)
    uids, tokens = seen[-1]
    assert uids == [uid] and isinstance(tokens, mx.array) and tokens.size == 1


def test_no_other_module_reads_a_private_name_of_mlx_lm():
    import re
    from pathlib import Path

    root = Path(od_moe.__file__).resolve().parent.parent
    private = re.compile(
        r"from mlx_lm[\w.]* import [^\n]*\b_[a-z]\w*"  # a private name imported
        r"|mlx_lm(\.\w+)*\._[a-z]"  # or reached as an attribute
        r"|\"_(generation_batch|next_tokens)\""  # or read with getattr
    )
    readers = [
        str(path.relative_to(root))
        for folder in ("od_moe", "predictor", "training")
        for path in (root / folder).rglob("*.py")
        if path.name != "mlx_lm_private.py" and private.search(path.read_text())
    ]
    assert readers == []
