"""OpenAI's completions and chat completions (`POST /v1/completions`, `/v1/chat/completions`): the JSON
reply and the server-sent event stream (`data: {chunk}` lines, then `data: [DONE]`) of a generation job.
Not here: parsing requests (`requests.py`), routing (`app.py`) or generation (`worker.py`).
"""

import json
import time
import uuid

from flask import Response, jsonify


class Reply:
    """The reply to one job: its id, creation time and object names, as chunks or one body."""

    def __init__(self, job, model: str, chat: bool, timeout_s: float):
        self.job, self.model, self.chat, self.timeout_s = job, model, chat, timeout_s
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    def whole(self) -> Response:
        """One JSON body once the job ends (status 499 if the client went away first)."""
        try:
            parts, finish, usage = [], None, None
            for event in self.job.stream(self.timeout_s):
                if event[0] == "text":
                    parts.append(event[1])
                elif event[0] == "error":
                    raise event[1]
                else:
                    finish, usage = event[1], event[2]
        finally:
            self.job.cancelled.set()  # a no-op when done; stops the generation when the client went away
        if finish is None:  # the client went away: nobody reads this
            return Response(status=499)
        text = "".join(parts)
        choice = (
            {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
            if self.chat
            else {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        )
        body = {"id": self.id, "object": self.object, "created": self.created, "model": self.model}
        return jsonify(dict(body, choices=[choice], usage=usage))

    def stream(self, include_usage: bool):
        """Server-sent events as the job produces text: a chunk per piece, the finish, usage if asked."""
        try:
            if self.chat:
                yield self._chunk(first=True)
            for event in self.job.stream(self.timeout_s):
                if event[0] == "text":
                    yield self._chunk(event[1])
                elif event[0] == "error":
                    yield "data: " + json.dumps(event[1].body()) + "\n\n"
                    return
                else:
                    finish, usage = event[1], event[2]
                    yield self._chunk(None, finish)
                    if include_usage:
                        yield self._chunk(usage=usage)
            yield "data: [DONE]\n\n"
        finally:
            self.job.cancelled.set()  # a no-op when done; stops the generation when the client went away

    def _chunk(self, text=None, finish=None, usage=None, first=False) -> str:
        if self.chat:
            delta = (
                {"role": "assistant", "content": ""}
                if first
                else ({"content": text} if text is not None else {})
            )
            choice = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
        out = {
            "id": self.id,
            "object": self.object + (".chunk" if self.chat else ""),
            "created": self.created,
            "model": self.model,
            "choices": [choice] if usage is None or finish is not None or first else [],
        }
        if usage is not None:
            out["usage"] = usage
        return "data: " + json.dumps(out) + "\n\n"
