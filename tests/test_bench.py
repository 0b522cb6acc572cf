"""`od-moe bench`: the deterministic prefetch grid's rows are exact and repeat to the count, and `--plot`
draws them (one file, so that the grid, shared by both, runs once under `--dist loadfile`); the batch and
two-tier rows are exact and measure their bytes."""

import json
import sys

import pytest

from od_moe.bench.foundation import PROMPTS
from od_moe.bench.plots import series
from od_moe.bench.prefetch import DETERMINISTIC, run_policy
from od_moe.cli import main
from od_moe.engine import DEFAULT_MODEL


def test_the_deterministic_grid_is_exact_and_repeats(deterministic_grid):
    first = deterministic_grid[0]
    runs = [r for r in first if "decode_hits" in r]
    assert len(runs) == 15  # 12.5/25/50% x none, profile, next-gate, predictor, oracle
    assert all(r["exact"] for r in runs)
    for policy in ("predictor", "oracle"):  # run again, the rows repeat to the count
        again = run_policy(DEFAULT_MODEL, PROMPTS, 6, policy, capacity=0.25, settings=DETERMINISTIC)
        row = next(r for r in runs if r["policy"] == policy and r["capacity"] == 0.25)
        stats = again["stats"]
        assert again["tokens"] == row["tokens"]
        assert sum(s["total"]["decode"]["hits"] for s in stats) == row["decode_hits"]
        assert sum(s["io"]["decode"]["bytes_read"] for s in stats) == pytest.approx(
            row["bytes_per_token"] * sum(s["positions"]["decode"] for s in stats)
        )
        assert sum(s["prefetch"]["issued"] for s in stats) == row["prefetch_issued"]
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


def test_the_batch_rows_are_exact_and_read_less_per_token_in_a_batch(tmp_path, capsys):
    """`od-moe bench --batch`: each row's tokens are stock mlx-lm's batch tokens, and a batch of 8 reads
    fewer experts per generated token than one request alone (the batch shares its reads)."""
    from od_moe.bench.batch_speed import batch_prompts, run_batch_grid

    prompts = batch_prompts(8)
    assert len(set(prompts)) == 8 and all(p.startswith("def ") for p in prompts)
    rows = run_batch_grid([8, 1], [0.25], 6, 0, tmp_path, say=None, rounds=1)["rows"]
    assert [r["batch"] for r in rows] == [1, 8] and all(r["same_tokens"] for r in rows)
    one, eight = rows
    assert eight["experts_per_token"] < one["experts_per_token"] and eight["experts_per_token_vs_batch_1"] < 1
    assert one["gain"] == 1.0 and one["stock_gain"] == 1.0
    assert main(["bench", "--batch", "--batch-sizes", "0"]) == 2
    assert "--batch-sizes takes positive counts" in capsys.readouterr().err


def test_the_two_tier_rows_are_exact_and_measure_bytes_against_min_and_the_roofline(capsys):
    """`od-moe bench --two-tier`: stock tokens in every round; bytes moved are the mapped lanes and slot
    copies, set against Belady's MIN on the same routing; the roofline bounds the row from below."""
    from od_moe.bench.two_tier_grid import run_two_tier_grid
    from od_moe.engine import DEFAULT_MODEL

    rows = run_two_tier_grid([("bundled", DEFAULT_MODEL, 8)], [0.0, 0.25], 1, printer=None)["rows"]
    empty, quarter = rows
    assert all(r["exact"] for r in rows) and all(r["stack_moves"] == 0 for r in rows)
    assert empty["decode_hit_rate"] == 0 and empty["copies_per_token"] == 0 and empty["min_per_token"] is None
    assert empty["mapped_per_token"] == 8 * 8  # every lane of every layer read in place
    expert = empty["moved_bytes_per_token"] / empty["mapped_per_token"]
    assert quarter["moved_bytes_per_token"] == pytest.approx(
        (quarter["mapped_per_token"] + quarter["copies_per_token"]) * expert
    )
    assert 0 < quarter["min_per_token"] < quarter["mapped_per_token"] < empty["mapped_per_token"]
    assert quarter["moved_over_min"] == pytest.approx(
        (quarter["mapped_per_token"] + quarter["copies_per_token"]) / quarter["min_per_token"]
    )
    for r in rows:  # the roofline's bus: the faster of the two measured ways across it
        bw = r["bus_bw"]
        assert bw["best"] == max(bw["in_place"], bw["copied"]) and min(bw.values()) > 0
        assert r["roofline_ms_per_token"] == pytest.approx(
            max(1e3 / r["stock_tok_s"], r["moved_bytes_per_token"] / bw["best"] * 1e3)
        )
    assert [r["slots_kind"] for r in rows] == ["counted", "counted"]  # 20 KB experts: admitted by counts
    for r in rows:  # memory as the OS counts it (no device of its own here), the rounds' spread
        assert r["device_bytes"] is None and r["host_bytes"] > 0
        assert r["x_stock_spread"][0] <= r["x_stock"] <= r["x_stock_spread"][1]
    assert main(["bench", "--two-tier", "--gpu"]) == 2
    assert "--two-tier runs alone" in capsys.readouterr().err
    assert main(["bench", "--capacities", "0"]) == 2


def test_two_tier_rows_keep_the_slots_auto_would(monkeypatch):
    """Experts "auto" gives device-kept slots (large ones, some in slots) are benched in that mode, and
    each miss there moves its bytes once, as the copy into a row."""
    from od_moe import assembly
    from od_moe.bench.two_tier_grid import run_two_tier_grid

    monkeypatch.setattr(assembly, "LRU_EXPERT_NBYTES", 1)
    rows = run_two_tier_grid([("bundled", DEFAULT_MODEL, 8)], [0.0, 0.25], 1, printer=None)["rows"]
    empty, quarter = rows
    assert [r["slots_kind"] for r in rows] == ["counted", "lru"] and all(r["exact"] for r in rows)
    assert quarter["copies_per_token"] > 0 and empty["copies_per_token"] == 0
    expert = empty["moved_bytes_per_token"] / empty["mapped_per_token"]
    assert quarter["moved_bytes_per_token"] == pytest.approx(quarter["copies_per_token"] * expert)
    assert quarter["moved_over_min"] == pytest.approx(quarter["copies_per_token"] / quarter["min_per_token"])


def test_device_kept_rows_move_each_miss_once_alone_and_in_a_batch():
    """With device-kept rows a miss crosses the bus once, as its copy into a row (read there after): one
    sequence moves its copies; a batch's staged pass moves its copies and the experts no row held after
    them, so never more experts than the pass routed to."""
    import od_moe
    from od_moe.bench.two_tier_grid import experts_across_bus

    alone = od_moe.load(capacity=0.25, two_tier="lru")
    list(alone.stream_generate(PROMPTS[0], max_tokens=12))
    alone.runtime.settle()
    stats = alone.stats()
    assert experts_across_bus(alone, "decode") == stats["io"]["decode"]["experts_loaded"] > 0
    assert stats["total"]["decode"]["misses"] == stats["io"]["decode"]["experts_loaded"]  # each miss copied

    batch = od_moe.load(capacity=0.25, two_tier="lru")
    for _ in batch.stream_batch_generate(PROMPTS[:3], max_tokens=12):
        pass
    batch.runtime.settle()
    led, copies = batch.runtime.ledger, batch.stats()["io"]["decode"]["experts_loaded"]
    routed = led.total("experts", "decode")  # distinct experts of each staged pass, summed
    assert 0 < copies < experts_across_bus(batch, "decode") < routed
    assert experts_across_bus(batch, "decode") == copies + routed - led.total("expert_hits", "decode")


def test_each_decoded_tokens_time_is_the_gap_between_two_responses(monkeypatch):
    """`decoded` keeps a generation's tokens and, per decoded token, the seconds since the response before
    it (the first response, the prompt's, opens the count): what the benches' median token is made of."""
    from types import SimpleNamespace

    from od_moe.bench import foundation

    clock = iter([10.0, 10.5, 10.75, 12.0])
    monkeypatch.setattr(foundation.time, "perf_counter", lambda: next(clock))
    gaps = [0.125]  # added to, not replaced
    tokens, last = foundation.decoded((SimpleNamespace(token=t) for t in (7, 8, 9, 3)), gaps)
    assert tokens == [7, 8, 9, 3] and last.token == 3
    assert gaps == [0.125, 0.5, 0.25, 1.25]


def test_the_disk_probe_reads_n_experts_at_a_time_for_its_seconds():
    """`disk_rate` reads for `seconds` by its clock at each number of reads in flight: on a clock that moves
    one second a look, 3 s are three fetches of n whole experts, over the 4 s the last look saw; the best
    count of reads in flight is the rate's."""
    from od_moe.bench.roofline import disk_rate
    from od_moe.engine import model_layouts

    store, layouts = model_layouts(DEFAULT_MODEL)
    store.close()
    expert = layouts[0].expert_nbytes
    ticks = iter(range(1000))
    found = disk_rate(DEFAULT_MODEL, seconds=3, threads=(1, 4), clock=lambda: float(next(ticks)))
    assert found["by_threads"] == {1: 3 * expert / 4, 4: 3 * 4 * expert / 4}
    assert found["threads"] == 4 and found["bytes_per_s"] == 3 * expert
    # past the page cache, or the line saying why not (a file system that refuses direct I/O)
    assert found["direct_io"] == (found["direct_io_refused"] is None)
