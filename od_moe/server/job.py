"""A request's job (`Job`): its prompt and parameters, the events the worker sends it, whether it was
cancelled, and the reply's side of waiting for them (`Job.stream`).

Not here: who runs it (`worker.py`, `batching.py`, `one_at_a_time.py`), the HTTP side (`app.py`).
"""

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .requests import ApiError, GenerationParams


@dataclass
class Job:
    prompt: list[int]
    params: GenerationParams
    events: "queue.Queue" = field(default_factory=queue.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    alive: Callable[[], bool] = lambda: True  # False once the client has gone away
    submitted: float = field(default_factory=time.perf_counter)  # when it was queued
    release: Callable[[], None] = lambda: None  # gives back what it holds (`kv_room.py`); idempotent

    def stream(self, timeout_s: float, poll_s: float = 0.2):
        """The job's events until its last one. A worker silent for `timeout_s` cancels it; so does a
        client found gone (checked every `poll_s` while waiting), and then the events just end."""
        try:
            yield from self._events(timeout_s, poll_s)
        finally:  # the reply has ended, or its client went away
            self.release()

    def _events(self, timeout_s: float, poll_s: float):
        silent_since = checked = time.monotonic()
        while True:
            try:
                event = self.events.get(timeout=poll_s)
            except queue.Empty:
                event = None
            now = time.monotonic()
            if now - checked >= poll_s:  # also while events keep coming: a body is sent only at the end
                checked = now
                if not self.alive():
                    self.cancelled.set()
                    return
            if event is None:
                if now - silent_since > timeout_s:
                    self.cancelled.set()
                    raise ApiError(504, "generation timed out", kind="server_error")
                continue
            silent_since = now
            yield event
            if event[0] != "text":
                return
