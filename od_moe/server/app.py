"""The Flask app: OpenAI-compatible `/v1/completions`, `/v1/chat/completions`, `/v1/models`, Anthropic's
`/v1/messages` (for coding agents), plus
`/health` (cache, prefetch and memory statistics) and `/metrics` (the same in Prometheus text).

`create_app(engine)` wraps an engine in a `GenerationWorker`; request threads only validate, tokenize,
queue a job and relay its events, as server-sent events (`stream: true`) or one JSON body. Every bad
request gets an OpenAI-style JSON error with a 4xx status and the server keeps serving.
Not here: generation (`worker.py`) or validation rules (`requests.py`).
"""

import json
import time
import uuid

from flask import Flask, Response, jsonify, request
from werkzeug.exceptions import HTTPException

from ..preflight import engine_capabilities
from . import anthropic
from .requests import ApiError, parse_messages, parse_params, parse_prompt
from .worker import GenerationWorker

# Used when a tokenizer has no chat template (the embedded model ships one of its own).
FALLBACK_CHAT_TEMPLATE = (
    "{% for m in messages %}# {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}# assistant:\n{% endif %}"
)


def create_app(
    engine=None,
    *,
    worker: GenerationWorker | None = None,
    model_name: str | None = None,
    max_tokens: int = 4096,
    max_input_tokens: int = 16384,
    default_max_tokens: int = 256,
    max_body_bytes: int = 4 * 2**20,
    event_timeout_s: float = 600.0,
) -> Flask:
    """The server app for `engine` (or for a running `worker`, whose thread owns the engine)."""
    worker = worker or GenerationWorker(engine)
    worker.ready.wait()
    if worker.load_error is not None:
        raise worker.load_error
    engine = worker.engine
    name = model_name or engine.model_path.name
    tokenizer = engine.tokenizer
    started = time.time()
    app = Flask("od_moe.server")
    app.config["MAX_CONTENT_LENGTH"] = max_body_bytes
    app.json.sort_keys = False

    @app.errorhandler(ApiError)
    def api_error(e: ApiError):
        with worker.lock:
            worker.counters["rejected"] += 1
        if request.path == "/v1/messages":
            return jsonify(anthropic.error_body(e)), e.status
        return jsonify(e.body()), e.status

    @app.errorhandler(HTTPException)
    def http_error(e: HTTPException):
        kind = {404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large"}.get(
            e.code, "invalid_request_error"
        )
        message = {
            404: f"no route {request.method} {request.path}: see GET /v1/models, POST /v1/completions, "
            f"POST /v1/chat/completions, GET /health",
            413: f"request body is over the limit of {max_body_bytes} bytes",
        }.get(e.code, e.description)
        return api_error(ApiError(e.code, message, kind=kind))

    def body_json() -> dict:
        data = request.get_json(force=True, silent=True)
        if data is None:
            raise ApiError(400, "the request body is not valid JSON")
        if not isinstance(data, dict):
            raise ApiError(400, "the request body must be a JSON object")
        model = data.get("model")
        if model is not None and model not in (name, str(engine.model_path), "default"):
            raise ApiError(
                404,
                f"model {model!r} is not served here; this server serves {name!r}",
                "model",
                "model_not_found",
                kind="not_found_error",
            )
        return data

    def check_length(prompt_tokens):
        if len(prompt_tokens) > max_input_tokens:
            raise ApiError(
                413,
                f"the prompt has {len(prompt_tokens)} tokens, over this server's limit of "
                f"{max_input_tokens} (--max-input-tokens)",
                "prompt",
                "context_length_exceeded",
                kind="request_too_large",
            )
        vocab = getattr(tokenizer, "vocab_size", None)
        if vocab and any(t >= vocab for t in prompt_tokens):
            raise ApiError(
                400, f"the prompt has token ids outside the vocabulary (0 to {vocab - 1})", "prompt"
            )

    @app.post("/v1/completions")
    def completions():
        data = body_json()
        params = parse_params(data, max_tokens, default_max_tokens)
        prompt = parse_prompt(data)
        tokens = tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_length(tokens)
        return respond(tokens, params, chat=False)

    @app.post("/v1/chat/completions")
    def chat_completions():
        data = body_json()
        params = parse_params(data, max_tokens, default_max_tokens)
        messages = parse_messages(data)
        template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
        tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=True, chat_template=template)
        check_length(tokens)
        return respond(list(tokens), params, chat=True)

    @app.post("/v1/messages")
    def messages():
        data = body_json()
        messages, params = anthropic.parse_request(data, max_tokens)
        template = None if getattr(tokenizer, "chat_template", None) else FALLBACK_CHAT_TEMPLATE
        tokens = list(
            tokenizer.apply_chat_template(messages, add_generation_prompt=True, chat_template=template)
        )
        check_length(tokens)
        job = worker.submit(tokens, params)
        if params.stream:
            return Response(
                anthropic.stream(job, name, len(tokens), event_timeout_s),
                mimetype="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        return jsonify(anthropic.message(job, name, event_timeout_s))

    @app.get("/v1/models")
    def models():
        entry = {"id": name, "object": "model", "created": int(started), "owned_by": "od-moe"}
        return jsonify({"object": "list", "data": [dict(entry, capabilities=engine_capabilities(engine))]})

    @app.get("/v1/capabilities")
    def capabilities():
        return jsonify(engine_capabilities(engine))

    @app.get("/health")
    def health():
        return jsonify(health_body(worker, name, started))

    @app.get("/metrics")
    def metrics():
        return Response(
            prometheus_text(health_body(worker, name, started)), mimetype="text/plain; version=0.0.4"
        )

    def respond(tokens, params, chat: bool):
        job = worker.submit(tokens, params)
        ident = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        obj = "chat.completion" if chat else "text_completion"

        def events():
            return job.stream(event_timeout_s)

        def chunk(delta_text=None, finish=None, usage=None, first=False):
            if chat:
                delta = (
                    {"role": "assistant", "content": ""}
                    if first
                    else ({"content": delta_text} if delta_text is not None else {})
                )
                choice = {"index": 0, "delta": delta, "finish_reason": finish}
            else:
                choice = {"index": 0, "text": delta_text or "", "logprobs": None, "finish_reason": finish}
            out = {
                "id": ident,
                "object": obj + (".chunk" if chat else ""),
                "created": created,
                "model": name,
                "choices": [choice] if usage is None or finish is not None or first else [],
            }
            if usage is not None:
                out["usage"] = usage
            return "data: " + json.dumps(out) + "\n\n"

        if not params.stream:
            try:
                parts, finish, usage = [], None, None
                for event in events():
                    if event[0] == "text":
                        parts.append(event[1])
                    elif event[0] == "error":
                        raise event[1]
                    else:
                        finish, usage = event[1], event[2]
            except GeneratorExit:
                job.cancelled.set()
                raise
            text = "".join(parts)
            choice = (
                {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
                if chat
                else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            )
            return jsonify(
                {
                    "id": ident,
                    "object": obj,
                    "created": created,
                    "model": name,
                    "choices": [choice],
                    "usage": usage,
                }
            )

        def stream():
            try:
                if chat:
                    yield chunk(first=True)
                for event in events():
                    if event[0] == "text":
                        yield chunk(event[1])
                    elif event[0] == "error":
                        yield "data: " + json.dumps(event[1].body()) + "\n\n"
                        return
                    else:
                        finish, usage = event[1], event[2]
                        yield chunk(None, finish)
                        if params.include_usage:
                            yield chunk(usage=usage)
                yield "data: [DONE]\n\n"
            finally:
                job.cancelled.set()  # a no-op when done; stops the generation when the client went away

        return Response(stream(), mimetype="text/event-stream", headers={"Cache-Control": "no-cache"})

    app.worker = worker
    return app


def health_body(worker: GenerationWorker, name: str, started: float) -> dict:
    """The /health document, from the engine's live ledger: it moves token by token during a generation."""
    stats = worker.engine.stats(settle=False)
    total = stats["total"]
    prefetch = stats["prefetch"]
    with worker.lock:
        requests = dict(
            worker.counters,
            active=worker.active,
            queued=worker.queued(),
            prompt_tokens=worker.prompt_tokens,
            cached_prompt_tokens=worker.cached_tokens,
            completion_tokens=worker.completion_tokens,
        )
    return {
        "status": "ok" if worker.thread.is_alive() else "error",
        "model_loaded": worker.engine is not None,
        "model": name,
        "expert_cache_stats": {
            "cache_hits": total.get("hits", 0),
            "cache_misses": total.get("misses", 0),
            "hit_rate": total.get("hit_rate"),
            "decode_hit_rate": total["decode"]["hit_rate"],
            "decode_lookups": total["decode"]["lookups"],
            "prefill_hit_rate": total.get("prefill", {}).get("hit_rate"),
            "working_set_experts": total.get("resident", 0),
            "pinned_experts": total.get("pinned", 0),
            "capacity": stats.get("capacity"),
            "capacity_fraction": stats.get("capacity_fraction"),
            "num_experts": stats.get("num_experts"),
            "moe_layers": stats.get("moe_layers"),
            "per_layer_hit_rate": [layer["hit_rate"] for layer in stats.get("layers", [])],
            "prefetch": prefetch,
            "bytes_read": total.get("bytes_read", 0),
            "stall_s": total.get("stall_s", 0.0),
            "experts_loaded": total.get("experts_loaded", 0),
            "evictions": total.get("evictions", 0),
            "miss_policy": stats.get("miss_policy"),
            "tokens": stats.get("tokens"),
        },
        "memory": stats.get("memory", {}),
        "uptime_s": time.time() - started,
        "requests": requests,
    }


def prometheus_text(health: dict) -> str:
    c = health["expert_cache_stats"]
    lines = []

    def metric(key, value, kind="gauge", labels=""):
        if value is None:
            return
        lines.append(f"# TYPE od_moe_{key} {kind}")
        lines.append(f"od_moe_{key}{labels} {float(value)}")

    metric("expert_cache_hits_total", c["cache_hits"], "counter")
    metric("expert_cache_misses_total", c["cache_misses"], "counter")
    metric("expert_cache_hit_rate", c["hit_rate"])
    metric("expert_bytes_read_total", c["bytes_read"], "counter")
    metric("expert_stall_seconds_total", c["stall_s"], "counter")
    metric("expert_cache_resident", c["working_set_experts"])
    metric("prefetch_precision", c["prefetch"].get("precision"))
    for i, rate in enumerate(c["per_layer_hit_rate"]):
        if rate is not None:
            lines.append(f'od_moe_layer_hit_rate{{layer="{i}"}} {float(rate)}')
    for key, value in health["requests"].items():
        metric(f"requests_{key}", value)
    metric("memory_peak_bytes", health["memory"].get("peak_bytes"))
    metric("uptime_seconds", health["uptime_s"])
    return "\n".join(lines) + "\n"


def serve(
    model=None,
    *,
    predictor=None,
    prefetch=None,
    host="127.0.0.1",
    port=8080,
    capacity=None,
    memory_budget=None,
    max_tokens=4096,
    max_input_tokens=16384,
    direct_io="auto",
    log=print,
):
    """Load the model on the generation thread, then serve until interrupted."""
    from werkzeug.serving import make_server

    from .. import load

    worker = GenerationWorker(
        loader=lambda: load(
            model,
            capacity=capacity,
            memory_budget=memory_budget,
            predictor=predictor,
            prefetch=prefetch,
            direct_io=direct_io,
        )
    )
    app = create_app(worker=worker, max_tokens=max_tokens, max_input_tokens=max_input_tokens)
    server = make_server(host, port, app, threaded=True)
    log(
        f"od-moe serving {worker.engine.model_path.name} on http://{host}:{server.server_port} "
        f"(capacity {worker.engine.capacity}/{worker.engine.num_experts} experts per layer)"
    )
    try:
        server.serve_forever()
    finally:
        worker.stop()
