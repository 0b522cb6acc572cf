"""Requests on their way to the generation queue: read, checked and tokenized on their HTTP threads.

Clients that send together reach the worker apart: each request is accepted, read and tokenized on its
own thread, a millisecond or more each and one at a time under the GIL. A batch that started its step
with the first of them would prefill the others in later steps, each a pass of its own before their
first tokens (docs/GPU.md, "Time to first token"). So before a step
that prefills requests that just joined, the worker waits while other requests are being read, and for
`ARRIVAL_GRACE_S` after the last of them for one more to start, at most `ARRIVAL_WAIT_S` in all; they
join the same step. A request that arrives alone waits for nothing: its arrival ends as it is queued,
under the same lock the worker's wait takes, so the worker never finds it counted.
Not here: the queue and the batch (`worker.py`, `batching.py`), the HTTP hooks (`app.py`).
"""

import threading
import time
from collections.abc import Callable

ARRIVAL_WAIT_S = 0.02  # the longest a step waits for requests being read: a slow body waits no longer
ARRIVAL_GRACE_S = 0.003  # how long after the last arrival ended another may still be starting


class Arrivals:
    """How many requests are being read; the worker waits for them (`wait`)."""

    def __init__(self):
        self._count = 0
        self._changed = threading.Condition()

    def __len__(self) -> int:
        return self._count

    def begin(self) -> "Arrival":
        """A request has started being read: `Arrival.end` it as it is queued, or once refused."""
        with self._changed:
            self._count += 1
            self._changed.notify_all()
        return Arrival(self)

    def wait(self, timeout_s: float | None = None, grace_s: float | None = None) -> bool:
        """Wait while requests are being read and `grace_s` after the last, at most `timeout_s` (by default
        `ARRIVAL_GRACE_S`, `ARRIVAL_WAIT_S`); at once where none is. True if there were some."""
        grace_s = ARRIVAL_GRACE_S if grace_s is None else grace_s
        deadline = time.monotonic() + (ARRIVAL_WAIT_S if timeout_s is None else timeout_s)
        with self._changed:
            if not self._count:
                return False
            while (left := deadline - time.monotonic()) > 0:
                if self._count:
                    self._changed.wait(left)
                elif not self._changed.wait(min(grace_s, left)):  # none started within the grace
                    break
            return True

    def _end(self, queue: Callable[[], None] | None):
        with self._changed:
            if queue is not None:
                queue()
            self._count -= 1
            self._changed.notify_all()


class Arrival:
    """One request being read. `end` may be called again (an error path after it was queued): it ends
    once."""

    def __init__(self, arrivals: Arrivals):
        self._arrivals, self._ended = arrivals, False

    def end(self, queue: Callable[[], None] | None = None):
        """The request is queued (by `queue`, called under the lock the worker's wait takes) or refused."""
        if not self._ended:
            self._ended = True
            self._arrivals._end(queue)
