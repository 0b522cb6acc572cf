"""Requests against the KV cache room a device budget keeps (`server/kv_room.py`): one that can never fit
is a 400 naming the limit, one that fits once others end a 503 with Retry-After, and the server keeps
serving. The card is simulated (`backend.device_memory`); the admission is the one CUDA runs."""

import json

import pytest

import od_moe
from od_moe.memory import backend
from od_moe.server import create_app
from od_moe.server.kv_room import KvRoom


@pytest.fixture
def app(monkeypatch):
    monkeypatch.setattr(backend, "device_memory", lambda: (10**12, 10**12))
    engine = od_moe.load(context_tokens=512, sequences=2)  # room for 1,024 tokens in all
    app = create_app(engine, max_batch=2)
    yield app
    app.worker.stop()


def test_a_request_that_can_never_fit_is_a_400_naming_the_limit(app):
    client = app.test_client()
    for path, body in (
        ("/v1/completions", {"prompt": "def f():", "max_tokens": 1100}),
        ("/v1/messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1100}),
    ):
        reply = client.post(path, json=body)
        assert reply.status_code == 400
        text = json.dumps(reply.get_json())
        assert "needs a KV cache of 1,280 tokens" in text and "room for 1,024 tokens" in text
        assert "--context-tokens 512 x --max-batch 2" in text
    ok = client.post("/v1/completions", json={"prompt": "def f():", "max_tokens": 4, "temperature": 0})
    assert ok.status_code == 200 and ok.get_json()["choices"][0]["text"]


def test_one_that_fits_once_others_end_is_a_503_with_retry_after(app):
    client = app.test_client()
    body = {"prompt": "def f():", "max_tokens": 600, "stream": True, "temperature": 0}
    holding = client.post("/v1/completions", json=body, buffered=False)  # holds 768 tokens while it streams
    assert holding.status_code == 200
    full = client.post("/v1/completions", json={"prompt": "x = 1", "max_tokens": 300})
    assert full.status_code == 503 and full.headers["Retry-After"] == "1"
    assert "768 of 1,024 tokens held; this one needs 512" in full.get_json()["error"]["message"]
    holding.close()  # its client goes away: the room is given back
    again = client.post("/v1/completions", json={"prompt": "x = 1", "max_tokens": 3, "temperature": 0})
    assert again.status_code == 200
    assert KvRoom.of(app.worker.engine).tokens == 1024


def test_no_room_where_the_device_computes_in_host_memory():
    assert KvRoom.of(od_moe.load(capacity=8)) is None
