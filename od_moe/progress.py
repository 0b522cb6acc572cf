"""A dependency-free progress bar on stderr for long jobs (trace recording, training, building the
widened model, reading every expert at load, snapshots).

On a terminal it redraws one line; otherwise (logs, CI) it prints a line at every tenth of the way, unless
made with `tty_only` (steps that also run inside other commands, tests and benchmarks: those stay quiet
off a terminal). `byte_progress` is such a bar in MB for steps that move bytes, drawn only for steps
large enough to take a while.
"""

import sys
import time

from .units import MB

LONG_BYTES = 256 * 2**20  # steps that move fewer bytes than this are over too soon to need a bar


class Progress:
    def __init__(
        self,
        label: str,
        total: int,
        unit: str = "tokens",
        stream=None,
        tty_only: bool = False,
        scale: int = 1,
        quiet: bool = False,
    ):
        """`scale`: counts are shown divided by it (bytes counted, MB shown: `scale=units.MB`); `quiet`:
        nothing is drawn."""
        self.label, self.total, self.unit, self.scale = label, max(int(total), 1), unit, scale
        self.stream = stream or sys.stderr
        self.done, self.start = 0, time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.silent = quiet or (tty_only and not self.tty)
        self._next_decile = 1
        self.extra = ""

    def update(self, n: int, extra: str = ""):
        self.done = min(self.done + int(n), self.total)
        self.extra = extra or self.extra
        if self.silent:
            return
        if self.tty:
            self._draw("\r")
        elif self.done * 10 >= self._next_decile * self.total:
            self._next_decile = self.done * 10 // self.total + 1
            self._draw("")
            self.stream.write("\n")
        self.stream.flush()

    def close(self):
        if self.tty and not self.silent:
            self._draw("\r")
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, prefix: str):
        frac = self.done / self.total
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        bar = "#" * int(frac * 24)
        done, total = self.done / self.scale, self.total / self.scale
        self.stream.write(
            f"{prefix}{self.label} [{bar:<24}] {done:,.0f}/{total:,.0f} {self.unit} "
            f"{rate / self.scale:,.0f}/s eta {eta:,.0f}s {self.extra}".rstrip()
            + " "
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def byte_progress(label: str, nbytes: int, stream=None) -> Progress:
    """A bar in MB for a step that moves `nbytes` (count bytes with `update`): drawn on a terminal only,
    and only when the step moves at least `LONG_BYTES`."""
    return Progress(label, nbytes, "MB", stream, tty_only=True, scale=MB, quiet=nbytes < LONG_BYTES)
