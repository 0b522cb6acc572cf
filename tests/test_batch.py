"""Batched decoding (`od_moe/generation/batch_generate.py`): several prompts in one pass give the tokens of
stock mlx-lm's own `batch_generate` (every expert resident) on the embedded model and on another family's tiny
model; a batch reads each missing expert once for all its sequences; the ledger keeps passes, positions and
tokens apart; mistakes are UserErrors."""

import mlx_lm
import pytest
from mlx_lm.generate import batch_generate as mlx_lm_batch_generate

import od_moe
from od_moe import UserError
from od_moe.memory import backend
from tiny_models import FAMILIES, write_mlx_model

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Config:\n    def __init__(self, path"]
TOKENS = 16


def stock_batch(path, prompts, max_tokens):
    """Stock mlx-lm's `batch_generate` token ids, with the dtype od-moe computes in on this backend."""
    model, tokenizer = mlx_lm.load(str(path))
    target = backend.compute_dtype("auto")
    if target is not None:
        model.set_dtype(target)
    ids = [p if isinstance(p, list) else tokenizer.encode(p) for p in prompts]
    return mlx_lm_batch_generate(model, tokenizer, ids, max_tokens=max_tokens, return_token_ids=True)


@pytest.fixture(scope="module")
def reference():
    return stock_batch(od_moe.DEFAULT_MODEL, PROMPTS, TOKENS)


@pytest.mark.parametrize("capacity", ["12.5%", "25%", "50%"])
def test_a_batch_gives_stock_mlx_lms_batch_tokens(capacity, reference):
    engine = od_moe.load(capacity=capacity)
    got = engine.batch_generate(PROMPTS, max_tokens=TOKENS)
    assert got.token_ids == reference.token_ids and got.texts == reference.texts
    stats = engine.stats()
    passes = stats["passes"]["decode"]
    # every sequence ran to its limit here: one pass more than tokens (mlx-lm computes a token ahead)
    assert passes == TOKENS + 1 and stats["positions"]["decode"] == len(PROMPTS) * passes
    assert stats["generated_tokens"] == len(PROMPTS) * TOKENS == got.stats.generation_tokens
    total = stats["total"]
    assert total["lookups"] == total["hits"] + total["misses"] > 0


def test_a_three_tier_batch_gives_stock_mlx_lms_batch_tokens(reference):
    """Past the host's memory a batch's decode passes are flagged and run again where one sequence met an
    expert on disk (without stopping early: a batch's caches do not say how far each was written)."""
    from od_moe.two_tier.settings import TwoTierSettings

    engine = od_moe.load(capacity=0.25, two_tier=True, path_settings=TwoTierSettings(host_experts=16))
    got = engine.batch_generate(PROMPTS, max_tokens=TOKENS)
    assert got.token_ids == reference.token_ids
    disk = engine.stats()["tiers"]["disk"]
    assert disk["reruns"] > 0 and disk["stopped_passes"] == 0


@pytest.mark.parametrize("capacity,mode", [(0, True), (0.25, True), (0.25, "lru")])
def test_a_two_tier_batch_gives_stock_mlx_lms_batch_tokens(capacity, mode, reference):
    """Two-tier mode batches too: lanes of every sequence whose expert has no slot are read in place (a
    batch's union of experts overflows 16 slots at 25%), or copied into device-kept rows (`lru`: three
    sequences' 24 lanes padded to 32 candidates); nothing is read from disk, and the counts add up."""
    engine = od_moe.load(capacity=capacity, two_tier=mode)
    got = engine.batch_generate(PROMPTS, max_tokens=TOKENS)
    assert got.token_ids == reference.token_ids
    stats = engine.stats()
    total = stats["total"]
    assert total["lookups"] == total["hits"] + total["misses"] > 0
    assert total["bytes_read"] == 0 and (total["hits"] > 0) == (capacity > 0)


def test_a_batch_past_64_lanes_keeps_rows_on_the_device():
    """Nine sequences route 72 lanes a layer through device-kept rows (a call of that many lanes copies:
    test_kept_rows.py): the tokens are stock mlx-lm's batch's, and nothing is read from disk."""
    prompts = PROMPTS * 3
    engine = od_moe.load(capacity=0.25, two_tier="lru")
    got = engine.batch_generate(prompts, max_tokens=8)
    assert got.token_ids == stock_batch(od_moe.DEFAULT_MODEL, prompts, 8).token_ids
    total = engine.stats()["total"]
    assert total["experts_loaded"] > 0 and total["decode"]["hits"] > 0 and total["bytes_read"] == 0


def test_streamed_batch_tokens_come_with_their_prompt_index(reference):
    engine = od_moe.load(capacity="25%")
    tokens, finished = [[] for _ in PROMPTS], [None] * len(PROMPTS)
    for step in engine.stream_batch_generate(PROMPTS, max_tokens=TOKENS):
        assert len({t.index for t in step}) == len(step)  # one token per running sequence a pass
        for t in step:
            assert finished[t.index] is None
            tokens[t.index].append(t.token)
            finished[t.index] = t.finish_reason
    assert tokens == reference.token_ids and finished == ["length"] * len(PROMPTS)


def test_a_batch_reads_each_missing_expert_once_for_all_its_sequences():
    """Four copies of one prompt route alike: the batch reads what one of them reads alone."""
    alone = od_moe.load(capacity="25%")
    text = alone.generate(PROMPTS[0], max_tokens=TOKENS)
    together = od_moe.load(capacity="25%")
    got = together.batch_generate([PROMPTS[0]] * 4, max_tokens=TOKENS)
    assert got.texts == [text] * 4
    a, b = alone.stats()["total"], together.stats()["total"]
    assert b["experts_read"] == a["experts_read"] and b["bytes_read"] == a["bytes_read"]
    assert b["lookups"] == 4 * a["lookups"]


def test_another_family_batches_exactly(tmp_path):
    path = write_mlx_model(tmp_path / "mixtral", FAMILIES["mixtral"])
    prompts = [[1, 17, 300, 42, 9, 88], [5, 600, 23, 23, 7], [9, 9, 400]]
    reference = stock_batch(path, prompts, 10)
    engine = od_moe.load(str(path), capacity="25%")
    assert engine.batch_generate(prompts, max_tokens=10).token_ids == reference.token_ids


def test_per_prompt_limits_and_seeds():
    engine = od_moe.load(capacity="50%")
    got = engine.batch_generate(PROMPTS[:2], max_tokens=[3, 5], temperature=0.8, seed=[1, 2])
    assert [len(t) for t in got.token_ids] == [3, 5]
    again = engine.batch_generate(PROMPTS[:2], max_tokens=[3, 5], temperature=0.8, seed=[1, 2])
    assert again.token_ids == got.token_ids  # each sequence samples with its own seeded key


@pytest.mark.parametrize(
    "prompts,kwargs,message",
    [
        ([], {}, "list of prompts"),
        ("one string", {}, "list of prompts"),
        (["ok", ""], {}, "prompt 1 is empty"),
        (["a", "b"], {"max_tokens": [1]}, "one per prompt"),
        (["a"], {"max_tokens": 0}, "positive integer"),
        (["a", "b"], {"seed": [1]}, "one seed or one per prompt"),
    ],
)
def test_mistakes_are_user_errors(prompts, kwargs, message):
    engine = od_moe.load(capacity="50%")
    with pytest.raises(UserError, match=message):
        engine.batch_generate(prompts, **kwargs)


def test_the_oracle_is_refused_for_a_batch():
    engine = od_moe.load(capacity="50%")
    engine.configure_prefetch("oracle", oracle_trace=engine.record_routing("x = 1", 2))
    with pytest.raises(UserError, match="oracle"):
        engine.batch_generate(["a", "b"])
