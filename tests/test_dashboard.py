"""The live dashboard of `od-moe serve`: headless Chromium loads the page while a generation runs and its
figures move and end equal to /health; its data stays whole under 8 concurrent streams and a client that
goes away. The browser test is skipped only where no Chromium binary is installed (CI installs one)."""

import json
import os
import socket
import threading
import time
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest
from werkzeug.serving import make_server

import od_moe
from chromium import Browser, chromium_binary
from od_moe.server import create_app
from od_moe.server.dashboard import rates
from od_moe.server.decode_clock import DecodeClock
from od_moe.server.worker import GenerationWorker

ROOT = Path(__file__).resolve().parents[1]
# Where the browser test leaves its screenshot (docs/dashboard.png in the README is one of these).
ARTIFACTS = Path(os.environ.get("OD_MOE_ARTIFACTS", ROOT / "build" / "artifacts"))

FIGURES = (
    "host-memory",
    "device-memory",
    "hit-rate",
    "recent-hit-rate",
    "tok-s",
    "tokens",
    "passes",
    "precision",
    "stall",
    "bytes",
    "bytes-total",
    "in-flight",
    "completed",
    "cancelled",
)
READ_PAGE = (
    "(() => { const v = {}; for (const id of "
    + json.dumps(FIGURES)
    + ") v[id] = document.getElementById(id).dataset.value ?? null;"
    " v.updates = Number(document.body.dataset.updates || 0);"
    " v.hitText = document.getElementById('hit-rate').textContent;"
    " v.resident = Number(document.getElementById('strip').dataset.resident || -1);"
    " v.points = Number(document.getElementById('plot-tok-s').dataset.points || 0);"
    " return v; })()"
)


def serving(max_batch: int, decode_clock: DecodeClock | None = None):
    engine = od_moe.load(capacity="50%", prefetch="next-gate")
    app = create_app(worker=GenerationWorker(engine, max_batch=max_batch, decode_clock=decode_clock))
    srv = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=srv.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{srv.server_port}", engine, app.worker
    srv.shutdown()
    app.worker.stop()


@pytest.fixture(scope="module")
def server():
    yield from serving(max_batch=8)


@pytest.fixture(scope="module")
def server_one_at_a_time():
    """One request at a time, its decode clock (and so the page's) a `StoppedClock` only the test moves."""
    clock = StoppedClock(1000.0)  # whole seconds: the page's figures are exact
    served = serving(max_batch=1, decode_clock=DecodeClock(now=clock))
    base, engine, _ = next(served)
    yield base, engine, clock
    next(served, None)


def get(base, path):
    with urllib.request.urlopen(base + path, timeout=60) as r:
        return json.loads(r.read())


def stream(base, prompt, max_tokens) -> dict:
    """Stream a completion to its end; its usage."""
    body = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    req = urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=300) as r:
        events = [line[6:] for line in r.read().decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    return json.loads(events[-2])["usage"]


def stream_then_hang_up(base, max_tokens):
    """Start a streamed completion, read its first event, and close the connection."""
    host, port = base[len("http://") :].split(":")
    body = {"prompt": "import os", "max_tokens": max_tokens, "temperature": 0, "stream": True}
    body = json.dumps(body).encode()  # greedy: this prompt runs to max_tokens, far past the hang-up
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (base[len("http://") :].encode(), len(body), body)
        )
        seen = b""
        while b"data: " not in seen:
            seen += sock.recv(4096)


def wait_idle(base, timeout_s=120):
    deadline = time.monotonic() + timeout_s
    while get(base, "/dashboard/data")["requests"]["in_flight"]:
        assert time.monotonic() < deadline, "requests still in flight"
        time.sleep(0.05)


def value(text):
    return None if text in (None, "") else float(text)


def test_the_page_is_served_whole_from_the_package_and_passes_the_guard(server):
    base, _, _ = server
    with urllib.request.urlopen(base + "/", timeout=30) as r:
        page = r.read().decode()
        assert "script-src 'self'" in r.headers["Content-Security-Policy"]
    texts = [page]
    for name in ("dashboard.js", "dashboard.css"):
        assert f"/dashboard/static/{name}" in page
        with urllib.request.urlopen(f"{base}/dashboard/static/{name}", timeout=30) as r:
            texts.append(r.read().decode())
        assert r.status == 200 and len(texts[-1]) > 1000
    for text in texts:  # nothing from elsewhere: no CDN, no web fonts
        assert "http://" not in text and "https://" not in text and "@import" not in text
    # the guard still applies: another Host is refused, for the page and for its data
    req = urllib.request.Request(base + "/dashboard/data", headers={"Host": "evil.example"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 403


@pytest.mark.skipif(
    chromium_binary() is None,
    reason="the live page's browser test needs Chromium on PATH (Debian: apt-get install chromium; macOS: "
    "brew install --cask chromium); .ci/run installs it",
)
def test_in_chromium_the_figures_move_during_a_generation_and_end_equal_to_health(server, tmp_path):
    base, engine, _ = server
    result = {}
    generation = threading.Thread(
        target=lambda: result.update(stream(base, "def quicksort(items):", 300)), daemon=True
    )
    with Browser(chromium_binary(), tmp_path / "profile") as browser:
        browser.open(base + "/")
        browser.wait_for("Number(document.body.dataset.updates || 0) >= 1")
        generation.start()
        browser.wait_for("Number(document.getElementById('tokens').dataset.value) > 20")
        first = browser.evaluate(READ_PAGE)
        assert int(first["in-flight"]) == 1
        time.sleep(2.0)
        second = browser.evaluate(READ_PAGE)
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        browser.screenshot(ARTIFACTS / "dashboard.png")
        # updating at least once a second, and the figures move while tokens come
        assert second["updates"] >= first["updates"] + 2
        assert int(second["tokens"]) > int(first["tokens"])
        assert value(second["hit-rate"]) != value(first["hit-rate"])
        assert value(second["tok-s"]) > 0
        assert second["points"] >= 1
        generation.join(120)
        assert result["completion_tokens"] == 300  # greedy: this prompt never stops early
        browser.wait_for("document.getElementById('in-flight').dataset.value === '0'")
        seen = browser.evaluate(READ_PAGE)["updates"]
        browser.wait_for(f"Number(document.body.dataset.updates) >= {seen + 2}")
        last = browser.evaluate(READ_PAGE)
    health = get(base, "/health")
    cache = health["expert_cache_stats"]
    assert value(last["hit-rate"]) == cache["decode_hit_rate"]
    assert last["hitText"] == f"{100 * cache['decode_hit_rate']:.1f}%"
    assert value(last["precision"]) == cache["prefetch"]["precision"]
    assert int(last["tokens"]) == cache["generated_tokens"]
    assert int(last["passes"]) == cache["decode_passes"]
    assert int(last["completed"]) == health["requests"]["completed"]
    assert health["requests"]["active"] == health["requests"]["queued"] == int(last["in-flight"]) == 0
    assert last["resident"] == cache["working_set_experts"]
    decode = engine.stats(settle=False)["io"]["decode"]
    passes = cache["decode_passes"]
    assert value(last["stall"]) == pytest.approx(decode["stall_s"] * 1e3 / passes)
    assert value(last["bytes"]) == pytest.approx(decode["bytes_read"] / passes)
    assert value(last["bytes-total"]) == decode["bytes_read"]
    # memory as the OS counts it (a CPU's device has none of its own: no figure)
    assert value(last["host-memory"]) > engine.non_expert_nbytes and last["device-memory"] == ""


MONOTONIC = (
    ("decode", "passes"),
    ("decode", "generated_tokens"),
    ("decode", "lookups"),
    ("decode", "hits"),
    ("decode", "bytes_read"),
    ("decode", "stall_s"),
    ("prefetch", "issued"),
    ("prefetch", "useful"),
    ("prefetch", "wasted"),
    ("requests", "total"),
    ("requests", "completed"),
    ("requests", "cancelled"),
    ("requests", "completion_tokens"),
)


def test_eight_streams_and_a_hang_up_never_move_a_count_back_or_lose_one(server):
    base, _, _ = server
    wait_idle(base)
    before = get(base, "/dashboard/data")
    docs, done = [], threading.Event()

    def watch():
        while not done.is_set():
            docs.append(get(base, "/dashboard/data"))
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    hang_up = threading.Thread(target=stream_then_hang_up, args=(base, 400), daemon=True)
    hang_up.start()
    usages = [None] * 8

    def one(i):
        usages[i] = stream(base, f"def task_{i}(x):", 12 + i)

    streams = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(8)]
    for t in streams:
        t.start()
    hang_up.join(60)
    for t in streams:
        t.join(300)
    wait_idle(base)
    done.set()
    watcher.join(30)
    after = get(base, "/dashboard/data")
    docs.append(after)

    assert len(docs) > 10 and max(d["requests"]["in_flight"] for d in docs) >= 2
    for a, b in zip(docs, docs[1:]):
        for group, key in MONOTONIC:
            assert b[group][key] >= a[group][key], (group, key, a[group][key], b[group][key])
    moved = {k: after["requests"][k] - before["requests"][k] for k in ("total", "completed", "cancelled")}
    assert moved == {"total": 9, "completed": 8, "cancelled": 1}
    assert [u["completion_tokens"] for u in usages] == [12 + i for i in range(8)]
    assert after["requests"]["completion_tokens"] - before["requests"]["completion_tokens"] == sum(
        12 + i for i in range(8)
    )
    # tokens generated: the completed requests' own counts plus what the hung-up one got before it left
    # (under its 400); decoded together, a pass gives several requests a token each: fewer passes than
    # tokens, yet more than the longest request's tokens (mlx-lm computes a token ahead)
    generated = after["decode"]["generated_tokens"] - before["decode"]["generated_tokens"]
    completed = after["requests"]["completion_tokens"] - before["requests"]["completion_tokens"]
    assert completed <= generated < completed + 400
    assert 12 + 7 < after["decode"]["passes"] - before["decode"]["passes"] < generated
    health = get(base, "/health")
    cache = health["expert_cache_stats"]
    assert after["decode"]["hit_rate"] == cache["decode_hit_rate"]
    assert after["decode"]["passes"] == cache["decode_passes"]
    assert after["decode"]["generated_tokens"] == cache["generated_tokens"]
    assert after["prefetch"]["precision"] == cache["prefetch"]["precision"]
    for key in ("total", "completed", "cancelled", "failed"):
        assert after["requests"][key] == health["requests"][key]


def test_tok_s_is_tokens_over_decoding_time_so_idle_time_does_not_dilute_it():
    """Issue 35: the page read 5.7, then 11.6, then 34 tok/s in the first seconds of a request, its 2 s
    window counting the idle time before it. Samples (time, tokens, lookups, hits, decoding seconds): 10 s
    idle, then decoding at 32 tok/s, a sample every 0.25 s."""
    samples = [(0.25 * i, 100, 500, 400, 3.0) for i in range(40)]
    for i in range(1, 7):
        samples.append((9.75 + 0.25 * i, 100 + 8 * i, 500 + 64 * i, 400 + 48 * i, 3.0 + 0.25 * i))
    got = rates(samples)  # 1.5 s of decoding in the last 2 s: 48 tokens
    assert got["tok_s"] == pytest.approx(32) and got["hit_rate"] == pytest.approx(0.75)
    assert rates(samples[:41])["tok_s"] is None  # a quarter second of decoding: too little to tell yet
    assert rates(samples[:42])["tok_s"] == pytest.approx(32)
    steps = [p[2] for p in got["points"]]
    assert steps[0] == 0.0 and steps[-1] == pytest.approx(32)  # idle steps read 0, decoding ones the rate
    assert rates(samples[:40])["tok_s"] == 0.0  # idle: nothing decoded in the window


def test_the_decode_clock_runs_from_a_requests_first_token_to_its_end():
    now = [100.0]
    clock = DecodeClock(now=lambda: now[0])

    def at(t, action=None):
        now[0] = t
        return action() if action else clock.read()

    at(100.0, clock.tick)  # the first token came from the prompt's prefill: the clock starts
    at(100.1, clock.tick)
    at(100.2, clock.tick)
    assert at(100.25) == (2, pytest.approx(0.25))  # the time since the last token counts while decoding
    at(100.3, clock.stop)
    assert at(160.0) == (2, pytest.approx(0.3))  # idle: the clock stands
    at(170.0, clock.tick)  # the next request's first token: its prefill is not counted either
    at(170.5, clock.tick)
    assert at(170.5) == (3, pytest.approx(0.8))


class StoppedClock:
    """Monotonic seconds that move only when told to: the decode clock's and the page's, in the test below."""

    def __init__(self, start: float):
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float):
        self.t += seconds


def test_the_page_reads_the_decode_rate_from_a_requests_first_second(server_one_at_a_time, monkeypatch):
    """The live figure after idle seconds watched by the page: from its first reading with half a second
    of decoding, the rate tokens come at. A stand-in for the engine's generation gives a token every 1/32 s
    of a clock only it and the test move (exact in binary: the page's figures are exact), one request at a
    time, and waits for the page to be read after every 8th token: what the page reads is fixed, whatever
    the machine's load. A page whose window counts the idle time before the request reads 8, then 12."""
    base, engine, clock = server_one_at_a_time
    wait_idle(base)
    clock.advance(400)  # past the page's samples so far (it keeps 300 s): those are dropped
    tokens, every = 80, 8
    ready, read = threading.Semaphore(0), threading.Semaphore(0)

    def paced(prompt, max_tokens, **kwargs):
        clock.advance(0.5)  # the prompt's prefill, which gives the first token: not decoding
        for i in range(max_tokens):
            yield SimpleNamespace(token=i, text="x", finish_reason=None)
            if i and i % every == 0:  # the worker has ticked token i: i tokens decoded in i/32 s
                ready.release()
                if not read.acquire(timeout=60):
                    raise TimeoutError("the test stopped reading the page")
            clock.advance(1 / 32)

    monkeypatch.setattr(engine, "stream_generate", paced)
    idle = []
    for _ in range(10):  # idle and watched: the window holds idle samples when the request starts
        clock.advance(0.25)
        idle.append(get(base, "/dashboard/data")["recent"]["tok_s"])
    assert idle == [None, None] + [0.0] * 8  # under half a second of samples, then nothing decoded
    generation = threading.Thread(target=stream, args=(base, "def quicksort(items):", tokens), daemon=True)
    generation.start()
    readings = []
    for _ in range((tokens - 1) // every):
        assert ready.acquire(timeout=60), ("the generation stopped", readings)
        readings.append(get(base, "/dashboard/data")["recent"]["tok_s"])
        read.release()
    generation.join(timeout=60)
    assert not generation.is_alive()
    # a quarter second of decoding is too little to tell; from half a second on, the pace exactly (the
    # window reaches back past the request's start for the first 2 s, over its first tokens after)
    assert readings == [None] + [32.0] * 8, readings
