"""Expert reads that fail mid-generation (issue 16, item 12): the request fails with one clear
`ExpertReadError` naming the file and what to do, nothing of the failed read reaches a slot, a failed
prefetch only costs its read, no read stays in flight, and the next request gives stock mlx-lm's tokens:
through the Python API, the command line and the server."""

import json
import os
import shutil
import threading
import urllib.request

import mlx_lm
import pytest
from mlx_lm.models.cache import make_prompt_cache
from werkzeug.serving import make_server

import od_moe
from conftest import PROMPTS, invariants, od_moe_tokens, slots_hold_their_experts
from od_moe.cli import main
from od_moe.errors import ExpertReadError
from od_moe.memory import backend
from od_moe.per_layer import PerLayerSettings
from od_moe.prefetch.governor import PrefetchSettings
from od_moe.server import create_app
from od_moe.storage.store import ExpertStore

TOKENS = 24  # greedy tokens are a prefix of the 64 the reference holds


def _fail_reads(monkeypatch, when):
    """Make `ExpertStore.read` raise OSError(EIO) where `when(layout, ids)` says so (any thread)."""
    real = ExpertStore.read

    def read(store, layout, ids, staging):
        if when(layout, [int(i) for i in ids]):
            raise OSError(5, "Input/output error")
        return real(store, layout, ids, staging)

    monkeypatch.setattr(ExpertStore, "read", read)


def _nth_call(n):
    calls = []
    return lambda layout, ids: calls.append(1) or len(calls) == n


def test_a_failed_demand_read_fails_the_request_and_the_next_one_is_exact(monkeypatch, bundled_reference):
    engine = od_moe.load(capacity="25%")
    _fail_reads(monkeypatch, _nth_call(40))  # mid-prefill or early decode of the first prompt
    with pytest.raises(ExpertReadError) as failed:
        engine.generate(PROMPTS[0], max_tokens=TOKENS)
    message = str(failed.value)
    assert str(engine.runtime.store.files[0]) in message and "Input/output error" in message
    assert "switch_mlp" in message and "restore the model folder" in message and "\n" not in message
    slots_hold_their_experts(engine)
    monkeypatch.undo()
    for prompt, expected in zip(PROMPTS, bundled_reference):
        assert od_moe_tokens(engine, [prompt], TOKENS)[0] == expected[:TOKENS]
    slots_hold_their_experts(engine)


def test_a_file_changed_since_load_is_refused_and_the_engine_stays_exact(tmp_path, bundled_reference):
    """A checkpoint truncated, rewritten in place or replaced under a running engine is not read again: the
    request that needs it fails with one line saying how it changed and what to do, no slot is corrupted,
    and loading the model again reads the new files exactly."""
    model = tmp_path / "model"
    shutil.copytree(od_moe.DEFAULT_MODEL, model)
    data = model / "model.safetensors"
    data.chmod(0o644)
    original = data.read_bytes()
    engine = od_moe.load(str(model), capacity="25%", prefetch="next-gate")
    engine.generate(PROMPTS[0], max_tokens=4)
    with open(data, "r+b") as f:  # shrunk under the running engine: the later experts are gone
        f.truncate(len(original) // 3)
    shrunk = f"{len(original)} bytes when loaded, {len(original) // 3} now"
    with pytest.raises(
        ExpertReadError, match=f"^{data} changed since od-moe loaded it \\({shrunk}\\): .*restart"
    ):
        engine.generate(PROMPTS[1], max_tokens=TOKENS)
    slots_hold_their_experts(engine, od_moe.DEFAULT_MODEL)
    with open(data, "r+b") as f:  # the same bytes written back in place: still not the file loaded
        f.write(original)
    with pytest.raises(ExpertReadError, match="modified since it was loaded"):
        engine.generate(PROMPTS[1], max_tokens=TOKENS)
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(original)
    os.replace(copy, data)  # another file under the same name
    with pytest.raises(ExpertReadError, match="replaced by another file"):
        engine.generate(PROMPTS[1], max_tokens=TOKENS)
    slots_hold_their_experts(engine, od_moe.DEFAULT_MODEL)
    invariants(engine.stats())
    again = od_moe.load(str(model), capacity="25%", prefetch="next-gate")  # loaded again: the new files
    assert od_moe_tokens(again, [PROMPTS[1]], TOKENS)[0] == bundled_reference[1][:TOKENS]
    slots_hold_their_experts(again)


def test_failed_prefetch_reads_cost_only_their_reads(monkeypatch, bundled_reference):
    """Reader threads hit every error (demand reads of one miss are the generation thread's own): the
    requests still complete with stock tokens and the prefetch counts add up."""
    engine = od_moe.load(capacity="25%", prefetch="next-gate", read_threads=1)
    engine.configure_prefetch("next-gate", settings=PrefetchSettings(timed_checks=False))
    _fail_reads(monkeypatch, lambda layout, ids: threading.current_thread().name == "od-moe-reader")
    assert od_moe_tokens(engine, [PROMPTS[0]], TOKENS)[0] == bundled_reference[0][:TOKENS]
    stats = engine.stats()
    invariants(stats)
    assert stats["prefetch"]["issued"] > 0 and stats["prefetch"]["useful"] == 0
    assert stats["prefetch"]["wasted"] == stats["prefetch"]["issued"] - stats["prefetch"]["in_flight"] > 0
    slots_hold_their_experts(engine)
    monkeypatch.undo()
    assert od_moe_tokens(engine, [PROMPTS[2]], TOKENS)[0] == bundled_reference[2][:TOKENS]
    assert engine.stats()["prefetch"]["useful"] > 0


def test_an_unreadable_expert_fails_on_the_generation_thread_with_reader_threads(
    monkeypatch, bundled_reference
):
    """One expert cannot be read, by reader threads (prefetch, helping demand) or the generation thread:
    the request that needs it fails there, no read is left in flight, and the reader's byte count of
    prefetches in flight stays right."""
    engine = od_moe.load(capacity="25%", read_threads=3)
    engine.configure_prefetch("next-gate", settings=PrefetchSettings(timed_checks=False))
    routing = od_moe.load(capacity=1.0).record_routing(PROMPTS[0], TOKENS)
    layer = 3
    expert = int(routing[len(routing) // 2][layer][0, 0])  # used during decode
    path = engine.caches[layer].layout.module_path
    _fail_reads(monkeypatch, lambda layout, ids: layout.module_path == path and expert in ids)
    with pytest.raises(ExpertReadError, match=f"{expert}.* of {path} from .*Input/output error"):
        engine.generate(PROMPTS[0], max_tokens=TOKENS)
    reader = engine.runtime.reader
    reader.drain()
    with reader._lock:
        held = [r for r in list(reader._reading.values()) + list(reader._ready.values()) if not r.demand]
        assert not reader._reading and reader._inflight_bytes == sum(r.nbytes for r in held)
    slots_hold_their_experts(engine)
    invariants(engine.stats())
    monkeypatch.undo()
    assert od_moe_tokens(engine, [PROMPTS[0]], TOKENS)[0] == bundled_reference[0][:TOKENS]
    slots_hold_their_experts(engine)
    invariants(engine.stats())


def test_a_prompt_cache_is_given_back_as_it_was(monkeypatch):
    """A failed request's prompt cache holds what it held before: continuing it later gives stock tokens."""
    first, second = PROMPTS[0], "\n\ndef main():"
    model, tokenizer = mlx_lm.load(str(od_moe.DEFAULT_MODEL))
    model.set_dtype(backend.compute_dtype("auto"))
    cache = make_prompt_cache(model)

    def tokens(generate_from, cache, prompt):
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        return [r.token for r in generate_from(ids, cache)]

    def stock(ids, cache):
        return mlx_lm.stream_generate(model, tokenizer, ids, max_tokens=8, prompt_cache=cache)

    expected = [tokens(stock, cache, first), tokens(stock, cache, second)]
    engine = od_moe.load(capacity="25%")
    cache = make_prompt_cache(engine.model)

    def ours(ids, cache):
        return engine.stream_generate(ids, max_tokens=8, prompt_cache=cache)

    assert tokens(ours, cache, first) == expected[0]
    held = [c.offset for c in cache]
    _fail_reads(monkeypatch, _nth_call(6))  # a middle layer of the second prompt's prefill
    with pytest.raises(ExpertReadError):
        tokens(ours, cache, second)
    assert [c.offset for c in cache] == held  # the layers before the failed one gave their tokens back
    monkeypatch.undo()
    assert tokens(ours, cache, second) == expected[1]


def test_the_command_line_says_it_in_one_line(monkeypatch, capsys):
    _fail_reads(monkeypatch, _nth_call(3))
    assert main(["generate", "--prompt", PROMPTS[0], "--max-tokens", "8", "--capacity", "25%"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("od-moe: error: cannot read expert") and "\n" not in err and "Traceback" not in err


def _call(base, path, body=None):
    req = urllib.request.Request(
        base + path,
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if r.headers.get_content_type() == "application/json" else text
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def test_the_server_fails_the_request_reports_it_and_serves_the_next_exactly(monkeypatch):
    engine = od_moe.load(capacity="25%")
    app = create_app(engine, max_tokens=64)
    srv = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{srv.server_port}"
    body = {"prompt": PROMPTS[2], "max_tokens": TOKENS, "temperature": 0}
    model, tokenizer = mlx_lm.load(str(od_moe.DEFAULT_MODEL))
    model.set_dtype(backend.compute_dtype("auto"))
    expected = "".join(
        r.text for r in mlx_lm.stream_generate(model, tokenizer, PROMPTS[2], max_tokens=TOKENS)
    )
    try:
        status, reply = _call(base, "/v1/completions", body)
        assert status == 200 and reply["choices"][0]["text"] == expected
        _fail_reads(monkeypatch, _nth_call(30))
        status, reply = _call(base, "/v1/completions", body)  # the prompt cache is used, then dropped
        assert status == 500 and reply["error"]["type"] == "server_error"
        assert "cannot read expert" in reply["error"]["message"]
        status, health = _call(base, "/health")
        assert health["status"] == "degraded" and "restore the model folder" in health["last_error"]
        assert health["requests"]["failed"] == 1
        _fail_reads(monkeypatch, _nth_call(5))  # a stream: an error event, and the stream ends
        req = urllib.request.Request(
            base + "/v1/completions",
            data=json.dumps(dict(body, stream=True)).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=120) as r:
            events = [line[len("data: ") :] for line in r.read().decode().split("\n") if line]
        assert "cannot read expert" in json.loads(events[-1])["error"]["message"]
        monkeypatch.undo()
        status, reply = _call(base, "/v1/completions", body)
        assert status == 200 and reply["choices"][0]["text"] == expected
        assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == 0  # nothing kept from failures
        status, health = _call(base, "/health")
        assert health["status"] == "ok" and health["requests"]["completed"] == 2
    finally:
        srv.shutdown()
        app.worker.shutdown()
    slots_hold_their_experts(engine)


def test_a_read_that_fails_while_resident_experts_compute_fails_only_the_request(
    monkeypatch, bundled_reference
):
    """A decode layer split in two rounds (`PerLayerSettings.split_on_miss`) whose missing experts cannot
    be read: its resident experts are already computing; the request fails with the read's error, nothing
    of the read is installed, and the engine serves stock tokens once the file reads again."""
    split = PerLayerSettings(split_on_miss=True)
    engine = od_moe.load(capacity="25%", prefetch="none", path_settings=split)
    failed_in_split, real_route = [], engine.runtime.route

    def route(layer, x, indices):
        rounds = []
        try:
            for r in real_route(layer, x, indices):
                rounds.append(r.lanes)
                yield r
        except ExpertReadError:
            if rounds and rounds[0] is not None:  # after the resident experts' round
                failed_in_split.append(engine.runtime.passes.phase)
            raise

    monkeypatch.setattr(engine.runtime, "route", route)
    with monkeypatch.context() as failing:
        _fail_reads(failing, lambda layout, ids: engine.runtime.passes.phase == "decode")
        with pytest.raises(ExpertReadError, match="Input/output error"):
            engine.generate(PROMPTS[0], max_tokens=TOKENS)
    assert failed_in_split == ["decode"]
    slots_hold_their_experts(engine)
    assert od_moe_tokens(engine, [PROMPTS[1]], TOKENS)[0] == bundled_reference[1][:TOKENS]
    slots_hold_their_experts(engine)
    invariants(engine.stats())


def test_a_failed_read_fails_a_two_tier_load_read_in_place(monkeypatch):
    """The stacks' reads run on threads straight into the arrays (`mapped.read_stacks`): a failed read fails
    the load with the one-line read error naming the file, raised on the loading thread."""
    threads, real = set(), ExpertStore._pread_exact

    def pread(store, file_index, views, offset):
        threads.add(threading.current_thread().name)
        if len(threads) > 1 or offset > store.files[file_index].stat().st_size // 2:
            raise OSError(5, "Input/output error")
        return real(store, file_index, views, offset)

    monkeypatch.setattr(ExpertStore, "_pread_exact", pread)
    with pytest.raises(ExpertReadError) as failed:
        od_moe.load(capacity="25%", two_tier=True, dtype="model")
    message = str(failed.value)
    assert "model.safetensors" in message and "Input/output error" in message and "\n" not in message
    assert threading.current_thread().name not in threads  # read by the load's threads
