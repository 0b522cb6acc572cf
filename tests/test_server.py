"""`od-moe serve`: a real HTTP server on a loopback port, queried with urllib and the openai client."""

import json
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import mlx_lm
import pytest
from werkzeug.serving import make_server

import od_moe
from od_moe.memory import backend
from od_moe.server import create_app

MAX_TOKENS, MAX_INPUT, MAX_BODY = 64, 400, 32 * 1024


@pytest.fixture(scope="module")
def server():
    engine = od_moe.load(capacity="50%")
    app = create_app(engine, max_tokens=MAX_TOKENS, max_input_tokens=MAX_INPUT, max_body_bytes=MAX_BODY)
    srv = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_port}", engine, app
    srv.shutdown()
    app.worker.stop()


def call(base, path, body=None, raw: bytes = None, method=None):
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(
        base + path,
        data=data,
        method=method or ("POST" if data is not None else "GET"),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            return r.status, (
                json.loads(text) if r.headers.get_content_type() == "application/json" else text
            )
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def sse(base, path, body):
    """The data payloads of a streamed response, in order."""
    req = urllib.request.Request(
        base + path,
        data=json.dumps(dict(body, stream=True)).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.headers.get_content_type() == "text/event-stream"
        lines = [l for l in r.read().decode().split("\n") if l]
    assert all(l.startswith("data: ") for l in lines)
    return [l[len("data: ") :] for l in lines]


def test_streamed_chunks_join_to_the_non_streamed_text(server):
    base, _, _ = server
    body = {"prompt": "def fibonacci(n):", "max_tokens": 24, "temperature": 0}
    status, whole = call(base, "/v1/completions", body)
    assert (
        status == 200
        and whole["usage"]["completion_tokens"] == 24
        and whole["choices"][0]["finish_reason"] == "length"
    )
    events = sse(base, "/v1/completions", body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    # chat: the same agreement, and the text is the bundled chat template's continuation
    chat = {
        "messages": [{"role": "user", "content": "a function that adds two numbers"}],
        "max_tokens": 16,
        "temperature": 0,
    }
    status, whole = call(base, "/v1/chat/completions", chat)
    assert status == 200 and whole["object"] == "chat.completion"
    deltas = [json.loads(e)["choices"][0]["delta"] for e in sse(base, "/v1/chat/completions", chat)[:-1]]
    assert deltas[0]["role"] == "assistant"
    assert "".join(d.get("content", "") for d in deltas) == whole["choices"][0]["message"]["content"]


def stock_text(prompt, max_tokens):
    """Greedy text from stock mlx-lm (float32 on CPU, as od-moe runs), streamed the way the server streams."""
    model, tokenizer = mlx_lm.load(str(od_moe.DEFAULT_MODEL))
    model.set_dtype(backend.compute_dtype("auto"))
    return "".join(r.text for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=max_tokens))


def test_greedy_completion_is_stock_mlx_lm(server):
    base, engine, _ = server
    status, whole = call(
        base, "/v1/completions", {"prompt": "import os\nimport sys\n\n", "max_tokens": 20, "temperature": 0}
    )
    assert status == 200 and whole["choices"][0]["text"] == stock_text("import os\nimport sys\n\n", 20)


def test_openai_client_streams_a_chat_completion(server):
    openai = pytest.importorskip("openai")
    base, _, _ = server
    client = openai.OpenAI(base_url=base + "/v1", api_key="unused")
    model = client.models.list().data[0].id
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "sort a list"}],
        max_tokens=12,
        temperature=0,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    whole = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "sort a list"}], max_tokens=12, temperature=0
    )
    assert text and text == whole.choices[0].message.content and whole.usage.completion_tokens == 12
    done = client.completions.create(
        model=model, prompt="class Stack:", max_tokens=5, temperature=0, stop=["\n\n\n"]
    )
    assert done.choices[0].text


def test_health_agrees_with_engine_stats(server):
    base, engine, _ = server
    call(base, "/v1/completions", {"prompt": "class Stack:\n    def __init__(self):", "max_tokens": 8})
    status, health = call(base, "/health")
    stats = engine.stats()  # the worker is idle: nothing is left to settle
    c = health["expert_cache_stats"]
    assert status == 200 and health["status"] == "ok" and health["model_loaded"]
    assert c["cache_hits"] == stats["total"]["hits"] and c["cache_misses"] == stats["total"]["misses"]
    assert c["hit_rate"] == pytest.approx(stats["total"]["hit_rate"])
    assert c["per_layer_hit_rate"] == [l["hit_rate"] for l in stats["layers"]]
    assert c["bytes_read"] == stats["total"]["bytes_read"] and c["capacity"] == stats["capacity"] == 32
    assert c["working_set_experts"] == stats["total"]["resident"]
    assert set(c["prefetch"]) >= {"issued", "useful", "late", "wasted", "precision"}
    assert (
        health["memory"]["peak_bytes"] > 0 and health["uptime_s"] > 0 and health["requests"]["completed"] >= 1
    )
    status, text = call(base, "/metrics")
    assert status == 200 and re.search(r"^od_moe_expert_cache_hit_rate [0-9.]+$", text, re.M)
    # memory as the OS counts it; this CPU's device has no memory of its own
    assert health["memory"]["host_bytes"] > 0 and health["memory"]["device_bytes"] is None
    assert re.search(r"^od_moe_memory_host_bytes [0-9.e+]+$", text, re.M)
    assert re.search(r"^od_moe_memory_device_bytes NaN$", text, re.M)


def test_health_is_live_during_a_generation(server):
    """/health reads the engine's ledger as it changes: polled while a stream is read, the decode tokens
    and lookups grow token by token, never backwards, and stay within one pass of each other."""
    base, engine, _ = server
    stats = engine.stats()
    per_token = stats["moe_layers"] * stats["top_k"]
    body = {"prompt": "import os\n", "max_tokens": 48, "temperature": 0, "stream": True}
    req = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    seen = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            if line.startswith(b"data: {"):
                _, health = call(base, "/health")
                c = health["expert_cache_stats"]
                seen.append((health["requests"]["active"], c["decode_passes"], c["decode_lookups"]))
    during = [s for s in seen if s[0] == 1]
    assert len(during) >= 10
    assert all(b[1] >= a[1] and b[2] >= a[2] for a, b in zip(during, during[1:]))  # never backwards
    assert len({s[1] for s in during}) >= 5  # moved while the request ran
    first = during[0]  # lookups of a layer are counted as it runs: at most one pass behind the tokens
    assert all(abs((t - first[1]) * per_token - (n - first[2])) <= per_token for _, t, n in during)


def test_eight_concurrent_clients_all_get_complete_answers(server):
    base, _, _ = server
    prompts = [f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(8)]
    results = [None] * 8

    def client(i):
        results[i] = call(base, "/v1/completions", {"prompt": prompts[i], "max_tokens": 12, "temperature": 0})

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert all(r is not None and r[0] == 200 for r in results)
    assert all(r[1]["usage"]["completion_tokens"] == 12 and r[1]["choices"][0]["text"] for r in results)
    # served in turn on one engine, each answer is what that prompt gives alone
    for i in (0, 5):
        assert (
            call(base, "/v1/completions", {"prompt": prompts[i], "max_tokens": 12, "temperature": 0})[1][
                "choices"
            ][0]["text"]
            == results[i][1]["choices"][0]["text"]
        )


def test_disconnect_mid_stream_frees_the_worker(server):
    base, _, app = server
    before = app.worker.counters["cancelled"]
    host, port = base.split("//")[1].split(":")
    body = json.dumps({"prompt": "def main():", "max_tokens": MAX_TOKENS, "stream": True}).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    received = b""
    while b"data: " not in received:
        received += sock.recv(4096)
    assert received.startswith(b"HTTP/1.1 200")
    sock.close()  # the client goes away mid-stream
    deadline = time.time() + 60
    while app.worker.counters["cancelled"] == before and time.time() < deadline:
        time.sleep(0.1)
    assert app.worker.counters["cancelled"] == before + 1
    status, after = call(
        base, "/v1/completions", {"prompt": "def main():", "max_tokens": 4, "temperature": 0}
    )
    assert status == 200 and after["usage"]["completion_tokens"] == 4
    assert (
        after["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    )  # an interrupted cache is never reused
    assert call(base, "/health")[0] == 200


def test_prompt_cache_reuse_gives_cold_tokens_and_prefills_less(server):
    base, engine, _ = server
    first = engine.tokenizer.encode(
        "import json\nimport os\n\n\ndef load_config(path):\n    with open(path) as f:\n"
    )
    second = first + engine.tokenizer.encode("        data = json.load(f)\n")
    call(base, "/v1/completions", {"prompt": first, "max_tokens": 6, "temperature": 0})
    prefilled = call(base, "/health")[1]["expert_cache_stats"]["prefill_positions"]
    status, warm = call(base, "/v1/completions", {"prompt": second, "max_tokens": 16, "temperature": 0})
    cached = warm["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert status == 200 and cached >= len(first)
    prefill_now = call(base, "/health")[1]["expert_cache_stats"]["prefill_positions"]
    # mlx-lm runs the last prompt token with the first decode step, so a cold request prefills len - 1
    assert prefill_now - prefilled == len(second) - cached - 1 < len(second) - 1
    call(base, "/v1/completions", {"prompt": "@@@", "max_tokens": 2})  # shares no prefix with `second`
    status, cold = call(base, "/v1/completions", {"prompt": second, "max_tokens": 16, "temperature": 0})
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert warm["choices"][0]["text"] == cold["choices"][0]["text"] == stock_text(second, 16)


@pytest.mark.parametrize(
    "path,body,raw,status,method",
    [
        ("/v1/completions", None, b"{not json", 400, None),
        ("/v1/completions", None, b"[1, 2]", 400, None),
        ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, None, 400, None),
        ("/v1/completions", {"prompt": 42}, None, 400, None),
        ("/v1/completions", {"max_tokens": 4}, None, 400, None),
        ("/v1/completions", {"prompt": ""}, None, 400, None),
        ("/v1/completions", {"prompt": "x", "max_tokens": -1}, None, 400, None),
        ("/v1/completions", {"prompt": "x", "max_tokens": 10**9}, None, 400, None),
        ("/v1/completions", {"prompt": "x", "temperature": 5}, None, 400, None),
        ("/v1/completions", {"prompt": "x", "temperature": "hot"}, None, 400, None),
        ("/v1/completions", {"prompt": "x", "top_p": 0}, None, 400, None),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, None, 400, None),
        ("/v1/completions", {"prompt": "x", "stop": [1, 2]}, None, 400, None),
        ("/v1/completions", {"prompt": [99999999]}, None, 400, None),
        ("/v1/chat/completions", {"max_tokens": 4}, None, 400, None),
        ("/v1/chat/completions", {"messages": []}, None, 400, None),
        ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, None, 400, None),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, None, 400, None),
        (
            "/v1/chat/completions",
            {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]},
            None,
            404,
            None,
        ),
        ("/v1/completions", {"prompt": "x = 1\n" * 300}, None, 400, None),
        ("/v1/completions", None, b'{"prompt": "' + b"a" * (MAX_BODY + 10) + b'"}', 413, None),
        ("/v1/nothing", {"prompt": "x"}, None, 404, None),
        ("/v1/completions", None, None, 405, "GET"),
    ],
)
def test_bad_requests_get_openai_errors_and_the_server_keeps_serving(server, path, body, raw, status, method):
    base, _, _ = server
    got, reply = call(base, path, body, raw, method)
    assert got == status, reply
    assert (
        isinstance(reply["error"]["message"], str) and reply["error"]["message"] and "type" in reply["error"]
    )
    assert call(base, "/health")[0] == 200


def test_od_moe_serve_command_starts_a_server():
    proc = subprocess.Popen(
        [sys.executable, "-m", "od_moe", "serve", "--port", "0", "--capacity", "25%"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stderr.readline()
        match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
        assert match, line
        status, health = call(f"http://127.0.0.1:{match.group(1)}", "/health")
        assert status == 200 and health["expert_cache_stats"]["capacity"] == 16
        status, models = call(f"http://127.0.0.1:{match.group(1)}", "/v1/models")
        assert models["data"][0]["id"] == "tiny-qwen3-moe-4bit"
        assert call(f"http://127.0.0.1:{match.group(1)}", "/v1/nothing-here")[0] == 404
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    log = proc.stderr.read()  # a pipe, not a terminal: request lines are plain text, not coloured
    assert '"GET /v1/nothing-here HTTP/1.1" 404' in log and "\x1b[" not in log, log


def test_anthropic_messages_endpoint(server):
    base, _, _ = server
    body = {
        "model": "tiny-qwen3-moe-4bit",
        "max_tokens": 12,
        "temperature": 0,
        "system": "You write Python.",
        "messages": [{"role": "user", "content": [{"type": "text", "text": "sort a list"}]}],
    }
    status, reply = call(base, "/v1/messages", body)
    assert status == 200 and reply["type"] == "message" and reply["stop_reason"] == "max_tokens"
    assert reply["usage"]["output_tokens"] == 12 and reply["content"][0]["type"] == "text"
    req = urllib.request.Request(
        base + "/v1/messages",
        data=json.dumps(dict(body, stream=True)).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as r:
        blocks = [b for b in r.read().decode().split("\n\n") if b]
    names = [b.split("\n")[0][len("event: ") :] for b in blocks]
    assert names[:2] == ["message_start", "content_block_start"] and names[-3:] == [
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    deltas = [
        json.loads(b.split("\n")[1][len("data: ") :])["delta"]["text"]
        for b, n in zip(blocks, names)
        if n == "content_block_delta"
    ]
    assert "".join(deltas) == reply["content"][0]["text"]
    first_word = reply["content"][0]["text"].strip()[:3]
    if first_word:
        status, stopped = call(base, "/v1/messages", dict(body, stop_sequences=[first_word]))
        assert stopped["stop_reason"] == "stop_sequence" and stopped["stop_sequence"] == first_word
        assert first_word not in stopped["content"][0]["text"]
    status, err = call(base, "/v1/messages", {"messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and err["type"] == "error" and "max_tokens" in err["error"]["message"]
