"""How `od-moe serve` starts (issue 70): anything that fails before the server is ready (loading, warming
up, building the batch and compiling its kernels) ends it with one line and a non-zero exit, never a hang;
while the model loads the port already answers, `/health` with status "loading" and every other route a 503
with `Retry-After`, and once it is ready the same port serves."""

import json
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from pathlib import Path

import pytest

import od_moe
from od_moe.cli import main
from od_moe.errors import UserError
from od_moe.server import app as server_app
from od_moe.server import create_app
from od_moe.server import worker as server_worker

BOUND_S = 120  # a start that has not ended by then hangs: the test fails rather than waiting for ever
LOADING_SERVER = Path(__file__).parent / "loading_server.py"


@pytest.fixture(scope="module")
def engine():
    return od_moe.load(capacity="50%")


def broken_batch(*args, **kwargs):
    raise RuntimeError("kernel compile failed")


def ended(target, *args, **kwargs):
    """What `target` raised or returned, run on a thread given `BOUND_S` to end."""
    outcome = []

    def run():
        try:
            outcome.append(target(*args, **kwargs))
        except BaseException as e:
            outcome.append(e)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(BOUND_S)
    assert outcome, f"{target.__name__} hung: still running after {BOUND_S} s"
    return outcome[0]


def test_a_batch_that_cannot_be_built_fails_create_app_instead_of_hanging(monkeypatch, engine):
    monkeypatch.setattr(server_worker, "RunningBatch", broken_batch)
    raised = ended(create_app, engine, max_batch=2)
    assert isinstance(raised, RuntimeError) and "kernel compile failed" in str(raised)


class Held:
    """`serve` with its loader replaced: the engine comes once the test releases it (or `error` is raised
    then); the server it makes and the lines it says are kept, each awaitable."""

    def __init__(self, monkeypatch, engine, error: BaseException | None = None):
        from werkzeug import serving

        self.release, self.made, self.serving = threading.Event(), threading.Event(), threading.Event()
        self.lines, self.servers, make = [], [], serving.make_server

        def loader():
            self.release.wait()
            if error is not None:
                raise error
            return engine

        def made(*args, **kwargs):
            self.servers.append(make(*args, **kwargs))
            self.made.set()
            return self.servers[-1]

        monkeypatch.setattr(server_app, "warmed_loader", lambda *args: loader)
        monkeypatch.setattr(serving, "make_server", made)

    def log(self, line: str):
        self.lines.append(line)
        if line.startswith("od-moe serving "):
            self.serving.set()

    def base(self) -> str:
        assert self.made.wait(BOUND_S)
        return f"http://127.0.0.1:{self.servers[0].port}"


def request(base, path, body=None, headers=()):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        base + path, data=data, headers={"Content-Type": "application/json", **dict(headers)}
    )
    try:
        with urllib.request.urlopen(req, timeout=BOUND_S) as r:
            return r.status, json.loads(r.read()), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def test_the_port_answers_while_the_model_loads_then_serves(monkeypatch, engine):
    held = Held(monkeypatch, engine)
    thread = threading.Thread(
        target=server_app.serve, kwargs=dict(port=0, max_batch=2, log=held.log), daemon=True
    )
    thread.start()
    base = held.base()
    status, health, _ = request(base, "/health")
    assert (status, health["status"], health["model"], health["model_loaded"]) == (
        503,
        "loading",
        "tiny-qwen3-moe-4bit",
        False,
    )
    completion = {"prompt": "def f(x):", "max_tokens": 3, "temperature": 0}
    for path, body in [
        ("/v1/completions", completion),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}),
        ("/v1/models", None),
    ]:
        status, error, headers = request(base, path, body)
        assert status == 503 and headers["Retry-After"] == "5", (path, status, error)
        assert "is loading" in error["error"]["message"] and error["error"]["type"] == "server_error"
    status, error, headers = request(base, "/v1/messages", {"max_tokens": 3, "messages": []})
    assert status == 503 and error["type"] == "error" and "is loading" in error["error"]["message"]
    status, error, _ = request(base, "/health", headers={"Host": "evil.example"})  # checked while loading too
    assert status == 403 and "not an address of this server" in error["error"]["message"]
    assert held.lines == []  # nothing said yet: "od-moe serving" means ready
    held.release.set()
    assert held.serving.wait(BOUND_S), held.lines
    status, health, _ = request(base, "/health")
    assert status == 200 and health["status"] == "ok" and health["model_loaded"]
    status, answer, _ = request(base, "/v1/completions", dict(completion, model="tiny-qwen3-moe-4bit"))
    assert status == 200 and answer["usage"]["completion_tokens"] == 3
    held.servers[0].shutdown()
    thread.join(BOUND_S)
    assert not thread.is_alive()


def test_serve_raises_a_compile_that_fails_before_ready_and_the_cli_says_it_in_one_line(
    monkeypatch, engine, capsys
):
    held = Held(monkeypatch, engine)
    monkeypatch.setattr(server_worker, "RunningBatch", broken_batch)
    held.release.set()
    code = ended(main, ["serve", "--port", "0", "--max-batch", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err == [
        "od-moe: error: the server could not start: RuntimeError: kernel compile failed"
    ]
    assert held.servers and held.lines == []  # the port was served, and nothing said it was ready


def test_a_load_that_fails_while_the_port_answers_is_one_line_and_exit_2_for_a_users_mistake(
    monkeypatch, engine, capsys
):
    held = Held(monkeypatch, engine, UserError("model folder nowhere does not exist: give the path of ..."))
    running = threading.Thread(
        target=lambda: held.outcome.append(main(["serve", "--port", "0"])), daemon=True
    )
    held.outcome = []
    running.start()
    status, health, _ = request(held.base(), "/health")
    assert status == 503 and health["status"] == "loading"  # served while the load goes on
    held.release.set()
    running.join(BOUND_S)
    err = capsys.readouterr().err.strip().splitlines()
    assert held.outcome == [2] and err == [
        "od-moe: error: model folder nowhere does not exist: give the path of ..."
    ]


def test_the_served_name_is_the_folders_or_the_hub_ids_never_a_local_path(tmp_path, engine):
    from od_moe.server.starting import served_name

    assert served_name(None) == "tiny-qwen3-moe-4bit" == served_name(str(od_moe.DEFAULT_MODEL))
    assert served_name("mlx-community/Qwen3-30B-A3B-4bit") == "mlx-community/Qwen3-30B-A3B-4bit"
    (tmp_path / "org").mkdir()  # a local folder named like a hub id is a folder
    assert served_name(str(tmp_path / "org")) == "org"
    client = create_app(engine).test_client()
    (entry,) = client.get("/v1/models").get_json()["data"]
    assert entry["id"] == entry["capabilities"]["model"] == "tiny-qwen3-moe-4bit"
    capabilities = client.get("/v1/capabilities").get_json()
    assert capabilities["model"] == "tiny-qwen3-moe-4bit"
    assert capabilities["predictor"]["path"] == "tiny-qwen3-moe-4bit-predictor"  # its folder's name too
    for named in ("tiny-qwen3-moe-4bit", str(engine.model_path), "default"):  # each still accepted
        reply = client.post("/v1/completions", json={"model": named, "prompt": "x", "max_tokens": 1})
        assert reply.status_code == 200, (named, reply.get_json())
    assert client.post("/v1/completions", json={"model": "other", "prompt": "x"}).status_code == 404
    client.application.worker.stop()


@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT])
def test_stopped_while_the_model_loads_it_ends_at_once_and_cleanly(stop):
    """A load cannot be stopped midway, and an interpreter that exits while it runs MLX aborts: the process
    ends at once, with exit code 0 as after serving."""
    proc = subprocess.Popen(
        [sys.executable, str(LOADING_SERVER), "serve", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as from a terminal
    )
    try:
        port = int(proc.stderr.readline().split("serving port ")[1])
        status, health, _ = request(f"http://127.0.0.1:{port}", "/health")
        assert status == 503 and health["status"] == "loading"
        proc.send_signal(stop)
        _, err = proc.communicate(timeout=BOUND_S)
    finally:
        proc.kill()
    assert proc.returncode == 0 and "terminate called" not in err and "Traceback" not in err, err
    assert "od-moe: shutting down" in err


def test_a_worker_shut_down_while_it_loads_ends_once_it_has_loaded(engine):
    release = threading.Event()
    worker = server_worker.GenerationWorker(loader=lambda: release.wait() and engine, max_batch=2)
    assert worker.state() == "loading"
    assert worker.shutdown() is False  # it does not wait for the load
    assert worker.state() == "stopping"
    release.set()
    assert worker.join(BOUND_S)
