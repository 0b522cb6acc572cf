"""Fuzzed requests (issue 35, item 13): every route and method the server exposes, fed a few hundred generated
bodies (from a seeded generator, so a failure repeats) and the named nasty ones: malformed, deeply nested,
non-UTF-8 or non-object JSON, extreme numbers, odd types and shapes, empty bodies, wrong content types.
None may get a 5xx: a 4xx is a JSON error whose message says what to do, anything else a valid response, and
good requests still succeed afterwards. Run through Flask's test client against a real app on the bundled
model, capped at a few tokens so that the bodies that do generate stay quick.
Not here: hostile connections (hang-ups, chunked bodies, Host and Origin checks: `test_bad_input.py`).
"""

import copy
import json
import random
import re

import jinja2
import pytest

import od_moe
from od_moe.server import create_app

CAP, MAX_INPUT, MAX_BODY = 3, 256, 256 * 1024
CHAT = {"messages": [{"role": "user", "content": "sort a list"}], "max_tokens": 2}
GOOD = {
    "/v1/completions": {"prompt": "def f(x):", "max_tokens": 2},
    "/v1/chat/completions": CHAT,
    "/v1/messages": CHAT,
}
FIELDS = (
    "model",
    "prompt",
    "messages",
    "max_tokens",
    "max_completion_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_sequences",
    "stream",
    "stream_options",
    "n",
    "logprobs",
    "top_logprobs",
    "system",
    "metadata",
)
INNER = ("role", "content", "type", "text", "include_usage", "name")
INTS = (0, -1, 1, 2, 7, 2**31, 2**63 - 1, 2**63, -(2**63) - 1, 10**30, 10**4000, -(10**4000))
FLOATS = (0.0, -0.0, 0.5, 1.5, 5e-324, 1e308, -1e308, float("nan"), float("inf"), float("-inf"))
STRINGS = (
    "",
    " ",
    "x",
    "user",
    "assistant",
    "system",
    "text",
    "tiny-qwen3-moe-4bit",
    "def f(x):",
    "\x00",
    "\u202e\u05d0\u0645",
    "\U0001f600" * 20,
    "\ud800",  # a lone surrogate
    "a" * 5000,
    "é" * 3000,
)
METHODS = ("GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")


def odd_value(rng: random.Random, depth: int = 0):
    """A JSON value of a random kind and shape, leaning to the edges of each kind."""
    kind = rng.randrange(10 if depth < 3 else 6)
    if kind == 0:
        return rng.choice((None, True, False))
    if kind == 1:
        return rng.choice(INTS)
    if kind == 2:
        return rng.choice(FLOATS)
    if kind == 3:
        return rng.choice(STRINGS)
    if kind == 4:
        return rng.randint(-3, 9000)
    if kind == 5:
        return rng.uniform(-1, 3)
    if kind == 6:
        return [odd_value(rng, depth + 1) for _ in range(rng.randrange(5))]
    if kind == 7:
        return {rng.choice(FIELDS + INNER): odd_value(rng, depth + 1) for _ in range(rng.randrange(4))}
    if kind == 8:
        return [{"role": odd_value(rng, 3), "content": odd_value(rng, depth + 1)}]
    return [rng.randrange(-2, 9000) for _ in range(rng.randrange(1, 6))]


def mutated(rng: random.Random, good: dict):
    """`good` with one to three fields replaced, removed, or changed inside its first message."""
    body = copy.deepcopy(good)
    for _ in range(rng.randint(1, 3)):
        roll = rng.random()
        messages = body.get("messages")
        if roll < 0.6:
            body[rng.choice(FIELDS)] = odd_value(rng)
        elif roll < 0.85 and isinstance(messages, list) and messages and isinstance(messages[0], dict):
            messages[0][rng.choice(INNER)] = odd_value(rng)
        elif body:
            body.pop(rng.choice(list(body)))
    return body


def encoded(rng: random.Random, value) -> bytes:
    """`value` as JSON bytes (NaN and Infinity as literals, lone surrogates as escapes or as broken
    UTF-8), sometimes cut short or with a byte changed."""
    text = json.dumps(value, allow_nan=True, ensure_ascii=rng.random() < 0.5)
    raw = text.encode("utf-8", "surrogatepass")
    roll = rng.random()
    if roll < 0.08 and raw:
        return raw[: rng.randrange(len(raw))]
    if roll < 0.16 and raw:
        i = rng.randrange(len(raw))
        return raw[:i] + bytes([rng.randrange(256)]) + raw[i + 1 :]
    return raw


def generated_bodies(seed: int, count: int):
    """(label, bytes) of `count` bodies per POST route: mostly mutated good bodies, some odd values whole."""
    rng = random.Random(seed)
    for path, good in GOOD.items():
        for i in range(count):
            value = mutated(rng, good) if rng.random() < 0.85 else odd_value(rng)
            if isinstance(value, dict) and rng.random() < 0.3:
                value["stream"] = True
            yield path, f"generated #{i}", encoded(rng, value)


def nested(depth: int, inner: bytes = b"1") -> bytes:
    return b"[" * depth + inner + b"]" * depth


def prompt_with(value: bytes) -> bytes:
    return b'{"prompt": ' + value + b', "max_tokens": 2}'


def chat_with(field: bytes, value: bytes) -> bytes:
    return (
        b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2, "' + field + b'": ' + value + b"}"
    )


NASTY = {
    "empty": b"",
    "whitespace": b" \n\t ",
    "truncated": b'{"prompt": "x", "max_tok',
    "trailing garbage": b'{"prompt": "x"} {}',
    "single quotes": b"{'prompt': 'x'}",
    "nested 100000 lists": nested(100_000),
    "nested 5000 objects": b'{"a": ' * 5000 + b"1" + b"}" * 5000,
    "nested 500 lists": nested(500),
    "nested 70 lists": nested(70),
    "nested prompt": prompt_with(nested(3000)),
    "nested content": b'{"messages": [{"role": "user", "content": ' + nested(3000, b'"x"') + b"}]}",
    "nested stop": chat_with(b"stop", nested(900, b'"x"')),
    "nested stream_options": chat_with(b"stream_options", b'{"a": ' * 900 + b"1" + b"}" * 900),
    "1e309": chat_with(b"temperature", b"1e309"),
    "-1e309": chat_with(b"top_p", b"-1e309"),
    "1e309 token": prompt_with(b"[1e309]"),
    "minus zero": chat_with(b"temperature", b"-0"),
    "minus zero float": chat_with(b"temperature", b"-0.0"),
    "minus zero top_p": chat_with(b"top_p", b"-0.0"),
    "4000 digits temperature": chat_with(b"temperature", b"9" * 4000),
    "4000 digits top_k": chat_with(b"top_k", b"9" * 4000),
    "4000 digits max_tokens": chat_with(b"max_tokens", b"9" * 4000),
    "4000 digits seed": chat_with(b"seed", b"9" * 4000),
    "5000 digits": chat_with(b"max_tokens", b"9" * 5000),
    "4000 digits token": prompt_with(b"[" + b"9" * 4000 + b"]"),
    "NaN": chat_with(b"temperature", b"NaN"),
    "Infinity": chat_with(b"top_p", b"Infinity"),
    "-Infinity": chat_with(b"seed", b"-Infinity"),
    "bool for number": chat_with(b"max_tokens", b"true"),
    "string for number": chat_with(b"temperature", b'"0.5"'),
    "list for object": b'[{"prompt": "x"}]',
    "null body": b"null",
    "number body": b"42",
    "string body": b'"prompt"',
    "object for string prompt": prompt_with(b'{"text": "x"}'),
    "object for role": b'{"messages": [{"role": {"user": 1}, "content": "x"}], "max_tokens": 2}',
    "list for model": chat_with(b"model", b'["tiny-qwen3-moe-4bit"]'),
    "object for model": chat_with(b"model", b"{}"),
    "list for include_usage": chat_with(b"stream_options", b'{"include_usage": [1]}'),
    "null messages": b'{"messages": null, "max_tokens": 2}',
    "null message": b'{"messages": [null], "max_tokens": 2}',
    "empty object": b"{}",
    "huge string": prompt_with(json.dumps("a" * 100_000).encode()),
    "over the body limit": prompt_with(json.dumps("a" * (MAX_BODY + 10)).encode()),
    "unicode prompt": prompt_with(json.dumps("\u202e\U0001f600\x00\u05d0", ensure_ascii=False).encode()),
    "lone surrogate escape": prompt_with(b'"a \\ud800 b"'),
    "lone surrogate key": b'{"\\udfff": 1, "prompt": "x", "max_tokens": 2}',
    "surrogate bytes": prompt_with(b'"a \xed\xa0\x80 b"'),
    "non-UTF-8 bytes": prompt_with(b'"\xff\xfe\xfa"'),
    "UTF-8 BOM": b"\xef\xbb\xbf" + json.dumps(GOOD["/v1/completions"]).encode(),
    "UTF-16": json.dumps(GOOD["/v1/completions"]).encode("utf-16"),
    "NUL bytes": b"\x00" * 64,
}
CONTENT_TYPES = (
    None,
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json; charset=latin-1",
    "application/jsonx",
    "APPLICATION/JSON",
    "application/json; charset=utf-8; x=\x7f",
)


@pytest.fixture(scope="module")
def app():
    engine = od_moe.load(capacity="50%")
    app = create_app(engine, max_tokens=CAP, max_input_tokens=MAX_INPUT, max_body_bytes=MAX_BODY)
    yield app
    app.worker.stop()


def routes(app):
    """(path, methods) of every route of the app (a file name in each variable part), and unknown paths."""
    out = [(re.sub(r"<[^>]+>", "dashboard.js", rule.rule), rule.methods) for rule in app.url_map.iter_rules()]
    unknown = [(p, set()) for p in ("/v1/nothing", "/v1/completions/x", "/%ff", "/dashboard/nothing")]
    return out + unknown + [("/dashboard/static/..%2fapp.py", {"GET", "HEAD", "OPTIONS"})]


def problem(response, path: str, method: str = "POST") -> str | None:
    """What is wrong with an answer, or None: a 5xx; a 4xx that is not a JSON error with a short message;
    a 2xx completion, chat or message that is not whole (an error event in a stream included)."""
    status, mimetype, data = response.status_code, response.mimetype, response.get_data()
    if status >= 500:
        return f"{status}: {data[:300]!r}"
    if status >= 400:
        if mimetype != "application/json":
            return f"{status} is {mimetype}, not a JSON error"
        if method == "HEAD":  # the headers of a GET, without its body
            return None
        error = json.loads(data).get("error") or {}
        message = error.get("message")
        if not (isinstance(message, str) and message and len(message) < 400 and error.get("type")):
            return f"{status}: no error message of reasonable length: {data[:300]!r}"
        return None
    if path not in GOOD or method != "POST" or status != 200:
        return None
    if mimetype == "text/event-stream":
        text = data.decode()
        if '"error"' in text or "event: error" in text:
            return f"an error event in the stream: {text[-300:]!r}"
        if not (text.endswith("data: [DONE]\n\n") or "event: message_stop" in text):
            return f"the stream did not end: {text[-300:]!r}"
        return None
    body = json.loads(data)
    if not (body.get("choices") or body.get("content")):
        return f"200 without choices or content: {data[:300]!r}"
    return None


def good_requests_succeed(client):
    for path, body in GOOD.items():
        response = client.post(path, json=dict(body, temperature=0.5))
        assert response.status_code == 200, response.get_data()[:300]
        assert problem(response, path) is None


def test_no_body_content_type_or_method_gets_a_5xx(app):
    client = app.test_client()
    failed_before = app.worker.counters["failed"]
    json_type = "application/json"
    cases = [(path, label, raw, json_type) for path, label, raw in generated_bodies(seed=35, count=110)]
    cases += [(path, label, raw, json_type) for path in GOOD for label, raw in NASTY.items()]
    cases += [
        (path, f"Content-Type {kind!r}", json.dumps(GOOD[path]).encode(), kind)
        for path in GOOD
        for kind in CONTENT_TYPES
    ]
    problems, asked = [], len(cases)
    for i, (path, label, raw, kind) in enumerate(cases):
        response = client.post(path, data=raw, headers={"Content-Type": kind} if kind else {})
        if (why := problem(response, path)) is not None:
            problems.append(f"POST {path} {label} ({raw[:80]!r}): {why}")
        if i % 50 == 49:  # state a bad request left behind would fail these
            good_requests_succeed(client)
    for path, methods in routes(app):
        for method in METHODS:
            for raw in (None, b"{}", NASTY["nested 100000 lists"]):
                headers = {"Content-Type": "application/json"} if raw is not None else {}
                response = client.open(path, method=method, data=raw, headers=headers)
                asked += 1
                if (why := problem(response, path, method)) is not None:
                    problems.append(f"{method} {path} ({'no body' if raw is None else raw[:20]}): {why}")
                if method not in methods and response.status_code < 400:
                    problems.append(f"{method} {path} is not a route but answered {response.status_code}")
    assert not problems, f"{len(problems)} bad answers of {asked}:\n" + "\n".join(problems[:20])
    good_requests_succeed(client)
    assert app.worker.counters["failed"] == failed_before
    assert client.get("/health").get_json()["status"] == "ok"


def test_a_chat_template_that_refuses_the_messages_is_a_400(app, monkeypatch):
    """Real models' templates raise on messages they cannot render (Qwen3's: "No user query found in
    messages."); that is the request's mistake, not the server's."""
    tokenizer = app.worker.engine.tokenizer

    def refuse(*args, **kwargs):
        raise jinja2.exceptions.TemplateError("No user query found in messages.")

    monkeypatch.setattr(tokenizer, "apply_chat_template", refuse)
    client = app.test_client()
    for path in ("/v1/chat/completions", "/v1/messages"):
        response = client.post(path, json=CHAT)
        assert response.status_code == 400, response.get_data()[:300]
        assert "No user query found" in response.get_json()["error"]["message"]
    monkeypatch.undo()
    good_requests_succeed(client)


def test_each_api_keeps_its_own_temperature_range_in_one_wording(app, capsys):
    """OpenAI's routes take 0 to 2, Anthropic's Messages API 0 to 1, the command line OpenAI's range; all
    three say so in the same words."""
    from od_moe.cli import main

    client = app.test_client()
    chat = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    cases = [
        ("/v1/completions", {"prompt": "x", "max_tokens": 1}, 2),
        ("/v1/chat/completions", chat, 2),
        ("/v1/messages", chat, 1),
    ]
    for path, body, high in cases:
        assert client.post(path, json=dict(body, temperature=high)).status_code == 200
        refused = client.post(path, json=dict(body, temperature=high + 0.5))
        message = refused.get_json()["error"]["message"]
        assert (
            refused.status_code == 400
            and message == f"'temperature' must be a number from 0 to {high}, got {high + 0.5}"
        )
    assert main(["generate", "--prompt", "x", "--temp", "2.5"]) == 2
    assert (
        capsys.readouterr().err.strip() == "od-moe: error: temperature must be a number from 0 to 2, got 2.5"
    )
