"""Anthropic's Messages API (`POST /v1/messages`), which coding agents speak: request parsing, the JSON
reply, and its server-sent event stream (message_start ... message_stop). Text content only.
Not here: routing or generation (`app.py`, `worker.py`).
"""

import json
import uuid

from ..generation.sampling import ANTHROPIC_MAX_TEMPERATURE
from .requests import ApiError, GenerationParams, parse_messages, parse_params

_STOP_REASONS = {"length": "max_tokens", "stop": "end_turn"}


def error_body(e: ApiError) -> dict:
    return {"type": "error", "error": {"type": e.kind, "message": e.message}}


def _text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(b, dict) and b.get("type") == "text" and isinstance(b.get("text"), str) for b in content
    ):
        return "".join(b["text"] for b in content)
    raise ApiError(400, f"{where} must be a string or a list of text blocks (only text is supported)", where)


def parse_request(body: dict, max_tokens_cap: int, vocab_size: int | None = None):
    """(chat messages, GenerationParams) from a Messages API body."""
    if body.get("max_tokens") is None:
        raise ApiError(400, "'max_tokens' is required", "max_tokens")
    stop = body.get("stop_sequences")
    if stop is not None and not (isinstance(stop, list) and all(isinstance(x, str) for x in stop)):
        raise ApiError(400, "'stop_sequences' must be a list of strings", "stop_sequences")
    openai_body = {k: body[k] for k in ("max_tokens", "temperature", "top_p", "top_k", "stream") if k in body}
    openai_body["stop"] = (stop or [])[:4]
    params: GenerationParams = parse_params(
        openai_body, max_tokens_cap, 0, vocab_size, max_temperature=ANTHROPIC_MAX_TEMPERATURE
    )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "'messages' must be a non-empty list", "messages")
    chat = []
    if body.get("system") is not None:
        chat.append({"role": "system", "content": _text(body["system"], "system")})
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("user", "assistant"):
            raise ApiError(
                400, f"messages[{i}] must be an object with role 'user' or 'assistant'", "messages"
            )
        chat.append({"role": m["role"], "content": _text(m.get("content"), f"messages[{i}].content")})
    return parse_messages({"messages": chat}), params


def _stop(finish, matched):
    return ("stop_sequence" if matched else _STOP_REASONS.get(finish, "end_turn")), matched


def message(job, model: str, timeout_s: float) -> dict:
    parts, finish, usage, matched = [], None, {}, None
    for event in job.stream(timeout_s):
        if event[0] == "text":
            parts.append(event[1])
        elif event[0] == "error":
            raise event[1]
        else:
            _, finish, usage, matched = event
    reason, seq = _stop(finish, matched)
    return {
        "id": "msg_" + uuid.uuid4().hex[:24],
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": "".join(parts)}],
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": {
            "input_tokens": usage.get("prompt_tokens", 0),
            "output_tokens": usage.get("completion_tokens", 0),
        },
    }


def stream(job, model: str, input_tokens: int, timeout_s: float):
    def sse(name, data):
        return f"event: {name}\ndata: {json.dumps(dict(data, type=name))}\n\n"

    try:
        yield sse(
            "message_start",
            {
                "message": {
                    "id": "msg_" + uuid.uuid4().hex[:24],
                    "type": "message",
                    "role": "assistant",
                    "model": model,
                    "content": [],
                    "stop_reason": None,
                    "stop_sequence": None,
                    "usage": {"input_tokens": input_tokens, "output_tokens": 0},
                }
            },
        )
        yield sse("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
        for event in job.stream(timeout_s):
            if event[0] == "text":
                yield sse(
                    "content_block_delta", {"index": 0, "delta": {"type": "text_delta", "text": event[1]}}
                )
            elif event[0] == "error":
                yield sse("error", {"error": error_body(event[1])["error"]})
                return
            else:
                _, finish, usage, matched = event
                reason, seq = _stop(finish, matched)
                yield sse("content_block_stop", {"index": 0})
                yield sse(
                    "message_delta",
                    {
                        "delta": {"stop_reason": reason, "stop_sequence": seq},
                        "usage": {"output_tokens": usage.get("completion_tokens", 0)},
                    },
                )
                yield sse("message_stop", {})
    finally:
        job.cancelled.set()
