"""Other MoE families and checkpoint layouts: tiny random models built with mlx-lm's own classes."""

import pytest

import od_moe
from conftest import od_moe_tokens, reference_tokens
from tiny_models import MIXTRAL, QWEN2_MOE, write_hf_mixtral, write_mlx_model

SHARED = __import__("pathlib").Path(__file__).resolve().parents[2] / "shared" / "models" / "tiny-qwen3-moe"
PROMPTS = ["def add(a, b):", "for i in range(10):"]


@pytest.mark.parametrize("config,attr", [(MIXTRAL, "block_sparse_moe"), (QWEN2_MOE, "mlp")])
@pytest.mark.parametrize("fraction", [0.25, 0.5])
def test_quantized_families_match_mlx_lm(tmp_path, config, attr, fraction):
    path = write_mlx_model(tmp_path / config["model_type"], config)
    reference = reference_tokens(path, PROMPTS, 32)
    engine = od_moe.load(str(path), capacity=fraction)
    assert all(attr in c.layout.module_path for c in engine.caches)
    assert len(engine.caches) == config["num_hidden_layers"]
    assert od_moe_tokens(engine, PROMPTS, 32) == reference
    stats = engine.stats()["total"]
    assert stats["misses"] > 0 and stats["lookups"] == stats["hits"] + stats["misses"]


def test_shared_experts_stay_resident(tmp_path):
    path = write_mlx_model(tmp_path / "qwen2", QWEN2_MOE)
    engine = od_moe.load(str(path), capacity=0.25)
    block = engine.model.model.layers[0].mlp
    assert block.shared_expert.gate_proj.weight.shape[0] == QWEN2_MOE["shared_expert_intermediate_size"]
    assert engine.caches[0].layout.layout == "mlx"


def test_hugging_face_mixtral_layout_matches(tmp_path):
    path = write_hf_mixtral(tmp_path / "hf-mixtral")
    reference = reference_tokens(path, PROMPTS, 32)
    engine = od_moe.load(str(path), capacity=0.25)
    assert engine.caches[0].layout.layout == "hf"
    assert od_moe_tokens(engine, PROMPTS, 32) == reference


def test_hugging_face_sharded_bundled_model_matches():
    reference = reference_tokens(SHARED, PROMPTS[:1], 32)
    engine = od_moe.load(str(SHARED), capacity=0.25)
    assert engine.caches[0].layout.layout == "hf" and len(engine.runtime.store.files) == 3
    assert od_moe_tokens(engine, PROMPTS[:1], 32) == reference
