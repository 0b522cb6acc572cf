"""The Flask app: OpenAI-compatible `/v1/completions`, `/v1/chat/completions`, `/v1/models`, Anthropic's
`/v1/messages` (for coding agents), plus
`/health` (cache, prefetch and memory statistics), `/metrics` (the same in Prometheus text) and a live
page at `/` (`dashboard.py`).

`create_app(engine)` wraps an engine in a `GenerationWorker`; request threads only validate, tokenize,
queue a job and relay its events, as server-sent events (`stream: true`) or one JSON body, and cancel it
when the client goes away. Every bad request gets a JSON error with a 4xx status before any streaming
starts, and the server keeps serving. `serve` binds the port before loading the model, answers on it
that it is loading until it is ready (`starting.py`) and shuts down cleanly on Ctrl-C or SIGTERM. Not
here: generation (`worker.py`), validation rules (`requests.py`), Host/Origin/body checks (`guard.py`)
or the statistics documents (`health.py`).
"""

import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import jinja2
from flask import Flask, Response, g, jsonify, request
from werkzeug.serving import WSGIRequestHandler

from ..errors import RankLost, UserError
from ..generation.drafts import CLI_DRAFT_TOKENS
from ..generation.sampling import vocab_size_of
from ..preflight import engine_capabilities
from ..units import MB
from . import anthropic, dashboard, guard, openai, ranks
from .drafting import ServerDraft
from .flask_app import ServerApp
from .health import health_body, prometheus_text
from .kv_room import KvRoom
from .requests import ApiError, check_draft, check_model, parse_messages, parse_params, parse_prompt
from .schedule import ScheduleLog
from .starting import Starter, Switch, loading_app, served_name
from .warm_up import warmed_loader
from .worker import GenerationWorker

# Used when a tokenizer has no chat template, as the embedded model's (a code model trained on raw Python,
# never on conversations): the conversation is continued as text, system messages as comment lines and every
# other message's text as it is, a line apart (written as expressions: chat templates render with
# trim_blocks, which drops a newline after a tag), so a user message holding code gets its continuation.
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'system' %}# {{ m['content'] | replace('\\n', '\\n# ') }}"
    "{% else %}{{ m['content'] }}{% endif %}{% if not loop.last %}{{ '\\n' }}{% endif %}{% endfor %}"
)


def create_app(
    engine=None,
    *,
    worker: GenerationWorker | None = None,
    model_name: str | None = None,
    max_tokens: int | None = None,
    max_input_tokens: int | None = None,
    default_max_tokens: int = 256,
    max_body_bytes: int = 4 * MB,
    event_timeout_s: float = 600.0,
    allowed_hosts: frozenset[str] | None = None,
    allowed_origins=(),
    max_batch: int = 8,
    schedule=None,
    draft_model=None,
    num_draft_tokens: int = CLI_DRAFT_TOKENS,
) -> ServerApp:
    """The server app for `engine` (or for a running `worker`, whose thread owns the engine).

    max_tokens: the most tokens one request may ask for (default: the model's maximum positions; a
    generation also stops where prompt and completion fill them, finish reason "length").
    max_input_tokens: the longest prompt (default: one less than the model's maximum positions, so that
    a token fits after it). allowed_hosts: the Host names answered (default: the loopback names; see
    `guard.host_names`). allowed_origins: browser origins (`https://example.org`, or `*`) allowed besides
    the server's own. max_batch: requests decoded together (1: one at a time, with prompt-cache reuse);
    schedule: a `schedule.ScheduleLog` the batch logs its schedule to (for replaying it). draft_model,
    num_draft_tokens: a draft every request decodes with (`drafting.py`; batching is then off).
    model_name: the name it answers to (default: the model folder's name; a request may also name the
    folder's path or "default").
    """
    drafting = ServerDraft(draft_model, num_draft_tokens)
    worker = worker or GenerationWorker(engine, max_batch=max_batch, schedule=schedule, drafting=drafting)
    worker.ready.wait()
    if worker.load_error is not None:
        raise worker.load_error
    engine = worker.engine
    name = model_name or engine.model_path.name
    limits = _Limits(
        max_tokens=engine.max_positions if max_tokens is None else max_tokens,
        max_input_tokens=engine.max_positions - 1 if max_input_tokens is None else max_input_tokens,
        default_max_tokens=default_max_tokens,
        event_timeout_s=event_timeout_s,
        vocab=vocab_size_of(engine.model) or getattr(engine.tokenizer, "vocab_size", None),
    )
    hosts = allowed_hosts if allowed_hosts is not None else guard.host_names("127.0.0.1")
    started = time.time()
    app = ServerApp(worker, max_body_bytes)
    guard.register(app, worker, hosts, frozenset(allowed_origins), max_body_bytes)
    _register_generation(app, worker, name, limits)
    _register_information(app, worker, name, started)
    dashboard.register(app, worker, name, started)
    return app


@dataclass(frozen=True)
class _Limits:
    """What one generation request may ask for."""

    max_tokens: int
    max_input_tokens: int
    default_max_tokens: int
    event_timeout_s: float
    vocab: int | None  # the model's vocabulary (its embedding's rows)


GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages")


def _register_generation(app: Flask, worker, name: str, limits: _Limits):
    """The three generation endpoints: validate, tokenize, queue a job, relay its events."""
    engine, tokenizer = worker.engine, worker.engine.tokenizer
    room = KvRoom.of(engine)

    def body_json() -> dict:
        data = guard.read_json(request)
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        check_model(data, (name, engine.model_path.name, str(engine.model_path), "default"))
        check_draft(data, worker.drafting.name)
        return data

    def chat_tokens(messages) -> list[int]:
        template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
        try:
            tokens = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, chat_template=template
            )
        except jinja2.TemplateError as e:  # a model's template refuses some conversations, on purpose
            raise ApiError(400, f"the model's chat template refused these messages: {e}", "messages")
        return list(tokens)

    @app.before_request
    def arriving():  # a batch about to prefill waits for requests still being read (`arrivals.py`)
        if request.method == "POST" and request.path in GENERATION_PATHS:
            g.arrival = worker.arrivals.begin()

    @app.teardown_request
    def arrived(_error=None):  # refused before it was queued
        if (arrival := g.pop("arrival", None)) is not None:
            arrival.end()

    def submit(tokens: list[int], params):
        _check_prompt(tokens, limits, engine.max_positions)
        release = room.admit(len(tokens), params.max_tokens, engine.max_positions) if room else None
        alive = guard.client_alive(request.environ)
        return worker.submit(tokens, params, alive, g.get("arrival"), release)

    def respond(tokens, params, chat: bool):
        reply = openai.Reply(submit(tokens, params), name, chat, limits.event_timeout_s)
        if not params.stream:
            return reply.whole()
        events = reply.stream(params.include_usage)
        return Response(events, mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})

    def params_of(data):
        return parse_params(data, limits.max_tokens, limits.default_max_tokens, limits.vocab)

    @app.post("/v1/completions")
    def completions():
        data = body_json()
        params, prompt = params_of(data), parse_prompt(data)
        tokens = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return respond(tokens, params, chat=False)

    @app.post("/v1/chat/completions")
    def chat_completions():
        data = body_json()
        params = params_of(data)
        return respond(chat_tokens(parse_messages(data)), params, chat=True)

    @app.post("/v1/messages")
    def messages():
        messages, params = anthropic.parse_request(body_json(), limits.max_tokens, limits.vocab)
        tokens = chat_tokens(messages)
        job = submit(tokens, params)
        if params.stream:
            return Response(
                anthropic.stream(job, name, len(tokens), limits.event_timeout_s),
                mimetype="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return jsonify(anthropic.message(job, name, limits.event_timeout_s))


def _check_prompt(tokens: list[int], limits: _Limits, max_positions: int):
    """A prompt over `--max-input-tokens` or with ids outside the model's vocabulary is a 400."""
    if len(tokens) > limits.max_input_tokens:
        raise ApiError(
            400,
            f"the prompt has {len(tokens)} tokens, over this server's limit of {limits.max_input_tokens} "
            f"(--max-input-tokens; the model takes {max_positions} positions, prompt and completion "
            "together)",
            "prompt",
            "context_length_exceeded",
        )
    # the model's own vocabulary (its embedding's rows): a tokenizer's vocab_size leaves out added special
    # tokens (Qwen3's <|im_start|> is past it)
    if limits.vocab and any(t >= limits.vocab for t in tokens):
        raise ApiError(
            400, f"the prompt has token ids outside the vocabulary (0 to {limits.vocab - 1})", "prompt"
        )


def _register_information(app: Flask, worker, name: str, started: float):
    """/v1/models, /v1/capabilities, /health and /metrics."""
    engine = worker.engine

    def named_capabilities() -> dict:  # by names: a client is not told the server's paths
        report = engine_capabilities(engine)
        predictor = report.get("predictor")
        if isinstance(predictor, dict) and predictor.get("path"):
            predictor = dict(predictor, path=Path(predictor["path"]).name)
        return dict(report, model=name, predictor=predictor)

    @app.get("/v1/models")
    def models():
        entry = {"id": name, "object": "model", "created": int(started), "owned_by": "od-moe"}
        return jsonify({"object": "list", "data": [dict(entry, capabilities=named_capabilities())]})

    @app.get("/v1/capabilities")
    def capabilities():
        return jsonify(named_capabilities())

    @app.get("/health")
    def health():
        body = health_body(worker, name, started)
        return jsonify(body), 200 if body["status"] in ("ok", "degraded") else 503

    @app.get("/metrics")
    def metrics():
        return Response(
            prometheus_text(health_body(worker, name, started)), mimetype="text/plain; version=0.0.4"
        )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on host:port, or a UserError saying why not (before any model is loaded)."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise UserError(f"cannot bind --host {host!r} ({e.strerror}): give an address of this machine")
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(128)
    except OSError as e:
        sock.close()
        raise UserError(
            f"cannot listen on {host}:{port} ({e.strerror}): another program holds that port or the "
            "address is not this machine's; choose another with --port or --host"
        )
    return sock


# The interpreter's switch interval while serving. The generation thread builds each pass in Python,
# holding the GIL for milliseconds; a request thread with a token to send, or a request to read, waits
# for the interval before taking it (Python's default: 5 ms). Measured in docs/GPU.md ("Time to first token").
SWITCH_INTERVAL_S = 0.0005


def serve(
    model=None,
    *,
    host="127.0.0.1",
    port=8080,
    max_tokens=None,
    max_input_tokens=None,
    allow_hosts=(),
    allow_origins=(),
    log=print,
    max_batch=8,
    schedule_log=None,
    draft_model=None,
    num_draft_tokens=CLI_DRAFT_TOKENS,
    model_name=None,
    **load_options,
):
    """Bind the port, load the model on the generation thread while the port answers that it is loading
    (`starting.py`), then serve until Ctrl-C or SIGTERM, which end the running streams with an error event
    and stop the generation thread before returning. What fails before the server is ready is raised
    (`starting.Starter.failure`). `model_name`: the name it answers to (default `starting.served_name`: a
    hub id as given, else the model folder's name). `load_options`: `od_moe.load`'s (capacity, predictor,
    two_tier...), a device budget keeping a KV cache for each of `max_batch` sequences. `schedule_log`: a
    file the running batch's schedule is written to (`schedule.py`). `draft_model`, `num_draft_tokens`: a
    draft for every request (`drafting.py`). Under `mlx.launch` rank 0 serves and the others follow its
    requests (`ranks.py`); where a rank was lost, `serve` raises `RankLost` once it stops."""
    from werkzeug.serving import make_server

    from ..distributed.rank_split import group_for

    group = group_for("auto")
    drafting = ServerDraft(draft_model, num_draft_tokens, across_ranks=group is not None)
    warmed = []  # the warm-up's seconds, on rank 0
    loader = warmed_loader(model, max_batch, load_options, warmed, drafting)
    if group is not None and group.rank() > 0:
        return ranks.follow(loader(), log)
    listener = bind(host, port)  # a busy port is found before the model loads
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    try:
        sink = _schedule_sink(schedule_log, max_batch)  # and a file that cannot be written
    except UserError:
        listener.close()
        raise
    schedule = None if sink is None else ScheduleLog(sink=sink)
    lead = partial(ranks.leading, log=log)  # rank 0's side, where the engine is split over ranks
    worker = GenerationWorker(
        loader=loader, max_batch=max_batch, schedule=schedule, drafting=drafting, across_ranks=lead
    )
    name, hosts = model_name or served_name(model), guard.host_names(host, allow_hosts)
    switch = Switch(loading_app(worker, name, hosts, allow_origins))
    try:
        server = make_server(
            host, port, switch, threaded=True, fd=listener.fileno(), request_handler=_RequestLog
        )
    finally:
        listener.close()  # the server holds its own descriptor of it

    def ready():  # on the starter's thread, once the worker is ready (raises what loading raised)
        limits = dict(max_tokens=max_tokens, max_input_tokens=max_input_tokens, allowed_origins=allow_origins)
        app = create_app(worker=worker, model_name=name, allowed_hosts=hosts, **limits)
        switch.hand_to(app)
        _say_serving(worker, name, f"http://{host}:{server.port}", warmed, schedule_log, log)
        return worker.across_ranks

    starter = Starter(worker, server, ready)
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, lambda *_: _interrupt()) if main_thread else None
    try:
        server.serve_forever()  # returns on Ctrl-C (werkzeug catches the KeyboardInterrupt) or a failed start
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        failure = starter.failure()
        _shut_down(worker, starter.leader, server, sink, log if failure is None else lambda _: None)
    if failure is not None:  # the CLI's one line
        raise failure
    if main_thread and not worker.ready.is_set():
        _end_while_loading()
    if worker.broken is not None:
        raise RankLost(worker.broken)


def _end_while_loading():
    """Stopped while the model loads, which cannot be stopped midway: the process ends here, at once. An
    interpreter that exits while the generation thread goes in and out of MLX aborts ("terminate called":
    the thread, stopped at once as it takes the GIL back, unwinds through MLX's C++ frames)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _say_serving(worker, name: str, url: str, warmed: list, schedule_log, log):
    """The lines `serve` says once it is ready: the model, its capacity and batch, and why either was cut."""
    engine = worker.engine
    log(
        f"od-moe serving {name} on {url} (capacity {engine.capacity}/{engine.num_experts} experts per layer, "
        f"{worker.max_batch} request{'s' if worker.max_batch > 1 else ''} at once)"
    )
    if engine.capacity_choice:
        log(f"od-moe: {engine.capacity_choice}")
    if warmed:
        log(f"od-moe: warmed up in {warmed[0]:.1f} s (a short request: what a first one compiles)")
    if worker.batch_cut:
        log(f"od-moe: {worker.batch_cut}")
        if schedule_log is not None:
            log(f"od-moe: the schedule log {schedule_log} records no steps: requests run one at a time")


def _shut_down(worker, leader, server, sink, log):
    """Stop the generation thread, the other ranks, the server and the schedule log, in that order."""
    log("od-moe: shutting down")
    finished = worker.shutdown()
    if leader is not None and worker.broken is None:
        leader.end()
    _wait_for_relays(worker)
    server.server_close()
    if finished and worker.engine is not None:  # (none where loading failed)
        worker.engine.close()
    if sink is not None:
        sink.close()


def _schedule_sink(path, max_batch: int):
    """The file `--schedule-log` names, opened for writing (None without one)."""
    if path is None:
        return None
    if max_batch < 2:
        raise UserError("--schedule-log needs --max-batch 2 or more: one request at a time runs no batch")
    try:
        return open(path, "w")
    except OSError as e:
        raise UserError(f"cannot write the schedule log {path}: {e.strerror}") from None


class _RequestLog(WSGIRequestHandler):
    """werkzeug's request handler, whose request lines are coloured only when stderr is a terminal (and
    NO_COLOR is unset): werkzeug colours them wherever they go, and a log file then carries the codes."""

    colour = sys.stderr.isatty() and not os.environ.get("NO_COLOR")

    def log_request(self, code="-", size="-"):
        if self.colour:
            return super().log_request(code, size)
        self.log("info", '"%s" %s %s', self.requestline, code, size)


def _interrupt():
    raise KeyboardInterrupt


def _wait_for_relays(worker, timeout_s: float = 5.0):
    """Give the request threads the time to relay the shutdown error the worker left their jobs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not worker.shutdown_relayed():
        time.sleep(0.05)
    time.sleep(0.1)  # taken from the queue is not yet written to the socket
