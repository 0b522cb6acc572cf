"""Every mlx-lm MoE family od-moe offloads, exact: tiny random 4-bit models built with mlx-lm's own classes,
greedy tokens equal to stock mlx-lm's at 25% and 12.5% of experts resident with next-gate prefetch on;
Hugging Face per-expert checkpoints, sharded with an index, for three families; and the refusals."""

import json
import struct

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten
from mlx_lm.models.cache import make_prompt_cache

import od_moe
from conftest import od_moe_tokens, reference_tokens
from od_moe.errors import UserError
from od_moe.per_layer import PerLayerSettings
from od_moe.per_layer import optimistic as optimistic_module
from od_moe.prefetch.governor import PrefetchSettings
from od_moe.storage.store import ExpertStore
from tiny_models import DBRX, FAMILIES, write_hf_per_expert, write_mlx_model

PROMPTS = [[1, 17, 300, 42, 9, 88], [5, 600, 23, 23, 7]]  # token ids: the tiny models' vocabulary is 1024
NEW_TOKENS = 12
BIAS_NAMES = ("e_score_correction_bias", "expert_bias")  # routing-only biases

# What each family's tiny model exercises beyond a softmax-routed SwiGLU switch (see tiny_models.FAMILIES).
FEATURES = {
    "qwen3_moe": set(),
    "qwen3_next": {"hybrid", "shared-experts"},
    "qwen2_moe": {"shared-experts"},
    "deepseek_v2": {"grouped-routing", "dense-leading", "shared-experts"},
    "deepseek_v3": {"sigmoid-gate", "biased-routing", "grouped-routing", "dense-leading", "shared-experts"},
    "glm4_moe": {"sigmoid-gate", "biased-routing", "dense-leading", "shared-experts"},
    "gpt_oss": {"expert-biases", "non-swiglu"},
    "olmoe": set(),
    "mixtral": set(),
    "phimoe": set(),
    "granitemoe": set(),
    "llama4": {"sigmoid-gate", "shared-experts"},
    "minimax": {"sigmoid-gate", "biased-routing"},
    "hunyuan": {"shared-experts"},
    "ernie4_5_moe": {"sigmoid-gate", "dense-leading", "shared-experts"},
    "dots1": {"sigmoid-gate", "biased-routing", "grouped-routing", "dense-leading", "shared-experts"},
    "bailing_moe": {"sigmoid-gate", "biased-routing", "grouped-routing", "dense-leading", "shared-experts"},
    "jamba": {"hybrid"},
    "lfm2_moe": {"hybrid", "sigmoid-gate", "biased-routing", "dense-leading"},
    "gemma4_text": {"non-swiglu"},
    "nemotron_h": {"hybrid", "non-swiglu", "switch-mlp", "sigmoid-gate", "biased-routing", "shared-experts"},
}


def _layers(config):
    config = config.get("text_config", config)
    return len(config.get("hybrid_override_pattern") or ()) or config["num_hidden_layers"]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, model folder, stock mlx-lm's greedy tokens), one tiny model per family."""
    name = request.param
    path = write_mlx_model(tmp_path_factory.mktemp(name) / name, FAMILIES[name])
    return name, path, reference_tokens(path, PROMPTS, NEW_TOKENS)


def test_every_required_feature_is_exercised():
    required = {"expert-biases", "shared-experts", "grouped-routing", "biased-routing", "sigmoid-gate"}
    required |= {"dense-leading", "hybrid", "non-swiglu", "switch-mlp"}
    assert required <= set().union(*FEATURES.values())
    assert set(FEATURES) == set(FAMILIES)


@pytest.mark.parametrize("fraction", [0.25, 0.125])
def test_family_matches_mlx_lm(family, fraction):
    name, path, reference = family
    engine = od_moe.load(str(path), capacity=fraction)
    # min_score 0: a random router's predictions are never confident, and prefetch must run to be tested
    engine.configure_prefetch("next-gate", settings=PrefetchSettings(timed_checks=False, min_score=0.0))
    assert engine.capacity == max(1, round(fraction * 16)) and engine.top_k > 0
    assert od_moe_tokens(engine, PROMPTS, NEW_TOKENS) == reference, name
    stats = engine.stats()
    assert stats["total"]["misses"] > 0 and stats["prefetch"]["issued"] > 0
    features = FEATURES[name]
    parts = {(p.proj, p.name) for p in engine.caches[0].layout.parts}
    assert (("gate_proj", "bias") in parts) == ("expert-biases" in features)
    assert (("fc1", "weight") in parts) == ("switch-mlp" in features)
    if "dense-leading" in features:
        assert len(engine.caches) < _layers(FAMILIES[name])
    if "biased-routing" in features:  # the score corrections were drawn at random, not left at zero
        biases = [v for k, v in tree_flatten(engine.model.parameters()) if k.endswith(BIAS_NAMES)]
        assert biases and all(mx.abs(b).max().item() > 0 for b in biases)


def test_family_optimistic_passes_match_mlx_lm(family, monkeypatch):
    """Optimistic decode passes, forced for every decode pass, give stock mlx-lm's tokens in every family.
    They run wherever every KV cache can be trimmed: always with plain KV caches, never with a hybrid's
    state caches (sliding-window caches stop being trimmable once they wrap)."""
    name, path, reference = family
    monkeypatch.setattr(optimistic_module, "OPTIMISTIC_BELOW", 2.0)
    engine = od_moe.load(
        str(path), capacity=0.75, prefetch="none", path_settings=PerLayerSettings(optimistic=True)
    )
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == reference[:1], name
    stats = engine.stats()
    passes = stats["optimistic"]["passes"]
    kinds = {type(c).__name__ for c in make_prompt_cache(engine.model)}
    if kinds == {"KVCache"}:
        assert passes == stats["positions"]["decode"], name  # every decode pass
    if "hybrid" in FEATURES[name]:
        assert passes == 0, name


def test_family_split_rounds_match_mlx_lm(family):
    """A decode layer that misses, computed in two rounds (resident experts while the missing ones are
    read, then those), gives stock mlx-lm's tokens in every family, shared experts and biases included."""
    name, path, reference = family
    # split rounds: the default only for experts of 1 MiB or more
    engine = od_moe.load(
        str(path), capacity=0.5, prefetch="none", path_settings=PerLayerSettings(split_on_miss=True)
    )
    assert od_moe_tokens(engine, PROMPTS[:1], NEW_TOKENS) == reference[:1], name
    assert engine.stats()["total"]["misses"] > 0


def test_dbrx_is_refused_in_one_line(tmp_path):
    """DBRX's experts are separate MLPs that mlx-lm runs one by one: no stack to offload."""
    path = write_mlx_model(tmp_path / "dbrx", DBRX, quantize=False)
    with pytest.raises(UserError) as refused:
        od_moe.load(str(path), capacity=0.5)
    message = str(refused.value)
    assert "\n" not in message and "ffn.experts" in message and "one by one" in message


@pytest.mark.parametrize("name", ["qwen3_moe", "olmoe", "deepseek_v3", "mixtral"])
def test_hugging_face_per_expert_shards_match(tmp_path, name):
    path = write_hf_per_expert(tmp_path / name, FAMILIES[name], shards=3)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert (
        any(".experts.3." in k for k in index["weight_map"]) and len(set(index["weight_map"].values())) == 3
    )
    reference = reference_tokens(path, PROMPTS, NEW_TOKENS)
    engine = od_moe.load(str(path), capacity=0.25, prefetch="next-gate")
    assert engine.caches[0].layout.layout == "hf" and len(engine.runtime.store.files) == 3
    assert od_moe_tokens(engine, PROMPTS, NEW_TOKENS) == reference


def test_hugging_face_sharded_bundled_model_matches(tmp_path):
    """The packaged model, dequantized and written as a sharded per-expert checkpoint (nothing outside the
    repository is read)."""
    path = write_hf_per_expert(tmp_path / "hf-bundled", source=od_moe.DEFAULT_MODEL, shards=3)
    prompts = ["def add(a, b):"]
    reference = reference_tokens(path, prompts, 24)
    engine = od_moe.load(str(path), capacity=0.25)
    assert engine.caches[0].layout.layout == "hf" and len(engine.runtime.store.files) == 3
    assert od_moe_tokens(engine, prompts, 24) == reference


def test_fp8_experts_are_refused(tmp_path):
    """Experts stored in a dtype od-moe cannot read exactly (FP8, whose scales mlx-lm applies) are refused."""
    path = write_hf_per_expert(tmp_path / "fp8", FAMILIES["mixtral"], shards=1)
    shard = next(path.glob("model-*.safetensors"))
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    for key, meta in header.items():
        if ".experts." in key:
            meta["dtype"] = "F8_E4M3"
    text = json.dumps(header).encode()
    shard.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    parts = {"gate_proj": ["weight"], "up_proj": ["weight"], "down_proj": ["weight"]}
    with pytest.raises(UserError, match="stored as F8_E4M3.*mlx_lm.convert"):
        ExpertStore(path).block_layout("model.layers.0.block_sparse_moe.switch_mlp", parts, 16)
