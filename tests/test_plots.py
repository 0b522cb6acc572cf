"""`od-moe bench --plot`: the grid's rows drawn against capacity per policy, with the rows beside the
image; a missing matplotlib is one clear line before any run."""

import json
import sys

from od_moe.bench.plots import series
from od_moe.cli import main


def test_the_bench_draws_its_rows_and_writes_them_beside_the_plot(deterministic_grid):
    _, out, err = deterministic_grid
    assert f"plot written to {out}" in err
    svg = out.read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    runs = [r for r in rows if "decode_hits" in r]
    drawn = series(rows)
    assert list(drawn) == [("bundled", "warm", "load")]
    lines = drawn[("bundled", "warm", "load")]["lines"]
    assert set(lines["hit_rate"]) == {r["policy"] for r in runs}
    for r in runs:  # every run is a point of its policy's line, in every panel
        assert (r["capacity"], r["hit_rate"]) in lines["hit_rate"][r["policy"]]
        assert (r["capacity"], r["tok_s"]) in lines["tok_s"][r["policy"]]
        assert (r["capacity"], r["bytes_per_token"] / 1000) in lines["kb_per_token"][r["policy"]]
    for panel in lines.values():  # capacities increase along each line
        assert all([x for x, _ in p] == sorted({x for x, _ in p}) for p in panel.values())
    stock = next(r["tok_s"] for r in rows if r["policy"] == "stock mlx-lm")
    assert drawn[("bundled", "warm", "load")]["stock"] == stock
    for policy in lines["hit_rate"]:  # the policy names are in the drawing's legend
        assert policy in svg


def test_without_matplotlib_the_bench_says_so_in_one_line_before_running(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    assert main(["bench", "--widen", "0", "--plot", str(tmp_path / "b.png")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""  # nothing ran
    (line,) = captured.err.strip().splitlines()
    assert "matplotlib" in line and "pip install 'od-moe[bench]'" in line
    assert main(["bench", "--widen", "0", "--plot", str(tmp_path / "b.pdf")]) == 2
    assert ".png or .svg" in capsys.readouterr().err
