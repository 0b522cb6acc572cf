"""A model split over two ranks (`distributed/rank_split.py`), launched with `mlx.launch` on loopback (ring
backend, CPU): greedy tokens equal single-process stock mlx-lm's at 25% and 100% of experts resident, on the
bundled model and on a tiny random Mixtral; each rank holds, and reads from disk, only its own layers'
experts; a rank started with another budget is refused at start in one line; `od-moe generate` prints on
rank 0. Faults and `serve` across ranks: `test_pipeline_faults.py`."""

import json
import re
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest

import od_moe
from conftest import reference_tokens
from od_moe.distributed.local_ranks import launch
from od_moe.distributed.rank_split import stage_ranges
from od_moe.distributed.seams import SeamReceiver
from od_moe.engine import model_layouts
from od_moe.per_layer.passes import Passes
from tiny_models import MIXTRAL, write_mlx_model

RANK_SCRIPT = Path(__file__).parent / "pipeline_rank.py"
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def __init__(self):"]
NEW_TOKENS = 12


def _layer(name: str) -> int:
    return int(re.search(r"layers\.(\d+)\.", name).group(1))


def _run_ranks(tmp_path, model, prompts):
    args = [model, tmp_path, "0.25,1.0", NEW_TOKENS, json.dumps(prompts)]
    result = launch(RANK_SCRIPT, args, extra_path=[Path(__file__).parent])
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]


def _check_split(ranks, reference, num_layers, model):
    store, layouts = model_layouts(model)
    store.close()
    moe_paths = set()
    for rank in ranks:
        start, end = rank["start"], rank["end"]
        assert [start, end] == rank["ranges"][rank["rank"]] and start < end
        for capacity, run in rank["runs"].items():
            assert run["tokens"] == reference, (rank["rank"], capacity)
            # only this rank's layers: its MoE blocks, what it read from disk, every weight it holds
            assert run["moe_paths"] and all(start <= _layer(p) < end for p in run["moe_paths"])
            assert run["reads"] and set(run["reads"]) <= set(run["moe_paths"])
            layers = {_layer(k) for k in run["parameters"] if re.search(r"layers\.\d+\.", k)}
            assert layers == set(range(start, end)), (layers, start, end)
        full, quarter = rank["runs"]["1.0"], rank["runs"]["0.25"]
        # at 100% every own expert is read once at load: its layers' expert bytes, no more
        assert sum(full["reads"].values()) == sum(full["expert_nbytes"])
        assert quarter["slot_bytes"] == pytest.approx(full["slot_bytes"] / 4, rel=0.01)
        assert quarter["misses"] > 0
        moe_paths |= set(full["moe_paths"])
    # across the seam: rank 1 predicted rank 0's first MoE layer every decode pass at 25% (none at 100%:
    # nothing misses); rank 0 got the predictions and read what was absent before the hidden state came
    sent, got = ranks[1]["runs"]["0.25"]["seam_sent"], ranks[0]["runs"]["0.25"]["seam_received"]
    assert sent >= len(reference) * (NEW_TOKENS - 2) and got["predictions"] == sent
    # each was taken before its hidden state was sent (`pipeline_rank.py` orders the two): none is late
    assert got["late"] == 0 and got["started_before_hidden_state"] <= got["reads"]
    assert ranks[1]["runs"]["0.25"]["seam_received"] is None and ranks[0]["runs"]["0.25"]["seam_sent"] is None
    assert len(moe_paths) == sum(len(r["runs"]["1.0"]["moe_paths"]) for r in ranks)  # no layer on both
    assert moe_paths == {layout.module_path for layout in layouts}
    whole = sum(layout.expert_nbytes * layout.num_experts for layout in layouts)
    assert sum(sum(r["runs"]["1.0"]["reads"].values()) for r in ranks) == whole
    assert ranks[0]["start"] == ranks[1]["end"] and ranks[1]["start"] == 0 and ranks[0]["end"] == num_layers


def test_a_seam_prediction_is_taken_for_the_next_pass_and_booked_late_after_its_hidden_state():
    """`SeamReceiver` without processes: the two-rank tests order the ranks (`pipeline_rank.py`), so none
    comes late there."""
    asked, pending = [], {3}

    def submit(predictions):
        asked.append((predictions[0].layer, predictions[0].experts.tolist()))
        return {0: [e for e in predictions[0].experts.tolist() if e != 2]}  # 2 is resident: not asked

    reader = SimpleNamespace(started=lambda layer, experts: [e not in pending for e in experts])
    passes = Passes()
    receiver = SeamReceiver(passes, SimpleNamespace(governor=object(), submit=submit, reader=reader))
    for _ in range(4):  # pass 4 ran: 5 is next
        passes.start("decode")
    receiver.on_message(1, {"pass": 5, "ids": [1, 2, 3], "scores": [0.9, 0.5, 0.2]})
    receiver.hidden_state_came()  # pass 5's: expert 3 still waits in the reader's queue
    receiver.on_message(1, {"pass": 5, "ids": [4], "scores": [0.9]})  # too late for pass 5
    assert asked == [(0, [1, 2, 3])]
    assert receiver.counts == {"predictions": 2, "late": 1, "reads": 2, "started_before_hidden_state": 1}
    assert receiver.fraction() == 0.5


def test_stage_ranges_balance_moe_layers():
    assert stage_ranges(list(range(8)), 8, 2) == [(4, 8), (0, 4)]  # rank 0 the last layers, as mlx-lm
    assert stage_ranges([1, 2, 3], 4, 2) == [(2, 4), (0, 2)]  # the dense first layer goes with layer 1
    assert stage_ranges([1, 2, 3], 4, 3) == [(3, 4), (2, 3), (0, 2)]
    with pytest.raises(od_moe.UserError, match="cannot be split over 4 ranks"):
        stage_ranges([1, 2, 3], 4, 4)


def test_bundled_model_over_two_ranks_matches_mlx_lm(tmp_path):
    reference = reference_tokens(od_moe.DEFAULT_MODEL, PROMPTS, NEW_TOKENS)
    _check_split(_run_ranks(tmp_path, "-", PROMPTS), reference, 8, None)


def test_mixtral_over_two_ranks_matches_mlx_lm(tmp_path):
    path = write_mlx_model(tmp_path / "mixtral", MIXTRAL)
    prompts = [[1, 17, 300, 42, 9, 88], [5, 600, 23, 23, 7]]
    out = tmp_path / "out"
    out.mkdir()
    _check_split(_run_ranks(out, str(path), prompts), reference_tokens(path, prompts, NEW_TOKENS), 2, path)


def test_a_collective_hand_over_gives_the_same_tokens(tmp_path, monkeypatch):
    """Where sends do not run on the device (CUDA), each stage's first layer takes the hidden state from an
    all_gather every rank joins (`rank_split.Handover`): the same tokens, asked for here on the CPU."""
    monkeypatch.setenv("OD_MOE_SEAMS", "collective")
    path = write_mlx_model(tmp_path / "mixtral", MIXTRAL)
    prompts = [[1, 17, 300, 42, 9, 88], [5, 600, 23, 23, 7]]
    out = tmp_path / "out"
    out.mkdir()
    reference = reference_tokens(path, prompts, NEW_TOKENS)
    for rank in _run_ranks(out, str(path), prompts):
        assert rank["handovers"] == 1, rank["rank"]
        assert all(run["tokens"] == reference for run in rank["runs"].values()), rank["rank"]


def _script(tmp_path, text: str) -> Path:
    path = tmp_path / "rank_script.py"
    path.write_text(text)
    return path


def test_generate_command_prints_on_rank_zero_only(tmp_path):
    cli = _script(tmp_path, "import sys\nfrom od_moe.cli import main\nsys.exit(main())\n")
    args = [
        "generate",
        "--prompt",
        PROMPTS[0],
        "--ignore-chat-template",
        "--max-tokens",
        8,
        "--capacity",
        "25%",
    ]
    result = launch(cli, [*args, "--stats"])
    assert result.returncode == 0, result.stderr[-3000:]
    tokenizer = od_moe.load(capacity=1.0, ranks=None).tokenizer
    text = tokenizer.decode(reference_tokens(od_moe.DEFAULT_MODEL, PROMPTS[:1], 8)[0])
    assert result.stdout.count(text.strip()) == 1, result.stdout  # once: rank 0 printed, rank 1 followed
    lines = [line for line in result.stderr.splitlines() if line.startswith("rank ")]
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"], result.stderr
    assert "layers 4-7" in lines[0] and "layers 0-3" in lines[1] and " 0 B read" not in result.stderr


def test_the_shadow_predictor_predicts_each_ranks_own_layers(tmp_path):
    """`--predictor` across ranks: each rank predicts its own layers with its part of the network
    (`ShadowPredictor.for_layers`); rank 0 prints stock's text and says what its prefetch read."""
    cli = _script(tmp_path, "import sys\nfrom od_moe.cli import main\nsys.exit(main())\n")
    args = ["generate", "--prompt", PROMPTS[0], "--ignore-chat-template", "--max-tokens", 12]
    result = launch(cli, [*args, "--capacity", "25%", "--predictor", "bundled", "--stats"])
    assert result.returncode == 0, result.stderr[-3000:]
    tokenizer = od_moe.load(capacity=1.0, ranks=None).tokenizer
    text = tokenizer.decode(reference_tokens(od_moe.DEFAULT_MODEL, PROMPTS[:1], 12)[0])
    assert result.stdout.count(text.strip()) == 1, result.stdout
    read_ahead = re.search(r"prefetch predictor: (\d+) experts read ahead", result.stderr)
    assert read_ahead and int(read_ahead.group(1)) > 0, result.stderr[-2000:]


def test_a_ranks_part_of_the_predictor_scores_as_the_whole():
    from od_moe.predictor import load_predictor

    engine = od_moe.load(capacity=0.25, ranks=None)
    whole = load_predictor(od_moe.DEFAULT_PREDICTOR, engine.identity)
    whole.attach_routers(*engine.routers())
    part = whole.for_layers(4, 4)
    weights, biases = engine.routers()
    part.attach_routers(weights[4:], biases[4:])
    x = mx.random.normal((2, weights.shape[-1]), key=mx.random.key(1))
    for local in range(3):
        logits = x @ mx.array(weights[4 + local]).T + mx.array(biases[4 + local])
        got, want = part(local, x, logits), whole(4 + local, x, logits)
        assert got.shape[1] == len(part.config.targets(local)) == 3 - local
        assert mx.allclose(got, want[:, : got.shape[1]], atol=1e-5)
    assert mx.array_equal(part.next_use.proj, whole.next_use.proj[4:])


def test_a_rank_started_otherwise_is_refused(tmp_path):
    other = _script(
        tmp_path,
        "import os, sys\nimport od_moe\ntry:\n"
        "    od_moe.load(capacity=0.25 if os.environ['MLX_RANK'] == '0' else 0.5)\n"
        "except od_moe.UserError as e:\n    print(f'refused: {e}')\n    sys.exit(2)\n",
    )
    # the launcher stops the other ranks once one exits with an error: the first to say so is enough
    result = launch(other, timeout=120)
    refusals = [line for line in result.stdout.splitlines() if line.startswith("refused: ")]
    assert refusals and all("rank 1 was started with another model, budget" in r for r in refusals)
    assert "exited with code 2" in result.stderr


def test_a_snapshot_of_one_rank_is_refused_elsewhere(tmp_path):
    """A rank's snapshot names its decoder layers: another rank with as many MoE layers (or one process)
    refuses it instead of filling its slots with another layer's experts."""
    engine = od_moe.load(capacity=0.25, ranks=None)
    engine.stage = SimpleNamespace(start=4, end=8)  # as rank 0 of two holds them
    engine.save_snapshot(tmp_path / "rank0", weights=True)
    engine.stage = SimpleNamespace(start=0, end=4)
    with pytest.raises(od_moe.UserError, match="decoder_layers"):
        engine.load_snapshot(tmp_path / "rank0")
    engine.stage = None
    with pytest.raises(od_moe.UserError, match="decoder_layers"):
        engine.load_snapshot(tmp_path / "rank0")


def test_inspect_ranks_gives_each_rank_its_layers_and_memory(capsys):
    from od_moe.cli import main
    from od_moe.preflight import inspect_model

    whole = inspect_model(ranks=1)
    report = inspect_model(ranks=2)
    rows = report["ranks"]
    assert [r["layers"] for r in rows] == [[4, 8], [0, 4]] and [r["moe_layers"] for r in rows] == [4, 4]
    assert sum(r["all_experts_bytes"] for r in rows) == whole["all_experts_bytes"]
    shared = 2 * whole["non_expert_bytes"] - sum(r["non_expert_bytes"] for r in rows)  # held on both
    assert 0 < shared < whole["non_expert_bytes"]
    for r in rows:
        assert r["budgets"]["0.25"] < r["budgets"]["1"] < whole["budgets"]["1"]
    assert "cannot be split over 9 ranks" in inspect_model(ranks=9)["ranks"]["error"]
    assert main(["inspect", "--ranks", "2"]) == 0
    out = capsys.readouterr().out
    assert "rank 0     layers 4-7 (4 MoE)" in out and "rank 1     layers 0-3 (4 MoE)" in out
    assert "rank 0 runs the last layers and prints or serves" in out  # why the order is reversed


def test_batches_are_refused_across_ranks():
    engine = od_moe.load(capacity=0.25, ranks=None)
    engine.stage = SimpleNamespace(start=0, end=4, rank=1)
    with pytest.raises(od_moe.UserError, match="batched decoding does not run across ranks"):
        engine.batch_generate(["def f():"], max_tokens=2)
