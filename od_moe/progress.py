"""A dependency-free progress bar on stderr for long jobs (trace recording, training).

On a terminal it redraws one line; otherwise (logs, CI) it prints a line at every tenth of the way.
"""

import sys
import time


class Progress:
    def __init__(self, label: str, total: int, unit: str = "tokens", stream=None):
        self.label, self.total, self.unit = label, max(int(total), 1), unit
        self.stream = stream or sys.stderr
        self.done, self.start = 0, time.perf_counter()
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self._next_decile = 1
        self.extra = ""

    def update(self, n: int, extra: str = ""):
        self.done = min(self.done + int(n), self.total)
        self.extra = extra or self.extra
        if self.tty:
            self._draw("\r")
        elif self.done * 10 >= self._next_decile * self.total:
            self._next_decile = self.done * 10 // self.total + 1
            self._draw("")
            self.stream.write("\n")
        self.stream.flush()

    def close(self):
        if self.tty:
            self._draw("\r")
            self.stream.write("\n")
            self.stream.flush()

    def _draw(self, prefix: str):
        frac = self.done / self.total
        elapsed = time.perf_counter() - self.start
        rate = self.done / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        bar = "#" * int(frac * 24)
        self.stream.write(
            f"{prefix}{self.label} [{bar:<24}] {self.done:,}/{self.total:,} {self.unit} "
            f"{rate:,.0f}/s eta {eta:,.0f}s {self.extra}".rstrip()
            + " "
        )

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
