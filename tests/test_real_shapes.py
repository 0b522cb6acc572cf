"""Checkpoints of real models' shapes (`od_moe/bench/real_shapes.py`): od-moe exact on Qwen3-30B-A3B's
shapes cut to 2 layers, the recipe deterministic, sizes from the shapes, the bundled model padded to real
widths computing what it computes, `od-moe bench --shape`."""

import json

import mlx.core as mx
import pytest
from mlx_lm import load as mlx_lm_load

import od_moe
from conftest import od_moe_tokens, reference_tokens
from od_moe.bench import real_shapes
from od_moe.errors import UserError
from od_moe.storage.store import ExpertStore

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n"]


@pytest.fixture(scope="module")
def qwen3_30b_2_layers(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("shapes")
    dest = real_shapes.default_dest(workdir, "qwen3-30b-a3b", 2)
    return real_shapes.build_shape("qwen3-30b-a3b", dest, layers=2)


def test_od_moe_exact_on_qwen3_30b_shapes(qwen3_30b_2_layers):
    """2 layers x 128 experts, hidden 2048: od-moe at 25% of experts gives stock mlx-lm's greedy tokens,
    reading experts as it goes (the routing is not degenerate: several experts miss)."""
    reference = reference_tokens(qwen3_30b_2_layers, PROMPTS, 6)
    engine = od_moe.load(str(qwen3_30b_2_layers), capacity="25%")
    assert engine.caches[0].capacity == 32 and engine.num_experts == 128
    assert od_moe_tokens(engine, PROMPTS, 6) == reference
    total = engine.stats()["total"]
    assert total["misses"] > 0 and total["experts_read"] > 32
    assert len({t for tokens in reference for t in tokens}) > 2  # the random model does not just repeat


def test_checkpoint_is_what_the_shapes_say(qwen3_30b_2_layers):
    """The config and files carry the real shapes; an expert is 2.65 MB at 4 bits, as od-moe's store reads
    it from the files and as `expert_nbytes` computes it from the shapes; a second build is skipped."""
    config = json.loads((qwen3_30b_2_layers / "config.json").read_text())
    assert (config["hidden_size"], config["moe_intermediate_size"], config["num_experts"]) == (2048, 768, 128)
    assert config["od_moe_real_shape"]["recipe"] == real_shapes.RECIPE
    assert config["quantization"]["model.layers.0.mlp.gate"] == {"group_size": 64, "bits": 8}
    assert real_shapes.expert_nbytes("qwen3-30b-a3b") == 3 * (768 * 2048 // 2 + 768 * 2048 // 64 * 4)
    assert real_shapes.expert_nbytes("qwen3-30b-a3b") / 1e6 == pytest.approx(2.65, abs=0.01)
    store = ExpertStore(qwen3_30b_2_layers)
    on_disk = sum(
        e.nbytes for n, e in store.tensors.items() if n.startswith("model.layers.0.mlp.switch_mlp.")
    )
    store.close()
    assert on_disk == 128 * real_shapes.expert_nbytes("qwen3-30b-a3b")
    files = sorted(qwen3_30b_2_layers.glob("model*.safetensors"))
    data = sum(f.stat().st_size for f in files)
    assert 0 < data - real_shapes.checkpoint_nbytes("qwen3-30b-a3b", 2) < 64 * 1024  # headers only
    full = real_shapes.checkpoint_nbytes("qwen3-30b-a3b")
    assert 16.5e9 < full < 17.2e9  # Qwen3-30B-A3B at 4 bits
    stamp = files[0].stat().st_mtime_ns
    real_shapes.build_shape("qwen3-30b-a3b", qwen3_30b_2_layers, layers=2)
    assert files[0].stat().st_mtime_ns == stamp


def test_recipe_is_deterministic_and_independent_of_layers_and_sharding(qwen3_30b_2_layers, tmp_path):
    """Another build, of 1 layer in shards of 100 MB, holds the 2-layer build's tensors bit for bit where
    they share a name (each tensor's draw depends on its name alone); norms are 1, expert weights and
    routers have the recipe's spread."""
    sharded = real_shapes.build_shape("qwen3-30b-a3b", tmp_path / "sharded", layers=1, shard_bytes=10**8)
    shards = sorted(sharded.glob("model-*.safetensors"))
    assert len(shards) > 3  # a layer's stacked expert weight (100.7 MB) stays whole
    whole, parts = mx.load(str(qwen3_30b_2_layers / "model.safetensors")), {}
    for shard in shards:
        parts.update(mx.load(str(shard)))
    assert sorted(parts) == sorted(k for k in whole if not k.startswith("model.layers.1."))
    assert all(mx.array_equal(parts[k], whole[k]) for k in parts)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert mx.all(whole["model.layers.1.post_attention_layernorm.weight"] == 1).item()
    for module, rows, bits, std in (("switch_mlp.up_proj", 5, 4, 0.02), ("gate", slice(None), 8, 0.5)):
        arrays = [whole[f"model.layers.1.mlp.{module}.{k}"][rows] for k in ("weight", "scales", "biases")]
        values = mx.dequantize(*arrays, group_size=64, bits=bits).astype(mx.float32)  # expert 5, the router
        assert abs(mx.std(values).item() - std) < std / 50


def test_mxfp4_rounds_to_the_nearest_e2m1_value():
    """gpt-oss's experts: every element dequantizes to the E2M1 value nearest to it at its group's scale
    (saturating at 6), the scale puts the group's largest element in [4, 8)."""
    w = mx.random.normal((16, 256), key=mx.random.key(3)) * 0.02
    w[0, :32] = mx.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -7.5] * 4)  # ties, saturation
    packed, scales = real_shapes.mxfp4_quantize(w)
    assert packed.shape == (16, 32) and scales.dtype == mx.uint8
    back = mx.dequantize(packed, scales, group_size=32, bits=4, mode="mxfp4").astype(mx.float32)
    scale = mx.repeat(mx.power(2.0, scales.astype(mx.float32) - 127), 32, axis=-1)
    grid = mx.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    nearest = grid[mx.argmin(mx.abs((mx.abs(w) / scale)[..., None] - grid), axis=-1)] * mx.sign(w) * scale
    assert mx.array_equal(back[1:], nearest[1:])  # random values: no ties
    assert back[0, :8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -6.0]  # ties to the even code
    largest = (mx.abs(w) / scale).reshape(-1, 32).max(axis=-1)
    assert mx.all((largest >= 4) & (largest < 8)).item()


@pytest.fixture(scope="module")
def bundled_real_widths(tmp_path_factory):
    return real_shapes.build_shape(real_shapes.PADDED, tmp_path_factory.mktemp("padded") / "padded")


def test_bundled_real_widths_compute_what_the_bundled_model_computes(bundled_real_widths):
    """The bundled model padded to hidden 2048 and experts 768 wide: the same greedy tokens and logits
    close (float32, as od-moe computes on the CPU; the rescaled norm weights' bfloat16 rounding moves the
    logits by up to 0.34 of 18 on the bench's prompts: `real_shapes._Padding`)."""
    padded = bundled_real_widths
    config = json.loads((padded / "config.json").read_text())
    assert (config["hidden_size"], config["moe_intermediate_size"]) == (2048, 768)
    assert real_shapes.expert_nbytes(real_shapes.PADDED) == real_shapes.expert_nbytes("qwen3-30b-a3b")
    logits = []
    for path in (od_moe.DEFAULT_MODEL, padded):
        model, tokenizer = mlx_lm_load(str(path))
        model.set_dtype(mx.float32)
        logits.append(model(mx.array(tokenizer.encode(PROMPTS[0]))[None])[0].astype(mx.float32))
    assert model.model.embed_tokens.weight.shape == (8192, 2048 // 8)
    assert mx.abs(logits[0] - logits[1]).max().item() < 0.5 < 10 < mx.abs(logits[0]).max().item()
    assert mx.array_equal(logits[0].argmax(-1), logits[1].argmax(-1))
    assert reference_tokens(padded, PROMPTS, 4) == reference_tokens(od_moe.DEFAULT_MODEL, PROMPTS, 4)


def test_the_padded_predictor_predicts_on_the_copy_what_it_predicts_on_the_bundled_model(bundled_real_widths):
    """`pad_predictor`: the bundled shadow network on the padded model's own recorded hidden states and router
    logits (taps of the per-layer path) ranks the experts of every target layer as the bundled network
    ranks them on the bundled model's, up to the copy's rounding; its next-use head's x term likewise."""
    from od_moe.bench.prefetch import _predictor_for
    from od_moe.bench.real_widths import pad_predictor
    from od_moe.training.record import record_sequence

    tops, x_terms = [], []
    for path in (od_moe.DEFAULT_MODEL, bundled_real_widths):
        engine = od_moe.load(str(path), two_tier=False, prefetch="none")
        engine.model.set_dtype(mx.float32)
        predictor = _predictor_for(engine.identity)
        if path != od_moe.DEFAULT_MODEL:
            predictor = pad_predictor(predictor, 2048)
        predictor.attach_routers(*engine.routers())
        rows = record_sequence(engine, engine.encode(PROMPTS[0] + PROMPTS[1]))
        x, logits = mx.array(rows["features"].astype("float32")), mx.array(rows["logits"].astype("float32"))
        tops.append([predictor.predict_topk(s, x[:, s], logits[:, s], 8) for s in range(7)])
        x_terms.append(predictor.next_use.x_term(3, x[:, 3]))
    assert x.shape[-1] == 2048 and mx.all(x[..., 192:] == 0).item()
    same = sum(mx.sum(mx.sort(a, -1) == mx.sort(b, -1)).item() for a, b in zip(*tops))
    assert same >= 0.97 * sum(a.size for a in tops[0])
    assert mx.abs(x_terms[0] - x_terms[1]).max().item() < 0.05 * mx.abs(x_terms[0]).max().item()


def test_user_mistakes_say_what_to_do():
    with pytest.raises(UserError, match="unknown shape 'qwen9'.*qwen3-30b-a3b"):
        real_shapes.shape_config("qwen9")
    with pytest.raises(UserError, match="deepseek-v2-lite takes 2 to 27 layers"):
        real_shapes.shape_config("deepseek-v2-lite", layers=1)
    with pytest.raises(UserError, match="leave out the layer count"):
        real_shapes.describe(real_shapes.PADDED, layers=2)


def test_bench_shape_flag_builds_and_reports(qwen3_30b_2_layers, capsys):
    """`od-moe bench --shape NAME --shape-layers N` finds the complete checkpoint in --workdir (built by the
    fixture at the same place) and reports it; a wrong name fails in one line."""
    from od_moe.cli import main

    workdir = qwen3_30b_2_layers.parent
    args = ["bench", "--shape", "qwen3-30b-a3b", "--shape-layers", "2", "--workdir", str(workdir)]
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["path"] == str(qwen3_30b_2_layers)
    assert (report["layers"], report["experts"], report["top_k"]) == (2, 128, 8)
    assert report["bytes"] == real_shapes.checkpoint_nbytes("qwen3-30b-a3b", 2)
    assert main(args) == 0
    assert "qwen3-30b-a3b: " in capsys.readouterr().out
    assert main(["bench", "--shape", "qwen9", "--workdir", str(workdir)]) == 2
    assert "unknown shape" in capsys.readouterr().err
    assert main(["bench", "--shape-layers", "2", "--workdir", str(workdir)]) == 2
    facts = real_shapes.describe("gpt-oss-20b")  # from the shapes alone: nothing is built
    assert (facts["experts"], facts["top_k"], facts["layers"]) == (32, 4, 24)
    assert facts["expert_bytes"] == 3 * (2880 * 2880 // 2 + 2880 * 2880 // 32 + 2880 * 2)  # MXFP4 + biases
