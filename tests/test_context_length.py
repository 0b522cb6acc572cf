"""Generation stops at the model's maximum positions (prompt, reused cache and completion together), with
finish reason "length", in the engine, the server and the command line."""

import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.sample_utils import make_sampler

import od_moe
from od_moe import UserError
from od_moe.cli import main
from od_moe.server import create_app

PROMPT = [(7 * i + 3) % 900 + 20 for i in range(20)]  # token ids of the embedded model's vocabulary


@pytest.fixture(scope="module")
def engine():
    return od_moe.load(capacity="50%")


@pytest.fixture
def short(engine, monkeypatch):
    """The engine as if its model took 24 positions."""
    monkeypatch.setattr(engine, "max_positions", 24)
    return engine


def test_the_embedded_model_declares_2048_positions(engine):
    assert engine.max_positions == 2048


def test_generation_stops_where_the_positions_end_with_stock_tokens(short):
    responses = list(short.stream_generate(PROMPT, max_tokens=50))
    assert responses[-1].finish_reason == "length" and responses[-1].generation_tokens == 4
    model, tokenizer = mlx_lm.load(str(od_moe.DEFAULT_MODEL))
    stock = [r.token for r in mlx_lm.stream_generate(model, tokenizer, PROMPT, 4, sampler=make_sampler(0.0))]
    assert [r.token for r in responses] == stock


def test_a_prompt_that_fills_the_positions_is_refused(short):
    with pytest.raises(UserError, match="at most 24 positions"):
        list(short.stream_generate(PROMPT + [5, 6, 7, 8], max_tokens=1))


def test_tokens_in_a_reused_cache_count_towards_the_positions(short):
    cache = make_prompt_cache(short.model)
    list(short.stream_generate(PROMPT[:10], max_tokens=1, prompt_cache=cache))
    held = cache[0].offset  # the first prompt, and the token computed ahead of the one given out
    responses = list(short.stream_generate(PROMPT[10:], max_tokens=50, prompt_cache=cache))
    assert responses[-1].finish_reason == "length"
    assert responses[-1].generation_tokens == 24 - held - 10


def test_the_server_caps_requests_at_the_positions(short):
    app = create_app(short)
    try:
        client = app.test_client()
        over = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 25})
        assert over.status_code == 400 and "limit of 24" in over.get_json()["error"]["message"]
        done = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 24}).get_json()
        assert done["choices"][0]["finish_reason"] == "length"
        assert done["usage"]["completion_tokens"] == 4 and done["usage"]["total_tokens"] == 24
        full = client.post("/v1/completions", json={"prompt": PROMPT + [5, 6, 7, 8], "max_tokens": 1})
        assert full.status_code == 400 and "limit of 23" in full.get_json()["error"]["message"]
    finally:
        app.worker.stop()


def test_the_command_line_says_where_it_stopped(short, monkeypatch, capsys):
    monkeypatch.setattr(od_moe, "load", lambda *a, **k: short)
    prompt = "def f(x):\n    return x\n" * 2
    assert main(["generate", "--prompt", prompt, "--ignore-chat-template", "--max-tokens", "64"]) == 0
    assert "fill the model's 24 positions" in capsys.readouterr().err


def test_prompt_ids_are_bounded_by_the_models_vocabulary_not_the_tokenizers(engine, monkeypatch):
    """Hugging Face tokenizers leave added special tokens out of `vocab_size` (Qwen3's <|im_start|> is
    past it): an id the model's embedding has is a valid prompt token."""
    monkeypatch.setattr(type(engine.tokenizer), "vocab_size", property(lambda self: 8000), raising=False)
    app = create_app(engine)
    try:
        client = app.test_client()
        ok = client.post("/v1/completions", json={"prompt": [20, 8100], "max_tokens": 1})
        assert ok.status_code == 200, ok.get_json()
        bad = client.post("/v1/completions", json={"prompt": [20, 8192], "max_tokens": 1})
        assert bad.status_code == 400 and "(0 to 8191)" in bad.get_json()["error"]["message"]
    finally:
        app.worker.stop()
