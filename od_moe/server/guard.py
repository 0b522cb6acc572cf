"""What the server checks about a request before any route reads it, and how it notices a client has gone.

A web page the user visits can send simple cross-site POSTs to a local server, and after DNS rebinding read
the answers. So: the Host header must name an address the server answers to (its bound address, the
loopback names when bound to loopback, names added with `--allow-host`); a browser request from another
origin (its `Origin` header) is refused unless `--allow-origin` lists it; a POST body must be
`application/json`. Bodies are read under the size limit (chunked ones too) and parsed as strict JSON: no
NaN or Infinity (nor numbers that overflow to it), no lone surrogates, at most `MAX_DEPTH` levels deep. A
body over the limit gets 413 and its connection is closed without waiting for the rest. `register` puts
these checks, and errors answered as JSON, on an app (the server's, and the one answering while the model
loads, `starting.py`). Not here: the routes (`app.py`) or the meaning of fields (`requests.py`).
"""

import ipaddress
import json
import select
import socket
from collections.abc import Callable, Iterable
from typing import cast

from flask import Flask, Request, g, jsonify, request
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from . import anthropic
from .requests import ApiError

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
WILDCARD = ("", "0.0.0.0", "::")
# Deeper than any API body needs (a message's content parts are 4 levels down, a tool's schema maybe 20).
MAX_DEPTH = 64
NESTING = frozenset((dict, list))  # the types json.loads nests


def host_names(bound: str, extra: Iterable[str] = ()) -> frozenset[str]:
    """The Host names a server bound to `bound` answers to. Bound to every interface, any IP literal
    is accepted too (DNS rebinding needs a name); see `host_allowed`."""
    names = {bound.strip("[]").lower()} | {n.strip("[]").lower() for n in extra}
    if bound in WILDCARD or _is_loopback(bound):
        names |= set(LOOPBACK_NAMES)
    if bound in WILDCARD:
        names |= {socket.gethostname().lower(), "*ip"}
    return frozenset(names)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _hostname(host_header: str) -> str:
    host = host_header.strip().lower()
    if host.startswith("["):  # [::1]:8080
        return host[1 : host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def host_allowed(host_header: str, names: frozenset[str]) -> bool:
    name = _hostname(host_header)
    if name in names:
        return True
    if "*ip" in names:
        try:
            ipaddress.ip_address(name)
            return True
        except ValueError:
            return False
    return False


def check_request(request: Request, names: frozenset[str], origins: frozenset[str]) -> str | None:
    """Raise an ApiError for a request from the wrong place; return the origin to allow by CORS headers
    (None for a request without a cross-origin `Origin`)."""
    if not host_allowed(request.host, names):
        shown = ", ".join(sorted(n for n in names if n != "*ip"))
        raise ApiError(
            403,
            f"Host {request.host!r} is not an address of this server ({shown}): connect to one of "
            "those, or start od-moe serve with --allow-host NAME",
            kind="permission_error",
        )
    origin = request.headers.get("Origin")
    if origin is None or origin.lower() == request.host_url.rstrip("/").lower():
        return None
    if origin in origins or "*" in origins:
        return origin
    raise ApiError(
        403,
        f"cross-origin requests from {origin!r} are refused: start od-moe serve with --allow-origin "
        f"{origin} to allow that page",
        kind="permission_error",
    )


def _no_constants(name: str):
    raise ValueError(f"{name} is not JSON")


def _body(request: Request) -> bytes:
    """The body, or RequestEntityTooLarge past the limit: werkzeug checks a declared Content-Length, but
    cuts a chunked body at the limit without a word, so that one is read here to one byte past it."""
    limit = request.max_content_length
    if not request.environ.get("wsgi.input_terminated") or limit is None:
        return request.get_data(cache=True)
    stream, parts, size = request.environ["wsgi.input"], [], 0
    while size <= limit and (part := stream.read(min(2**16, limit + 1 - size))):
        parts.append(part)
        size += len(part)
    if size > limit:
        raise RequestEntityTooLarge()
    return b"".join(parts)


def read_json(request: Request):
    """The body of a POST as strict JSON (any value; the caller checks it is an object), checked whole by
    `check_json` before any field is read."""
    if request.mimetype != "application/json":
        raise ApiError(
            415,
            f"the request body must be JSON sent with Content-Type: application/json (got "
            f"{request.mimetype or 'none'!r})",
            kind="invalid_request_error",
        )
    raw = _body(request)
    try:
        data = json.loads(raw, parse_constant=_no_constants)
    except RecursionError:  # the decoder recurses per level: far past MAX_DEPTH, it runs out of stack
        raise ApiError(
            400, f"the request body is nested deeper than {MAX_DEPTH} levels: send a flatter JSON object"
        )
    except ValueError as e:  # also undecodable UTF-8 and integers of over 4300 digits
        raise ApiError(400, f"the request body is not valid JSON ({e})")
    check_json(data)
    return data


def check_json(data):
    """Raise an ApiError unless every value of `data` can be read and answered without surprise: nested
    at most MAX_DEPTH levels (deeper values would exhaust the stack of whatever recurses on them),
    numbers finite (1e309 parses as infinity), text valid Unicode (no lone surrogate escapes)."""
    level = [data] if type(data) in NESTING else []
    for _ in range(MAX_DEPTH):  # level by level, without recursion: depth is what is checked
        inner = []
        for value in level:
            items = value.values() if type(value) is dict else value
            if not NESTING.isdisjoint(map(type, items)):  # in C: most lists are of numbers or text
                inner.extend(v for v in items if type(v) in NESTING)
        level = inner
    if level:
        raise ApiError(
            400, f"the request body is nested deeper than {MAX_DEPTH} levels: send a flatter JSON object"
        )
    try:  # numbers and text, checked at C speed
        json.dumps(data, ensure_ascii=False, allow_nan=False).encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(
            400,
            "the request body has a lone surrogate (an unpaired \\ud800-\\udfff escape) in a string: send "
            "valid UTF-8 text",
        )
    except ValueError:
        raise ApiError(
            400,
            "the request body has a number too large for a double (it reads as infinity): send a finite "
            "number",
        )


def is_too_large(error: BaseException) -> bool:
    return isinstance(error, RequestEntityTooLarge)


def discard_body(environ: dict, cap: int = 64 * 2**20, timeout_s: float = 2.0):
    """After a 413: read what is left of the body (up to `cap` bytes, `timeout_s` per read), then stop
    reading the connection, so the server answers and closes it at once instead of waiting on the
    client. Reading the rest first lets the client see the 413 rather than a reset."""
    sock = environ.get("werkzeug.socket")
    stream = environ.get("wsgi.input")
    if sock is None or stream is None:
        return
    try:
        sock.settimeout(timeout_s)
        left = cap
        declared = environ.get("CONTENT_LENGTH")
        if not environ.get("wsgi.input_terminated") and declared and declared.isdigit():
            left = min(cap, int(declared))
        while left > 0:
            data = stream.read(min(left, 2**16))
            if not data:
                break
            left -= len(data)
    except (OSError, ValueError):
        pass
    try:
        sock.shutdown(socket.SHUT_RD)
    except OSError:
        pass


def client_alive(environ: dict) -> Callable[[], bool]:
    """A check that the client of this request is still connected: its socket, once the body is read,
    only becomes readable when the client closes it (a read would then return nothing)."""
    sock = environ.get("werkzeug.socket")

    def alive() -> bool:
        if sock is None:
            return True
        try:
            readable, _, _ = select.select([sock], [], [], 0)
            return not readable or sock.recv(1, socket.MSG_PEEK) != b""
        except (OSError, ValueError):
            return False

    return alive


def error_response(e: ApiError):
    """`e` as the route's API words it: Anthropic's error body on /v1/messages, OpenAI's elsewhere."""
    body = anthropic.error_body(e) if request.path == "/v1/messages" else e.body()
    return jsonify(body), e.status, e.headers


def register(app: Flask, worker, hosts: frozenset[str], origins: frozenset[str], max_body_bytes: int):
    """On every request of `app`: the Host and Origin checks and CORS; every error as JSON (4xx for the
    client's), counted in `worker`'s counters."""

    @app.errorhandler(ApiError)
    def api_error(e: ApiError):
        worker.count_rejected()
        return error_response(e)

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        code = e.code
        assert code is not None  # Flask hands an exception without a code (a proxy's) back unhandled
        kind = {404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large"}.get(
            code, "invalid_request_error"
        )
        message = {
            404: f"no route {request.method} {request.path}: see GET /v1/models, POST /v1/completions, "
            f"POST /v1/chat/completions, POST /v1/messages, GET /health, GET /metrics, GET / (dashboard)",
            405: f"{request.method} is not a method of {request.path}: use "
            f"{' or '.join(sorted(set(getattr(e, 'valid_methods', None) or ()) - {'HEAD', 'OPTIONS'}))}",
            413: f"the request body is over the limit of {max_body_bytes} bytes: send a shorter prompt",
        }.get(code, cast(str, e.description))  # every HTTPException with a code that Flask hands here has one
        if is_too_large(e):
            discard_body(request.environ)  # then the 413 goes out and the connection closes
        return api_error(ApiError(code, message, kind=kind))

    @app.errorhandler(Exception)
    def server_error(e: Exception):
        app.logger.exception("request failed")
        worker.count_route_error()
        return error_response(
            ApiError(500, f"internal error ({type(e).__name__}): see the server's log", kind="server_error")
        )

    @app.before_request
    def guard_request():
        g.cors_origin = check_request(request, hosts, origins)

    @app.after_request
    def cors(response):
        origin = g.get("cors_origin")
        if origin is not None:
            response.headers["Access-Control-Allow-Origin"] = origin
            response.headers["Access-Control-Allow-Headers"] = "Content-Type, Authorization"
            response.headers["Access-Control-Allow-Methods"] = "GET, POST, OPTIONS"
            response.headers["Vary"] = "Origin"
        return response
