"""`od-moe bench --deterministic`: the prefetch grid's rows are exact and repeat to the count."""

import json

import pytest

from od_moe.cli import main


def _grid(capsys):
    assert main(["bench", "--deterministic", "--json", "--widen", "0", "--max-tokens", "6"]) == 0
    return json.loads(capsys.readouterr().out)["rows"]


def test_the_deterministic_grid_is_exact_and_repeats(capsys):
    first, second = _grid(capsys), _grid(capsys)
    runs = [r for r in first if "decode_hits" in r]
    assert len(runs) == 15  # 12.5/25/50% x none, profile, next-gate, predictor, oracle
    assert all(r["exact"] for r in runs)
    keys = (
        "tokens",
        "decode_lookups",
        "decode_hits",
        "bytes_per_token",
        "prefetch_issued",
        "prefetch_precision",
    )
    assert [[r.get(k) for k in keys] for r in first] == [[r.get(k) for k in keys] for r in second]
    stock = next(r for r in first if r["policy"] == "stock mlx-lm")
    for r in runs:  # the roofline is never below the resident step, and names the bound that sets it
        assert r["roofline_ms_per_token"] >= 1e3 / stock["tok_s"] and r["roofline_bound"] in (
            "compute",
            "read",
            "install",
        )
        assert r["tok_s_ratio_roofline"] == pytest.approx(r["roofline_ms_per_token"] * r["tok_s"] / 1e3)
    assert all(r["reads_over_min"] >= 1.0 for r in runs)  # Belady's MIN reads the fewest experts
    none = {r["capacity"]: r for r in runs if r["policy"] == "none"}
    for r in (r for r in runs if r["policy"] == "oracle"):  # knowing the future, it evicts as MIN does
        assert r["hit_rate"] > 0.95 and r["reads_over_min"] <= 1.25
        assert r["capacity"] == 0.125 or r["reads_over_min"] < none[r["capacity"]]["reads_over_min"]
