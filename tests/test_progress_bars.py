"""Progress bars on the long steps: building the widened model, reading every expert at load, saving and
loading a snapshot with weights. Drawn on a terminal, to its end; quiet off a terminal and for small steps."""

import io
import re
import sys

import od_moe
from od_moe import progress
from od_moe.bench.widen import widen_model


class Terminal(io.StringIO):
    def isatty(self):
        return True


def bar_ends(text: str, label: str) -> tuple[str, str]:
    """The last (done, total) a bar labelled `label` drew."""
    found = re.findall(re.escape(label) + r" \[#*\s*\] ([\d,]+)/([\d,]+) MB", text)
    assert found, f"no {label!r} bar in {text!r}"
    return found[-1]


def test_widening_loading_and_snapshots_draw_bars_to_their_end(monkeypatch, tmp_path):
    terminal = Terminal()  # set here, not in a fixture: pytest puts its own stderr back after setup
    monkeypatch.setattr(sys, "stderr", terminal)
    monkeypatch.setattr(progress, "LONG_BYTES", 0)  # every step long enough for a bar
    widen_model(od_moe.DEFAULT_MODEL, tmp_path / "wide", 2)
    done, total = bar_ends(terminal.getvalue(), "widening x2")
    assert done == total and int(total.replace(",", "")) >= 13  # MB: more than the bundled model

    engine = od_moe.load(capacity="100%")  # fully resident: every expert is read at load
    done, total = bar_ends(terminal.getvalue(), "reading experts")
    assert done == total

    engine = od_moe.load(capacity=16)
    engine.generate("def f(x):", max_tokens=4)
    engine.save_snapshot(tmp_path / "snap", weights=True)
    done, total = bar_ends(terminal.getvalue(), "saving snapshot")
    assert done == total
    od_moe.load(capacity=16, snapshot=tmp_path / "snap")
    done, total = bar_ends(terminal.getvalue(), "loading snapshot")
    assert done == total


def test_bars_stay_quiet_off_a_terminal_and_for_small_steps(monkeypatch, tmp_path):
    logs = io.StringIO()  # a log file: not a terminal
    monkeypatch.setattr(sys, "stderr", logs)
    monkeypatch.setattr(progress, "LONG_BYTES", 0)
    widen_model(od_moe.DEFAULT_MODEL, tmp_path / "wide", 2)
    od_moe.load(capacity="100%")
    assert logs.getvalue() == ""
    screen = Terminal()  # a terminal, but the bundled model is read in an instant: no bar
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.setattr(progress, "LONG_BYTES", 256 * 2**20)
    od_moe.load(capacity="100%")
    assert screen.getvalue() == ""
