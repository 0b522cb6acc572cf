"""`od-moe inspect` (od_moe.preflight): figures equal what loading then reports, nothing is loaded,
refusals
are reported, and the server's /v1/capabilities says the same."""

import json

import pytest

import od_moe
from od_moe.cli import main
from od_moe.memory import backend
from od_moe.preflight import inspect_model
from od_moe.server import create_app
from tiny_models import DBRX, FAMILIES, write_hf_per_expert, write_mlx_model


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The bundled model and tiny ones: biased experts, a router on the layer, SwitchMLP, a HF layout."""
    root = tmp_path_factory.mktemp("inspect")
    paths = {"bundled": od_moe.DEFAULT_MODEL}
    for name in ("gpt_oss", "gemma4_text", "nemotron_h"):
        paths[name] = write_mlx_model(root / name, FAMILIES[name])
    paths["hf-deepseek_v3"] = write_hf_per_expert(root / "hf", FAMILIES["deepseek_v3"])
    return paths


@pytest.mark.parametrize("name", ["bundled", "gpt_oss", "gemma4_text", "nemotron_h", "hf-deepseek_v3"])
def test_figures_match_what_loading_reports(models, name):
    report = inspect_model(str(models[name]), capacity="25%")
    assert report["exact"] and report["reason"] is None
    engine = od_moe.load(str(models[name]), capacity=0.25)
    cache = engine.caches[0]
    assert report["moe_layers"] == len(engine.caches)
    assert report["experts_per_layer"] == engine.num_experts
    assert report["routed_per_token"] == engine.top_k
    assert report["layout"] == cache.layout.layout
    assert report["expert_bytes_on_disk"] == cache.layout.expert_nbytes
    assert report["expert_bytes"] == cache.slot_nbytes
    assert report["non_expert_bytes"] == engine.non_expert_nbytes
    assert report["capacity"]["capacity"] == engine.capacity
    cache_bytes = engine.stats()["memory"]["expert_cache_bytes"]
    assert cache_bytes == report["expert_bytes"] * engine.capacity * report["moe_layers"]
    # the budget inspect names for a capacity buys exactly that capacity, and a byte less buys less
    budget = report["capacity"]["budget_bytes"]
    assert od_moe.load(str(models[name]), memory_budget=budget).capacity == engine.capacity
    assert od_moe.load(str(models[name]), memory_budget=budget - 1).capacity == engine.capacity - 1


def test_a_budget_gives_the_capacity_load_picks(models):
    report = inspect_model(str(models["bundled"]), memory_budget="20MB")
    engine = od_moe.load(str(models["bundled"]), memory_budget="20MB")
    assert report["memory_budget"]["capacity"] == engine.capacity > 0
    too_small = inspect_model(str(models["bundled"]), memory_budget="1MB")["memory_budget"]
    assert too_small["capacity"] == 0 and "too small" in too_small["error"]


def test_inspect_reads_no_weights():
    before = backend.active_memory_bytes()
    report = inspect_model(None)
    assert report["all_experts_bytes"] > 10e6  # the bundled model's experts: 11.8 MB in float32
    assert backend.active_memory_bytes() - before < 1e6


def test_predictor_presence_and_fit(models, tmp_path):
    assert inspect_model(None)["predictor"] == {
        "path": str(od_moe.engine.DEFAULT_PREDICTOR),
        "present": True,
        "fits": True,
        "reason": None,
    }
    foreign = inspect_model(str(models["gpt_oss"]), predictor=od_moe.engine.DEFAULT_PREDICTOR)["predictor"]
    assert foreign["present"] and not foreign["fits"] and "another model" in foreign["reason"]
    assert not inspect_model(str(models["gpt_oss"]))["predictor"]["present"]


def test_refused_family_is_reported(tmp_path):
    report = inspect_model(str(write_mlx_model(tmp_path / "dbrx", DBRX, quantize=False)))
    assert report["family"] == "dbrx" and not report["exact"] and "one by one" in report["reason"]


def test_cli_inspect(models, capsys):
    assert main(["inspect", str(models["gpt_oss"]), "--capacity", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["family"] == "gpt_oss" and report["capacity"]["capacity"] == 4
    assert main(["inspect", "--memory-budget", "20MB"]) == 0
    text = capsys.readouterr().out
    assert "8 MoE layers x 64 experts, 8 routed per token" in text and "predictor" in text
    assert main(["inspect", "--capacity", "999"]) == 2
    assert "capacity must be between 1 and 64" in capsys.readouterr().err


def test_server_capabilities(models):
    engine = od_moe.load(str(models["gemma4_text"]), capacity=0.5)
    client = create_app(engine).test_client()
    caps = client.get("/v1/capabilities").get_json()
    assert caps["family"] == "gemma4_text" and caps["exact"]
    assert caps["loaded"]["capacity"] == engine.capacity == caps["capacity"]["capacity"]
    assert caps["loaded"]["expert_bytes"] == caps["expert_bytes"]
    assert client.get("/v1/models").get_json()["data"][0]["capabilities"] == caps


def test_inspects_mode_line_speaks_the_command_lines_language(capsys):
    """`inspect` is a command: its mode line names the flag (`--two-tier`), not Python's `two_tier=`."""
    from od_moe.cli import main

    assert main(["inspect"]) == 0
    (mode,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("mode ")]
    assert "two_tier=" not in mode and "--two-tier on, off or lru chooses" in mode


def test_the_host_line_says_three_tiers_where_the_host_holds_some_experts(monkeypatch):
    """On a device with memory of its own, a host budget below the experts' bytes gives three tiers: the
    host tier is the budget less what the process holds besides (its resident set, here 1 MB, and the
    non-expert weights), and the host line says how many experts a layer it holds (it said "holds every
    expert" there), as the tiers line does."""
    from od_moe.preflight import format_inspection

    monkeypatch.setattr(backend, "device_memory", lambda: (8 * 10**9, 8 * 10**9))
    monkeypatch.setattr(backend, "resident_bytes", lambda: 10**6)
    report = inspect_model(memory_budget="8MB", capacity=16)
    host = report["two_tier"]["host_experts"]
    held = 10**6 + report["non_expert_bytes"]
    assert host == (8 * 10**6 - held) // (report["expert_bytes"] * 8) and 8 <= host < 64
    lines = {line.split()[0]: line for line in format_inspection(report).splitlines()}
    assert f"holds {host} of 64 experts a layer" in lines["host"] and "every expert" not in lines["host"]
    assert f"{host} in host memory" in lines["tiers"]
    assert f"the budget less {held / 1e9:.2f} GB the process holds besides" in lines["mode"]
    whole = inspect_model(memory_budget="64MB", capacity=16)
    assert whole["two_tier"]["host_experts"] is None
    (line,) = [line for line in format_inspection(whole).splitlines() if line.startswith("host ")]
    assert "every expert (11.80 MB) for two tiers" in line and "three tiers" not in line
