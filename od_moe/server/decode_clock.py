"""The decode clock: tokens decoded and the seconds spent decoding them, for the server's tok/s.

The generation worker ticks it (`worker.py`); /health, /metrics and the live page read it from any thread.
Not here: the worker's request counters, the statistics documents (`health.py`, `dashboard.py`).
"""

import threading
import time
from collections.abc import Callable


class DecodeClock:
    """Tokens decoded and the seconds spent decoding them, all requests together, read live from any thread
    (the live page's tok/s divides one by the other). A request's clock runs from its first token to its
    end: the prompt's prefill (which gives the first token) and the idle time between requests are not
    decoding, so neither is counted."""

    def __init__(self, now: Callable[[], float] = time.monotonic):
        self.now = now
        self.lock = threading.Lock()
        self.tokens, self.seconds = 0, 0.0
        self.since: float | None = None

    def tick(self, tokens: int = 1):
        """A token came (or a batch pass gave `tokens`): the first of a request (or of a busy batch)
        starts the clock; each later one is counted."""
        t = self.now()
        with self.lock:
            if self.since is not None:
                self.tokens += tokens
                self.seconds += t - self.since
            self.since = t

    def stop(self):
        """The request ended (its last pass still counts as decoding: the clock never goes back)."""
        t = self.now()
        with self.lock:
            if self.since is not None:
                self.seconds += t - self.since
            self.since = None

    def read(self) -> tuple[int, float]:
        """(tokens, seconds) so far, the running request's time since its last token included."""
        t = self.now()
        with self.lock:
            return self.tokens, self.seconds + (t - self.since if self.since is not None else 0.0)
