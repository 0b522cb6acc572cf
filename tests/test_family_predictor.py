"""The shadow predictor trains and evaluates on families other than the bundled one: its inputs and outputs
come from each model's own dimensions, and routers that return (ids, scores) give logits too."""

import json
import sysconfig
from pathlib import Path

import pytest

import od_moe
from conftest import od_moe_tokens, reference_tokens
from od_moe import PrefetchSettings
from od_moe.training.pipeline import eval_predictor_job, train_predictor_job
from tiny_models import FAMILIES, write_mlx_model

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _four_moe_layers(name: str) -> dict:
    """The family's tiny model with two more layers and the bundled tokenizer's vocabulary (text data)."""
    config = dict(FAMILIES[name], vocab_size=8192, num_hidden_layers=FAMILIES[name]["num_hidden_layers"] + 2)
    if "layer_types" in config:
        config["layer_types"] = (config["layer_types"] * 3)[: config["num_hidden_layers"]]
    if name == "gemma4_text":
        config["vocab_size_per_layer_input"] = 8192
    return config


# DeepSeek-V3: a sigmoid MoEGate returning (ids, scores); Gemma 4: a router on the decoder layer, GeGLU.
@pytest.mark.parametrize("name", ["deepseek_v3", "gemma4_text"])
def test_predictor_trains_and_evaluates(tmp_path, name):
    path = write_mlx_model(tmp_path / name, _four_moe_layers(name))
    out = tmp_path / "predictor"
    report = train_predictor_job(
        model=str(path),
        data=str(STDLIB / "json"),
        eval_data=str(STDLIB / "textwrap.py"),
        out=str(out),
        lookahead=2,
        rank=16,
        max_tokens=512,
        eval_tokens=256,
        epochs=1,
    )
    config = json.loads((out / "config.json").read_text())
    assert (config["num_layers"], config["num_experts"], config["hidden_size"]) == (4, 16, 64)
    for d in ("1", "2"):
        assert 0 < report["lookahead"][d]["recall_at_k"] <= report["lookahead"][d]["recall_at_2k"] <= 1
    again = eval_predictor_job(str(out), str(STDLIB / "textwrap.py"), model=str(path), max_tokens=128)
    assert again["tokens"] == 128 and set(again["lookahead"]) == {"1", "2"}
    # the predictor fits the model it was trained on and generation stays exact with it attached
    # and prefetches with it: the router tap's logits feed it for routers that return (ids, scores) too
    engine = od_moe.load(str(path), capacity=0.25, predictor=out, prefetch="none")
    engine.configure_prefetch(  # min_score 0: a few hundred training tokens make no confident predictor
        "predictor", settings=PrefetchSettings(timed_checks=False, min_score=0.0)
    )
    prompts = ["def add(a, b):"]
    assert od_moe_tokens(engine, prompts, 8) == reference_tokens(path, prompts, 8)
    assert engine.stats()["prefetch"]["issued"] > 0
