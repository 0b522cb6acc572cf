"""Clients of a server run in this process, for the serving benchmarks (`serving.py`, `first_token.py`):
a server over the embedded model on a loopback port, requests sent whole, streamed, or hung up on
(clients started together, and the request they send: `client_process.py`).
"""

import json
import socket
import sys
import threading
import urllib.error
import urllib.request

from werkzeug.serving import make_server

from .. import load
from ..server import create_app
from ..server.app import SWITCH_INTERVAL_S
from ..server.schedule import ScheduleLog
from ..server.warm_up import warm_up
from .client_process import completion_request


def start_server(capacity, max_batch: int, model=None):
    """(base URL, schedule log, werkzeug server, app) of a server over `model` (the embedded one by
    default), loaded and warmed up as `serve` does before it says it is ready: a request the benches time
    then pays for no compile that `serve`'s would not."""
    engine = load(model, capacity=capacity, sequences=max_batch)
    warm_up(engine, max_batch=max_batch)
    sys.setswitchinterval(SWITCH_INTERVAL_S)  # as `serve` does
    log = ScheduleLog()
    app = create_app(engine, max_batch=max_batch, schedule=log)
    server = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}", log, server, app


def post(base: str, body: dict, timeout: float = 600) -> tuple[int, dict]:
    req = completion_request(base, body)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def post_stream(base: str, body: dict) -> tuple[int, dict]:
    """A streamed request read to its end: (status, the usage chunk), or (status, error) before a stream."""
    body = dict(body, stream=True, stream_options={"include_usage": True})
    req = completion_request(base, body)
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            lines = [line[6:] for line in r.read().decode().split("\n") if line.startswith("data: ")]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    if lines[-1] != "[DONE]":
        return 500, {"error": lines[-1]}  # an error event ended the stream
    return 200, json.loads(lines[-2])


def hang_up(base: str, body: dict):
    host, port = base.split("//")[1].split(":")
    raw = json.dumps(body).encode()
    with socket.create_connection((host, int(port)), timeout=120) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw)
        )
        received = b""
        while b'"text": "' not in received and len(received) < 1 << 16:
            chunk = sock.recv(4096)
            if not chunk:
                break
            received += chunk
