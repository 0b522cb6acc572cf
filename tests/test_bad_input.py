"""Hostile and broken input (issue 16): every bad request gets a 4xx JSON error before any streaming and
the next good request succeeds; client hang-ups free the worker; the server shuts down cleanly; every
broken file or flag on the command line is one line `od-moe: error: ...` and exit code 2."""

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
from werkzeug.serving import make_server

import od_moe
from od_moe.cli import main
from od_moe.errors import UserError
from od_moe.server import create_app, guard
from od_moe.server.worker import GenerationWorker

ALLOWED_ORIGIN = "https://ok.example"
CHAT = {"messages": [{"role": "user", "content": "sort a list"}], "max_tokens": 4}


@pytest.fixture(scope="module")
def server():
    engine = od_moe.load(capacity="50%")
    # small prefill chunks: a hang-up during a long prompt is noticed within a fraction of a second here
    worker = GenerationWorker(engine, prefill_step=64)
    app = create_app(worker=worker, max_tokens=2000, allowed_origins=(ALLOWED_ORIGIN,))
    srv = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}", engine, app
    srv.shutdown()
    worker.shutdown()


def call(base, path, body=None, raw=None, headers=None, method=None):
    """(status, headers, JSON or text) of one request; `headers` replace the JSON content type."""
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    sent = {"Content-Type": "application/json"} if headers is None else headers
    req = urllib.request.Request(base + path, data=data, headers=sent, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            status, got = r.status, r.headers
    except urllib.error.HTTPError as e:
        text, status, got = e.read().decode(), e.code, e.headers
    return status, got, (json.loads(text) if got.get_content_type() == "application/json" else text)


def good(base):
    """A good request succeeds (after whatever bad one came before)."""
    status, _, reply = call(base, "/v1/chat/completions", dict(CHAT, temperature=0.7))
    assert status == 200 and reply["usage"]["completion_tokens"] >= 1, reply


def raw_request(base, head: bytes, body: bytes = b"") -> socket.socket:
    host, port = base.split("//")[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=30)
    sock.sendall(head + body)
    return sock


def post_completion(base, body: bytes) -> socket.socket:
    """A JSON POST to /v1/completions on a raw socket (the test may hang up at any time)."""
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body)
    )
    return raw_request(base, head, body)


def wait_for(predicate, timeout_s):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.02)
    return predicate()


LONE_SURROGATE = b'{"messages": [{"role": "user", "content": "a \\ud800 b"}], "max_tokens": 4}'


@pytest.mark.parametrize(
    "path,body,raw,headers,status,param",
    [
        ("/v1/completions", {"prompt": "x", "temperature": 1, "top_k": 8192}, None, None, 400, "top_k"),
        ("/v1/chat/completions", dict(CHAT, temperature=1, top_k=10**6), None, None, 400, "top_k"),
        ("/v1/messages", dict(CHAT, temperature=1, top_k=8192), None, None, 400, None),
        ("/v1/completions", {"prompt": "x", "seed": -1}, None, None, 400, "seed"),
        ("/v1/completions", {"prompt": "x", "seed": 2**70}, None, None, 400, "seed"),
        ("/v1/chat/completions", None, LONE_SURROGATE, None, 400, None),
        ("/v1/completions", None, b'{"prompt": "x", "temperature": NaN, "stream": true}', None, 400, None),
        ("/v1/completions", None, b'{"prompt": "x", "top_p": Infinity}', None, 400, None),
        ("/v1/completions", {"prompt": "x", "logprobs": 2}, None, None, 400, "logprobs"),
        ("/v1/chat/completions", dict(CHAT, logprobs=True, top_logprobs=3), None, None, 400, "logprobs"),
        ("/v1/completions", {"prompt": "x"}, None, {"Content-Type": "text/plain"}, 415, None),
        ("/v1/completions", {"prompt": "x"}, None, {}, 415, None),
        (
            "/v1/completions",
            {"prompt": "x"},
            None,
            {"Content-Type": "application/json", "Host": "evil.example"},
            403,
            None,
        ),
        (
            "/v1/completions",
            {"prompt": "x"},
            None,
            {"Content-Type": "application/json", "Origin": "https://evil.example"},
            403,
            None,
        ),
        ("/health", None, None, {"Host": "rebound.evil.example:8080"}, 403, None),
    ],
)
def test_bad_request_is_refused_before_streaming_and_the_next_succeeds(
    server, path, body, raw, headers, status, param
):
    base, _, _ = server
    if body is not None and not raw:
        body = dict(body, stream=True)  # refused before any event is sent, even when streaming
    got, got_headers, reply = call(base, path, body, raw, headers)
    assert got == status, reply
    assert got_headers.get_content_type() == "application/json"
    error = reply["error"]
    assert isinstance(error["message"], str) and error["message"] and error["type"]
    if param is not None:
        assert error["param"] == param
    good(base)


def test_sampler_state_is_per_request(server):
    """A sampling failure used to leave MLX's global random state broken, so that every later sampled
    request failed until one sent a seed. Now each request samples with its own key."""
    _, engine, _ = server
    with pytest.raises(UserError, match="top_k"):
        engine.generate("x = 1", max_tokens=2, temperature=1.0, top_k=9000)
    assert engine.generate("x = 1", max_tokens=4, temperature=1.0)  # no seed: works
    seeded = [engine.generate("def f(x):", max_tokens=12, temperature=1.0, seed=7) for _ in range(2)]
    assert seeded[0] == seeded[1]  # a seed repeats
    engine.generate("x", max_tokens=4, temperature=1.0)
    assert engine.generate("def f(x):", max_tokens=12, temperature=1.0, seed=7) == seeded[0]  # unaffected


def test_health_reports_the_worker_failing(server, monkeypatch):
    base, engine, app = server

    def broken(*args, **kwargs):
        raise RuntimeError("expert file unreadable")
        yield

    monkeypatch.setattr(engine, "stream_generate", broken)
    status, _, reply = call(base, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 500 and reply["error"]["type"] == "server_error"
    status, _, health = call(base, "/health")
    assert status == 200 and health["status"] == "degraded" and "unreadable" in health["last_error"]
    monkeypatch.undo()
    good(base)
    assert call(base, "/health")[2]["status"] == "ok"


def test_prompt_limit_is_the_models_positions(server):
    base, engine, _ = server
    tokens = engine.tokenizer.encode("x = 1\n" * 700)[:2049]
    assert len(tokens) == 2049  # the bundled model has 2048 positions
    status, _, reply = call(base, "/v1/completions", {"prompt": tokens, "max_tokens": 1})
    assert status == 400 and reply["error"]["code"] == "context_length_exceeded"
    assert "2048" in reply["error"]["message"]
    good(base)


def test_hang_up_during_a_long_prefill_stops_it(server):
    """A stream's client that goes away during the prompt stops the prefill at the next chunk."""
    base, engine, app = server
    tokens = engine.tokenizer.encode("value = compute(value) + 1\n" * 300)[:1600]
    before = dict(app.worker.counters)
    prefilled = engine.stats(settle=False)["positions"]["prefill"]
    body = json.dumps({"prompt": tokens, "max_tokens": 8, "stream": True}).encode()
    sock = post_completion(base, body)
    assert wait_for(lambda: app.worker.active == 1, 30)
    sock.close()
    assert wait_for(lambda: app.worker.counters["cancelled"] == before["cancelled"] + 1, 5)
    assert wait_for(lambda: app.worker.active == 0, 2)
    assert engine.stats(settle=False)["positions"]["prefill"] - prefilled < len(tokens) // 2
    assert app.worker.counters["completed"] == before["completed"]
    good(base)


def test_hang_up_of_a_non_streaming_request_frees_the_worker(server):
    base, _, app = server
    before = app.worker.counters["cancelled"]
    body = json.dumps({"prompt": "def main():", "max_tokens": 2000, "temperature": 0}).encode()
    sock = post_completion(base, body)
    assert wait_for(lambda: app.worker.active == 1, 30)
    time.sleep(0.2)
    sock.close()
    gone = time.monotonic()
    assert wait_for(lambda: app.worker.counters["cancelled"] == before + 1, 10)
    assert time.monotonic() - gone < 5  # 2000 tokens would take half a minute here
    good(base)


def test_chunked_body_over_the_limit_is_413_and_closed(server):
    base, _, _ = server
    sock = raw_request(
        base,
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
    )
    body = b'{"prompt": "' + b"a" * (5 * 2**20) + b'"}'
    for i in range(0, len(body), 2**16):
        piece = body[i : i + 2**16]
        sock.sendall(b"%x\r\n%s\r\n" % (len(piece), piece))
    sock.sendall(b"0\r\n\r\n")
    sock.settimeout(10)  # the old server kept the connection open until the client gave up
    reply = b""
    while chunk := sock.recv(2**16):
        reply += chunk
    sock.close()
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413") and b"over the limit" in payload
    small = json.dumps({"prompt": "def f(x):", "max_tokens": 2}).encode()  # chunked and under the limit
    sock = raw_request(
        base,
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n",
        b"%x\r\n%s\r\n0\r\n\r\n" % (len(small), small),
    )
    reply = b""
    while chunk := sock.recv(2**16):
        reply += chunk
    sock.close()
    assert reply.startswith(b"HTTP/1.1 200") and b'"completion_tokens":2' in reply


def test_host_names():
    loopback = guard.host_names("127.0.0.1", ["box.lan"])
    for host in ("127.0.0.1:8080", "localhost", "[::1]:8080", "box.lan:80"):
        assert guard.host_allowed(host, loopback), host
    for host in ("evil.example", "192.168.1.5:8080", "localhost.evil.example"):
        assert not guard.host_allowed(host, loopback), host
    everywhere = guard.host_names("0.0.0.0")
    assert guard.host_allowed("192.168.1.5:8080", everywhere) and guard.host_allowed("[fe80::1]", everywhere)
    assert not guard.host_allowed("rebound.evil.example", everywhere)


def test_cross_origin_is_refused_unless_allowed(server):
    base, _, _ = server
    status, headers, reply = call(
        base,
        "/v1/chat/completions",
        CHAT,
        headers={"Content-Type": "application/json", "Origin": ALLOWED_ORIGIN},
    )
    assert status == 200 and headers["Access-Control-Allow-Origin"] == ALLOWED_ORIGIN
    status, headers, _ = call(
        base,
        "/v1/chat/completions",
        method="OPTIONS",
        headers={"Origin": ALLOWED_ORIGIN, "Access-Control-Request-Method": "POST"},
    )
    assert status == 200 and "POST" in headers["Access-Control-Allow-Methods"]
    status, headers, _ = call(base, "/health", headers={"Origin": base})  # the server's own pages
    assert status == 200 and "Access-Control-Allow-Origin" not in headers
    status, _, reply = call(base, "/health", headers={"Origin": "null"})
    assert status == 403 and "--allow-origin" in reply["error"]["message"]


def test_metrics_are_prometheus_text(server):
    base, _, _ = server
    good(base)
    status, headers, text = call(base, "/metrics")
    assert status == 200 and headers.get_content_type() == "text/plain"
    samples = [l for l in text.splitlines() if l and not l.startswith("#")]
    for line in samples:
        name = re.match(r"(od_moe_\w+)(\{[^}]*\})? (NaN|[-+0-9.e]+)$", line)
        assert name, line
        assert f"# TYPE {name.group(1)} " in text and f"# HELP {name.group(1)} " in text
    names = {re.match(r"(\w+)", l).group(1) for l in samples}
    assert {"od_moe_expert_cache_decode_hit_rate", "od_moe_prefetch_precision", "od_moe_up"} <= names


def _serve(*args):
    proc = subprocess.Popen(
        [sys.executable, "-m", "od_moe", "serve", "--port", "0", "--capacity", "25%", *args],
        stderr=subprocess.PIPE,
        text=True,
        # as from a terminal: a script's background job (CI's, perhaps) inherits SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    line = proc.stderr.readline()
    match = re.search(r"http://127\.0\.0\.1:(\d+)", line)
    assert match, line
    return proc, f"http://127.0.0.1:{match.group(1)}"


def test_ctrl_c_ends_streams_with_an_error_event_and_exits_cleanly():
    proc, base = _serve()
    try:
        req = urllib.request.Request(
            base + "/v1/completions",
            data=json.dumps({"prompt": "def f(x):", "max_tokens": 2000, "stream": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as r:
            assert r.readline().startswith(b"data: {")
            proc.send_signal(signal.SIGINT)
            rest = r.read().decode()
        _, err = proc.communicate(timeout=30)  # drains stderr while waiting: a full pipe cannot stall it
    finally:
        proc.kill()
    last = json.loads(rest.strip().split("\n")[-1][len("data: ") :])
    assert "shutting down" in last["error"]["message"]
    assert proc.returncode == 0 and "terminate called" not in err and "Traceback" not in err


def test_busy_port_is_one_line_and_exit_2_before_loading(capsys, monkeypatch):
    def no_load(*args, **kwargs):
        raise AssertionError("the model was loaded before the port was checked")

    monkeypatch.setattr(od_moe, "load", no_load)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        assert main(["serve", "--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("od-moe: error: cannot listen on 127.0.0.1:")


# -- command line and files ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """Broken copies of the bundled predictor, model and a snapshot, made once."""
    root = tmp_path_factory.mktemp("broken")
    bundled = od_moe.DEFAULT_PREDICTOR
    shutil.copytree(bundled, root / "truncated-predictor")
    weights = (bundled / "predictor.safetensors").read_bytes()
    (root / "truncated-predictor" / "predictor.safetensors").write_bytes(weights[: len(weights) // 2])
    shutil.copytree(bundled, root / "narrow-predictor")
    config = json.loads((bundled / "config.json").read_text())
    (root / "narrow-predictor" / "config.json").write_text(json.dumps(dict(config, rank=40)))
    from od_moe.predictor import PredictorConfig, ShadowPredictor

    ShadowPredictor(PredictorConfig.from_dict(dict(config, num_experts=32))).save(root / "foreign-predictor")
    (root / "no-tokenizer").mkdir()
    for f in od_moe.DEFAULT_MODEL.iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, root / "no-tokenizer" / f.name)
    engine = od_moe.load(capacity=16)
    engine.generate("import os", max_tokens=4)
    engine.save_snapshot(root / "snap", weights=True)
    (experts,) = (root / "snap").glob("experts-*.safetensors")
    shutil.copytree(root / "snap", root / "truncated-snap")
    os.truncate(root / "truncated-snap" / experts.name, experts.stat().st_size // 3)
    shutil.copytree(root / "snap", root / "missing-snap")
    (root / "missing-snap" / experts.name).unlink()
    return root


@pytest.mark.parametrize(
    "args,message",
    [
        (["--predictor", "{root}/truncated-predictor"], "does not hold this predictor's weights"),
        (["--predictor", "{root}/narrow-predictor"], "does not hold this predictor's weights"),
        (["--predictor", "{root}/foreign-predictor"], "does not fit this model: num_experts 32"),
        (["--capacity", "16", "--snapshot", "{root}/truncated-snap"], "content hash differs"),
        (["--capacity", "16", "--snapshot", "{root}/missing-snap"], "missing its experts file"),
        (["--save-snapshot", "/proc/no/such/place"], "cannot save a snapshot"),
        (["--seed", "-1"], "seed must be an integer from 0"),
        (["--seed", str(2**70)], "seed must be an integer from 0"),
        (["--model", "{root}/no-tokenizer"], "has no tokenizer"),
    ],
)
def test_broken_file_or_flag_is_one_line_and_exit_2(capsys, broken, args, message):
    argv = ["generate", "--prompt", "x", "--max-tokens", "2"] + [a.format(root=broken) for a in args]
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("od-moe: error: ") and message in err[0], err
