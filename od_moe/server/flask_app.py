"""The Flask app class every od-moe route hangs on (`ServerApp`): the worker it serves, replies whose keys
keep the order they are written in, and the request body's limit, all given when it is made.

Not here: the routes (`app.py`, `starting.py`, `dashboard.py`), the checks every request gets (`guard.py`).
"""

from flask import Flask
from flask.json.provider import DefaultJSONProvider

from .worker import GenerationWorker


class _InOrder(DefaultJSONProvider):
    sort_keys = False  # a reply's keys in the order the code writes them (usage after choices, ...)


class ServerApp(Flask):
    """The server's Flask app, with the worker that generates for it (tests and benches reach it there);
    `max_body_bytes`: the largest request body read (None: Flask's default, no limit)."""

    json_provider_class = _InOrder

    def __init__(self, worker: GenerationWorker, max_body_bytes: int | None = None):
        super().__init__("od_moe.server")
        self.worker = worker
        if max_body_bytes is not None:
            self.config["MAX_CONTENT_LENGTH"] = max_body_bytes
