"""How `serve` starts: the port answers while the model loads, and a failure before ready ends `serve`.

`serve` (`app.py`) binds the port before anything loads (a busy port is found at once) and answers on it
from then on, as llama.cpp's server does: until the generation thread is ready (the model loaded and warmed
up, its batch built and its kernels compiled: `worker.py`), `loading_app` answers `/health` with status
"loading" and a 503, and every other route with a 503 JSON error and `Retry-After`. Once it is ready,
`Starter` builds the app (`create_app`) and `Switch` hands it the requests. Where anything before ready
fails, `Starter` keeps the error and stops the HTTP server, and `serve` raises it (`Starter.failure`): the
CLI says it in one line and exits non-zero. `served_name` is the name the server answers to.
Not here: the routes once ready (`app.py`), loading itself (`warm_up.py`, `od_moe.load`).
"""

import threading
from collections.abc import Callable
from pathlib import Path

from flask import Flask, jsonify

from ..errors import ExpertReadError, RankLost, StartFailed, UserError
from ..storage.model_files import DEFAULT_MODEL
from . import guard
from .flask_app import ServerApp
from .requests import ApiError

RETRY_AFTER_S = 5  # a loading model takes seconds to minutes: a client asks again at this pace
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE"]


def served_name(model) -> str:
    """The name a server of `model` answers to, as mlx-lm's and llama.cpp's: a hub id as given
    ("org/name"), else the model folder's name (never a local path)."""
    if model is None:
        return DEFAULT_MODEL.name
    text = str(model)
    path = Path(text).expanduser()
    if not path.exists() and text.count("/") == 1 and not text.startswith((".", "/", "~")):
        return text  # fetched from the hub (`model_files.resolve_model_path`)
    return path.resolve().name


class Switch:
    """The WSGI app `serve` runs: `loading` until it is handed the app (`hand_to`), then that app."""

    def __init__(self, loading: Flask):
        self.loading = loading
        self.app: Flask | None = None

    def hand_to(self, app: Flask):
        """From now on `app` answers every request."""
        self.app = app

    def __call__(self, environ, start_response):
        app = self.app if self.app is not None else self.loading
        return app(environ, start_response)


def loading_app(worker, name: str, hosts: frozenset[str], origins) -> Flask:
    """What answers while `worker` loads, after the Host and Origin checks every request gets: `/health`
    with its status ("loading"; "error" once loading has failed) and a 503, every other route a 503 error
    with `Retry-After` (in Anthropic's form on /v1/messages)."""
    app = ServerApp(worker)
    guard.register(app, worker, hosts, frozenset(origins), max_body_bytes=0)  # no body is read

    @app.get("/health")
    def health():
        error = worker.load_error
        body = {
            "status": worker.state(),
            "last_error": None if error is None else f"{type(error).__name__}: {error}",
            "model_loaded": False,
            "model": name,
        }
        return jsonify(body), 503

    @app.route("/", defaults={"path": ""}, methods=METHODS)
    @app.route("/<path:path>", methods=METHODS)
    def loading(path):
        error = ApiError(
            503,
            f'the model {name} is loading: send the request again once GET /health says "ok"',
            kind="server_error",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
        return guard.error_response(error)

    return app


class Starter:
    """On a thread of its own: waits for `worker` to be ready, then runs `start` (which builds the app,
    hands it to the `Switch` and returns the rank leader or None, kept as `leader`). What fails on the way
    is kept and stops `server`, whose `serve_forever` then returns for `serve` to raise it."""

    def __init__(self, worker, server, start: Callable):
        self.worker, self.server, self.start = worker, server, start
        self.error: BaseException | None = None
        self.leader = None
        self.thread = threading.Thread(target=self._run, name="od-moe-start", daemon=True)
        self.thread.start()

    def _run(self):
        self.worker.ready.wait()
        if self.worker.stopping:  # stopped while it loaded
            return
        try:
            self.leader = self.start()  # create_app raises what loading raised
        except BaseException as e:
            self.error = e
            self.server.shutdown()

    def failure(self) -> BaseException | None:
        """What `serve` raises (None: it started): a user's mistake, an expert read or a lost rank as it is
        (the CLI says each in one line), anything else as a `StartFailed` naming it."""
        error = self.error
        if error is None or isinstance(error, (UserError, ExpertReadError, RankLost)):
            return error
        return StartFailed(f"the server could not start: {type(error).__name__}: {error}", cause=error)
