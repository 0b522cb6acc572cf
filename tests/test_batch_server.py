"""Continuous batching in `od-moe serve` (`server/batching.py`): concurrent greedy requests served in one
running batch give, request by request, the tokens mlx-lm's own `BatchGenerator` gives on the stock model
when driven through the schedule the server logged (`server/schedule.py`), all experts resident and at
25%; a long prompt prefills in chunks between the running batch's decode steps; a hang-up leaves at once;
/health, /metrics and the live page show the batch."""

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import mlx_lm
import pytest
from werkzeug.serving import make_server

import od_moe
from od_moe.cli import main
from od_moe.memory import backend
from od_moe.server import create_app
from od_moe.server.arrivals import Arrivals
from od_moe.server.batching import fitting_batch
from od_moe.server.requests import parse_params
from od_moe.server.schedule import ScheduleLog, replay
from od_moe.server.warm_up import warm_up
from od_moe.server.worker import GenerationWorker

PROMPTS = [f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(6)]


def start(engine, **kwargs):
    log = ScheduleLog()
    worker = GenerationWorker(engine, schedule=log, **kwargs)
    app = create_app(worker=worker)
    srv = make_server("127.0.0.1", 0, app, threaded=True)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{srv.server_port}", log, srv, worker


def call(base, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        text = r.read().decode()
        return json.loads(text) if r.headers.get_content_type() == "application/json" else text


def hang_up_after_first_token(base, body):
    host, port = base.split("//")[1].split(":")
    raw = json.dumps(dict(body, stream=True)).encode()
    sock = socket.create_connection((host, int(port)), timeout=60)
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(raw), raw)
    )
    received = b""
    while b'"text": "' not in received:
        received += sock.recv(4096)
    sock.close()


@pytest.fixture(scope="module")
def stock():
    model, tokenizer = mlx_lm.load(str(od_moe.DEFAULT_MODEL))
    model.set_dtype(backend.compute_dtype("auto"))
    return model, tokenizer


def text_of(tokenizer, tokens, eos):
    """The text mlx-lm's streaming detokenizer makes of `tokens` (an end-of-sequence token adds none)."""
    detokenizer = tokenizer.detokenizer
    for t in tokens:
        if t not in eos:
            detokenizer.add_token(t)
    detokenizer.finalize()
    return detokenizer.text


@pytest.mark.parametrize("capacity, two_tier", [(None, False), ("25%", False), ("25%", True)])
def test_batched_requests_give_the_tokens_of_their_schedule_replayed_through_mlx_lm(
    capacity, two_tier, stock
):
    engine = od_moe.load(capacity=capacity, two_tier=two_tier)
    base, log, srv, worker = start(engine, max_batch=4)
    bodies = [{"prompt": p, "max_tokens": 8 + 3 * i, "temperature": 0} for i, p in enumerate(PROMPTS)]
    bodies[2]["stop"] = ["(x"]  # every completion here starts a new `def function_...(x)`
    replies = [None] * len(bodies)

    def client(i):
        time.sleep(0.04 * i)  # arrivals spread over the first steps: requests join a running batch
        replies[i] = call(base, "/v1/completions", bodies[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(bodies))]
    threads.append(
        threading.Thread(target=hang_up_after_first_token, args=(base, dict(bodies[0], max_tokens=400)))
    )
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    deadline = time.time() + 60
    while worker.active or worker.counters["cancelled"] < 1:
        assert time.time() < deadline
        time.sleep(0.05)
    srv.shutdown()
    worker.stop()

    eos = set(engine.tokenizer.eos_token_ids)
    replayed = replay(stock[0], log, eos)
    assert replayed == log.tokens  # every sequence, the hung-up one too
    uid_of = {tuple(j.prompt): j.uid for j in log.joins if j.max_tokens != 400}
    for body, reply in zip(bodies, replies):
        tokens = replayed[uid_of[tuple(engine.tokenizer.encode(body["prompt"]))]]
        choice = reply["choices"][0]
        assert reply["usage"]["completion_tokens"] == len(tokens)
        whole = text_of(engine.tokenizer, tokens, eos)
        if body.get("stop"):
            assert choice["finish_reason"] == "stop" and choice["text"] == whole[: whole.index("(x")]
        else:
            assert choice["text"] == whole
            assert choice["finish_reason"] == ("stop" if tokens[-1] in eos else "length")
            assert tokens[-1] in eos or len(tokens) == body["max_tokens"]
    # a real continuous batch: joins at several steps, up to four decoding at once, two left early
    assert len({j.step for j in log.joins}) >= 3
    assert max(int(k) for k in worker.batch.passes) == 4
    assert len(log.leaves) == 2  # the stop string and the hang-up, removed by the worker


def test_a_long_prompt_prefills_in_chunks_between_the_running_batchs_decode_steps(stock):
    engine = od_moe.load()
    base, log, srv, worker = start(engine, max_batch=4, prefill_step=16)
    long_prompt = "".join(f"value_{i} = compute({i})\n" for i in range(24))
    replies = {}

    def run(name, body):
        replies[name] = call(base, "/v1/completions", body)

    first = threading.Thread(
        target=run, args=("short", {"prompt": "import os\n", "max_tokens": 48, "temperature": 0})
    )
    first.start()
    while not any(log.tokens.values()):
        time.sleep(0.01)
    run("long", {"prompt": long_prompt, "max_tokens": 4, "temperature": 0})
    first.join(300)
    srv.shutdown()
    worker.stop()
    short, long = log.joins
    chunks = -(-(len(long.prompt) - 1) // 16)  # the last prompt token is the sequence's first pass
    first_step = log.token_steps[long.uid][0]
    assert first_step >= long.step + chunks
    # the short request got a token at every step while the long prompt was prefilled
    assert set(range(long.step, first_step)) <= set(log.token_steps[short.uid])
    assert replay(stock[0], log, engine.tokenizer.eos_token_ids) == log.tokens
    assert replies["long"]["usage"]["prompt_tokens"] == len(long.prompt)


def test_health_metrics_and_the_live_page_show_the_running_batch():
    engine = od_moe.load(capacity="50%")
    base, log, srv, worker = start(engine, max_batch=3)
    seen, done = [], threading.Event()

    def watch():
        while not done.is_set():
            seen.append(call(base, "/health")["batch"])
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    clients = [
        threading.Thread(target=call, args=(base, "/v1/completions", {"prompt": p, "max_tokens": 24}))
        for p in PROMPTS[:5]
    ]
    for t in clients:
        t.start()
    for t in clients:
        t.join(300)
    done.set()
    watcher.join(30)
    assert max(b["size"] for b in seen) == 3 and max(b["queued"] for b in seen) >= 1
    assert all(b["max_batch"] == 3 and b["size"] <= 3 for b in seen)
    rates = [r["tok_s"] for b in seen for r in b["running"] if r["tok_s"] is not None]
    assert rates and all(r > 0 for r in rates)
    health = call(base, "/health")
    batch = health["batch"]
    assert batch["size"] == batch["queued"] == 0 and batch["decode_tok_s"] > 0
    booked, cache = batch["passes_by_batch_size"], health["expert_cache_stats"]
    # every token given out was decoded in a step booked by its batch size, and every decode lookup was
    # booked (steps where only joining sequences' first passes ran apart, keyed by no batch size); a step's
    # lookups are at least its sequences' (top-k of each layer for each; a joining one's first pass adds)
    assert all(int(k) >= 1 for k in booked)
    joining = batch["joining_passes"] or {"lookups": 0}
    assert sum(int(k) * v["steps"] for k, v in booked.items()) == cache["generated_tokens"]
    assert sum(v["lookups"] for v in booked.values()) + joining["lookups"] == cache["decode_lookups"]
    per_sequence = engine.top_k * cache["moe_layers"]
    assert "3" in booked
    assert all(v["lookups"] >= int(k) * v["steps"] * per_sequence for k, v in booked.items())
    metrics = call(base, "/metrics")
    assert re.search(r"^od_moe_batch_max 3\.0$", metrics, re.M)
    assert re.search(r"^od_moe_decode_tokens_per_second [0-9.e+]+$", metrics, re.M)
    page = call(base, "/dashboard/data")["batch"]
    assert page["max_batch"] == 3 and page["size"] == 0
    srv.shutdown()
    worker.stop()


def test_seeded_sampling_in_a_batch_repeats_and_max_batch_is_checked():
    engine = od_moe.load(capacity="50%")
    base, _, srv, worker = start(engine, max_batch=4)
    body = {"prompt": "class Stack:", "max_tokens": 12, "temperature": 0.9, "seed": 7}
    assert (
        call(base, "/v1/completions", body)["choices"][0]["text"]
        == call(base, "/v1/completions", body)["choices"][0]["text"]
    )
    srv.shutdown()
    worker.stop()
    with pytest.raises(SystemExit) as exit_code:
        main(["serve", "--max-batch", "0"])
    assert exit_code.value.code == 2


def test_max_batch_is_cut_to_the_kv_caches_that_fit_in_memory():
    engine = od_moe.load(capacity="50%")
    per_request = 8 * 2 * 2 * 48 * 4 * 2048  # layers x (k, v) x kv heads x head dim x float32 x positions
    assert fitting_batch(engine, 8, available=100 * per_request) == (8, None)
    cut, why = fitting_batch(engine, 8, available=3 * per_request + 1)
    assert cut == 3 and "--max-batch 8 cut to 3" in why
    assert fitting_batch(engine, 8, available=per_request // 2)[0] == 1


def test_max_batch_1_keeps_the_one_at_a_time_path_and_its_prompt_cache_reuse():
    engine = od_moe.load(capacity="50%")
    base, log, srv, worker = start(engine, max_batch=1)
    first = engine.tokenizer.encode("import json\nimport os\n\n\ndef load_config(path):\n")
    second = first + engine.tokenizer.encode("    with open(path) as f:\n")
    call(base, "/v1/completions", {"prompt": first, "max_tokens": 4, "temperature": 0})
    warm = call(base, "/v1/completions", {"prompt": second, "max_tokens": 12, "temperature": 0})
    srv.shutdown()
    worker.stop()
    assert worker.batch is None and not log.joins  # no BatchGenerator ran
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] >= len(first)
    alone = "".join(r.text for r in engine.stream_generate(second, max_tokens=12))
    assert warm["choices"][0]["text"] == alone


class _BatchSizes:
    """A model that notes the batch size of every pass it runs."""

    def __init__(self, model):
        self.model, self.seen = model, set()

    def __call__(self, inputs, *args, **kwargs):
        self.seen.add(inputs.shape[0])
        return self.model(inputs, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.model, name)


@pytest.mark.parametrize("max_batch", [1, 3])
def test_the_warm_up_compiles_before_serving_and_keeps_no_figures(max_batch):
    """`serve` runs one short request on the engine before it serves (`warm_up.py`), so that the passes a
    first request would compile are compiled then: where it batches, batches of one sequence and of
    `max_batch`, through mlx-lm's `BatchGenerator` as the server's batch runs them. After it the engine's
    statistics are empty and a request gets the text it gets from an engine with no warm-up."""
    texts = []
    for warm in (True, False):
        engine = od_moe.load(capacity=0.25, two_tier=True)
        blocks = [layer.mlp for layer in engine.model.model.layers]
        if warm:
            model = engine.forward
            engine.forward = recording = _BatchSizes(model)
            assert warm_up(engine, max_batch=max_batch) > 0
            assert all(b._compiled for b in blocks)  # decode passes compiled
            assert recording.seen == {1, max_batch}
            engine.forward = model
            assert engine.stats()["positions"] == {"prefill": 0, "decode": 0}
        else:
            assert not any(b._compiled for b in blocks)
        base, log, srv, worker = start(engine, max_batch=max_batch)
        body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0}
        texts.append(call(base, "/v1/completions", body)["choices"][0]["text"])
        srv.shutdown()
        worker.stop()
        assert worker.counters["completed"] == 1 and engine.stats()["positions"]["decode"] > 0
    assert texts[0] == texts[1] and texts[0]


def test_a_step_that_fails_ends_its_requests_with_an_error_and_the_worker_serves_on(monkeypatch, stock):
    """A step that raises, and a ledger that cannot settle after it, end the running requests with a 5xx
    error; the generation thread lives on and the next request is answered. The new generator's
    sequences keep uids of their own in the schedule log, which replays to the tokens served."""
    engine = od_moe.load(capacity="50%")
    base, log, srv, worker = start(engine, max_batch=2)
    from od_moe.server import batching

    step, settle, broken = batching.RunningBatch.step, engine.runtime.settle, [True]

    def step_once_broken(self):
        if broken[0]:
            broken[0] = False
            monkeypatch.setattr(engine.runtime, "settle", lambda: 1 / 0)
            raise RuntimeError("the device went away")
        return step(self)

    monkeypatch.setattr(batching.RunningBatch, "step", step_once_broken)
    with pytest.raises(urllib.error.HTTPError) as failed:
        call(base, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
    assert failed.value.code >= 500
    told = json.loads(failed.value.read())["error"]["message"]  # the step's error, and the settling's
    assert "the device went away" in told and "settling the expert cache failed too (ZeroDivision" in told
    monkeypatch.setattr(engine.runtime, "settle", settle)
    answer = call(base, "/v1/completions", {"prompt": PROMPTS[1], "max_tokens": 4, "temperature": 0})
    assert answer["choices"][0]["text"] and worker.state() != "error"  # its thread lives on
    srv.shutdown()
    (failed_uid, served), steps = [j.uid for j in log.joins], log.resets
    assert failed_uid != served and log.tokens[served] and len(steps) == 1
    assert replay(stock[0], log, stock[1].eos_token_ids)[served] == log.tokens[served]


def test_a_ledger_that_cannot_settle_after_the_last_request_is_logged_and_shown(monkeypatch, caplog):
    """The batch settles the runtime once its last request has ended; where that fails, no request is left
    to be told: the server's log says it and /health shows it (it was swallowed)."""
    engine = od_moe.load(capacity="50%")
    base, _, srv, worker = start(engine, max_batch=2)

    between_passes = engine.runtime.settle

    def settle():  # fails once the batch is empty: after its last request has ended
        if len(worker.batch):
            return between_passes()
        raise RuntimeError("the ledger is gone")

    monkeypatch.setattr(engine.runtime, "settle", settle)
    answer = call(base, "/v1/completions", {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0})
    assert answer["choices"][0]["text"]  # its text was made before the settling, and is right
    srv.shutdown()
    worker.stop()
    assert worker.join(60)  # the worker has done all it will: settled (and failed) after the request
    assert "the ledger is gone" in worker.last_error and worker.failures_in_a_row
    logged = [r for r in caplog.records if r.name == "od_moe.server" and r.exc_info]
    assert logged and "the ledger is gone" in str(logged[0].exc_info[1]), caplog.records


def test_prompt_lookup_turns_batching_off_and_the_reason_names_it():
    """Prompt lookup is no draft model: the line `serve` prints says what turned batching off."""
    from od_moe import PromptLookup
    from od_moe.server.drafting import ServerDraft

    worker = GenerationWorker(od_moe.load(capacity="50%"), max_batch=4, drafting=ServerDraft(PromptLookup()))
    assert worker.ready.wait(60) and worker.load_error is None
    worker.stop()
    assert worker.batch_cut == "batching is off with prompt lookup: one request at a time (--max-batch 4)"


def test_a_joining_requests_first_text_is_sent_in_the_step_of_its_first_pass(monkeypatch):
    """The first token's text goes out when the step that computed it ends, not a step later when mlx-lm's
    generator gives the token out; a stop string in it, a limit of one token and the text are as before."""
    from od_moe.server import batching

    engine = od_moe.load(capacity="25%")
    base, log, srv, worker = start(engine, max_batch=2)
    sent_at, send = {}, batching.Sequence.send

    def send_and_note(seq):
        before = seq.sent
        send(seq)
        if seq.sent > before:
            sent_at.setdefault(seq.uid, worker.batch.steps)

    monkeypatch.setattr(batching.Sequence, "send", send_and_note)
    body = {"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0}
    whole = call(base, "/v1/completions", body)["choices"][0]
    stopped = call(base, "/v1/completions", dict(body, stop=["de"]))["choices"][0]
    one = call(base, "/v1/completions", dict(body, max_tokens=1))["choices"][0]
    srv.shutdown()
    worker.stop()
    first = log.joins[0].uid
    # steps counts BatchGenerator.next() calls: the token given out by call n was sent after call n - 1
    assert sent_at[first] == log.token_steps[first][0]
    alone = [r.text for r in engine.stream_generate(engine.encode(PROMPTS[0]), max_tokens=6)]
    assert whole["text"] == "".join(alone) and alone[0] == "def"
    assert (stopped["text"], stopped["finish_reason"]) == ("", "stop")
    assert (one["text"], one["finish_reason"]) == ("def", "length")


def test_the_ledger_books_decode_lookups_per_sequence_and_per_pass():
    """/health and /metrics: a decode lookup per sequence and routed expert (the hit rate's), and per pass the
    distinct experts a layer's pass routed to (the batch's union, looked up once); each request's figures,
    the last completed kept."""
    engine = od_moe.load(capacity="25%")
    base, _, srv, worker = start(engine, max_batch=3)
    clients = [
        threading.Thread(
            target=call, args=(base, "/v1/completions", {"prompt": p, "max_tokens": 12, "temperature": 0})
        )
        for p in PROMPTS[:3]
    ]
    for t in clients:
        t.start()
    for t in clients:
        t.join(300)
    health, metrics = call(base, "/health"), call(base, "/metrics")
    srv.shutdown()
    worker.stop()
    cache, booked = health["expert_cache_stats"], health["batch"]["passes_by_batch_size"]
    per, k, layers = cache["decode_per_pass"], engine.top_k, cache["moe_layers"]
    assert per["positions"] == cache["decode_positions"] > cache["decode_passes"] == per["passes"]
    assert per["routings_read"] == per["passes"] * layers  # at 25% every decode layer reads its routing
    assert per["lookups_per_layer_pass"] == pytest.approx(per["sequences_per_pass"] * k)
    # a pass of three sequences looks each shared expert up once: fewer experts than lookups, k at least
    three = booked["3"]
    assert three["experts"] < three["lookups"] and k <= three["experts_per_layer_pass"] < 3 * k
    joining = health["batch"]["joining_passes"] or {"experts": 0}
    assert sum(v["experts"] for v in booked.values()) + joining["experts"] == per["experts"]
    assert 0 <= per["pass_hit_rate"] <= 1 and per["sequence_hit_rate"] == cache["decode_hit_rate"]
    assert re.search(rf"^od_moe_model_decode_positions_total {per['positions']}\.0$", metrics, re.M)
    assert re.search(rf"^od_moe_expert_cache_decode_pass_experts_total {per['experts']}\.0$", metrics, re.M)
    finished = health["batch"]["finished"]
    assert len(finished) == 3 and all(r["state"] == "finished" and r["tok_s"] > 0 for r in finished)
    assert all(r["queued_s"] >= 0 and r["time_to_first_token_s"] > 0 for r in finished)
    # one sequence alone: per pass and per sequence are the same (its k experts are distinct)
    engine.runtime.ledger.reset()
    engine.generate(PROMPTS[3], max_tokens=6)
    alone = engine.stats()["per_pass"]["decode"]
    assert (
        alone["sequences_per_pass"] == 1
        and alone["experts"] == alone["lookups_per_layer_pass"] * alone["routings_read"]
    )


def test_serve_writes_its_schedule_to_a_file_that_replays_through_mlx_lm(tmp_path):
    """`od-moe serve --schedule-log PATH`: the schedule is written as it runs; `python3 -m
    od_moe.server.schedule PATH` replays it through stock mlx-lm (exit 0), and a log whose tokens are not
    the replay's is caught (exit 1)."""
    path = tmp_path / "schedule.jsonl"
    command = [
        sys.executable,
        "-X",
        "faulthandler",  # SIGABRT dumps every thread's stack: what a server that outlives SIGTERM waits on
        "-m",
        "od_moe",
        "serve",
        "--port",
        "0",
        "--capacity",
        "25%",
        "--max-batch",
        "3",
    ]
    proc = subprocess.Popen(command + ["--schedule-log", str(path)], stderr=subprocess.PIPE, text=True)
    said = []  # the server's stderr, read to its end so that a full pipe never blocks it
    try:
        base = "http://127.0.0.1:" + re.search(r"127\.0\.0\.1:(\d+)", proc.stderr.readline()).group(1)
        threading.Thread(target=lambda: said.extend(proc.stderr), daemon=True).start()
        bodies = [{"prompt": p, "max_tokens": 6 + i, "temperature": 0} for i, p in enumerate(PROMPTS[:3])]
        bodies.append({"prompt": PROMPTS[3], "max_tokens": 5, "temperature": 0.8, "seed": 1})
        clients = [threading.Thread(target=call, args=(base, "/v1/completions", b)) for b in bodies]
        for t in clients:
            t.start()
        for t in clients:
            t.join(300)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGABRT)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
            time.sleep(1)  # the reader thread takes the dump's last lines
            pytest.fail("the server did not exit within 120 s of SIGTERM; it said: " + "".join(said[-120:]))
    time.sleep(0.5)  # the reader thread takes stderr's last lines
    # SIGTERM ends it with 0; past `cli.run`'s watchdog it exits 1 with every thread's stack
    assert proc.returncode == 0, "".join(said[-120:])
    assert any("warmed up in" in line for line in said), said  # and the warm-up joined no batch:
    log = ScheduleLog.read(path)
    assert len(log.joins) == 4 and log.stop_tokens and log.model.endswith("tiny-qwen3-moe-4bit")
    assert sorted(len(t) for t in log.tokens.values()) == [5, 6, 7, 8]
    replayer = [sys.executable, "-m", "od_moe.server.schedule", str(path)]
    done = subprocess.run(replayer, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "3 greedy: 3 got their replayed tokens" in done.stdout, done
    greedy = next(j.uid for j in log.joins if j.temperature == 0)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    changed = next(e for e in lines if e["event"] == "token" and e["uid"] == greedy)
    changed["token"] += 1
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    done = subprocess.run(replayer, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and f"these did not: [{greedy}]" in done.stdout, done


def test_arrivals_wait_for_requests_being_read_and_a_grace_after_the_last_at_most_a_bound():
    """`Arrivals.wait`: at once with none being read; until the last ends (queued by the `queue` it is
    given, once however often it is ended) and a grace after it, extended by one starting in the grace;
    never past its bound."""
    arrivals, queued, last_ends = Arrivals(), [], []
    started = time.monotonic()
    assert not arrivals.wait(timeout_s=5) and time.monotonic() - started < 1  # at once, not its bound
    first = arrivals.begin()

    def later():
        time.sleep(0.05)
        second = arrivals.begin()
        first.end(queue=lambda: queued.append("first"))
        first.end(queue=lambda: queued.append("again"))
        time.sleep(0.05)
        last_ends.append(time.monotonic())  # the grace runs from after this instant
        second.end()

    helper = threading.Thread(target=later)
    started = time.monotonic()
    helper.start()
    assert arrivals.wait(timeout_s=5, grace_s=0.02)
    returned = time.monotonic()
    helper.join()
    # Timed against the helper's own clock reading, not its sleeps, so a slow thread start cannot fail it.
    assert returned - last_ends[0] >= 0.02 and returned - started < 2
    assert queued == ["first"] and len(arrivals) == 0
    stuck = arrivals.begin()  # a slow body: the wait ends at its bound
    started = time.monotonic()
    assert arrivals.wait(timeout_s=0.1) and 0.1 <= time.monotonic() - started < 1
    stuck.end()
    assert len(arrivals) == 0


def test_requests_still_being_read_when_one_joins_prefill_in_the_same_step(monkeypatch):
    """A request queued while another is being read waits for it (bounded), so both join the batch before
    the same step and are prefilled together; without the wait the first would start alone. Requests the
    server refuses, and requests it serves, end their arrivals."""
    from od_moe.server import arrivals

    monkeypatch.setattr(arrivals, "ARRIVAL_WAIT_S", 10.0)  # a slow machine still joins them
    engine = od_moe.load(capacity="25%")
    base, log, srv, worker = start(engine, max_batch=4)
    body = {"prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0}
    params = parse_params(body, 256, 256)
    reading = worker.arrivals.begin()  # the second request, still being read
    threading.Timer(0.3, lambda: worker.submit(engine.encode(PROMPTS[2]), params, arrival=reading)).start()
    worker.submit(engine.encode(PROMPTS[1]), params)
    while not log.token_steps or len(log.joins) < 2 or not all(log.token_steps.get(j.uid) for j in log.joins):
        time.sleep(0.01)
    assert [j.step for j in log.joins] == [log.joins[0].step] * 2
    assert call(base, "/v1/completions", body)["choices"][0]["text"]
    with pytest.raises(urllib.error.HTTPError):
        call(base, "/v1/completions", dict(body, max_tokens=-1))
    srv.shutdown()
    worker.stop()
    assert len(worker.arrivals) == 0
    worker.break_pipeline("a rank is gone")  # refused: its arrival ends all the same
    refused = worker.submit(engine.encode(PROMPTS[3]), params, arrival=worker.arrivals.begin())
    assert refused.events.get(timeout=5)[0] == "error" and len(worker.arrivals) == 0


def test_serve_says_when_its_schedule_log_will_record_no_steps(monkeypatch, tmp_path):
    """Where memory cuts `--max-batch` to 1, requests run one at a time and a `--schedule-log` gets only its
    settings: serve says so as it starts, beside why the batch was cut. It also sets the interpreter's
    switch interval to its own (so request threads take the GIL sooner from the generation thread)."""
    from werkzeug import serving

    from od_moe.server import app as server_app
    from od_moe.server import worker as server_worker

    made, lines, real = [], [], serving.make_server
    monkeypatch.setattr(serving, "make_server", lambda *a, **k: made.append(real(*a, **k)) or made[-1])
    monkeypatch.setattr(server_worker, "fitting_batch", lambda engine, n: (1, f"--max-batch {n} cut to 1"))
    intervals = []
    monkeypatch.setattr(
        server_app.sys, "setswitchinterval", intervals.append
    )  # the test process keeps its own
    path = tmp_path / "schedule.jsonl"
    options = dict(port=0, capacity="50%", schedule_log=str(path), log=lines.append)
    thread = threading.Thread(target=server_app.serve, kwargs=options, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not any("cut to 1" in line for line in lines) and time.monotonic() < deadline:
        time.sleep(0.05)
    made[0].shutdown()
    thread.join(60)
    assert any(f"schedule log {path} records no steps" in line for line in lines), lines
    assert intervals == [server_app.SWITCH_INTERVAL_S] and server_app.SWITCH_INTERVAL_S < 0.005


def test_the_first_token_benchmarks_clients_in_a_process_of_their_own_read_what_was_served():
    """The time-to-first-token benchmark's clients run in a process of their own (`bench/client_process.py`):
    sent one after another they get the text a plain request gets, and together or not each reports its
    tokens and a first text before its end."""
    from od_moe.bench.client_process import ClientProcess

    base, log, srv, worker = start(od_moe.load(capacity="50%"), max_batch=4)
    bodies = [{"prompt": p, "max_tokens": 6, "temperature": 0} for p in PROMPTS[:3]]
    served = [call(base, "/v1/completions", b) for b in bodies]
    with ClientProcess() as clients:
        alone = clients.first_tokens(base, bodies, together=False)
        together = clients.first_tokens(base, bodies, together=True)
    srv.shutdown()
    worker.stop()
    assert [text for _, text, _, _ in alone] == [r["choices"][0]["text"] for r in served]
    assert [tokens for _, _, tokens, _ in alone] == [r["usage"]["completion_tokens"] for r in served]
    for first, text, tokens, end in alone + together:
        assert text and 0 < tokens <= 6 and 0 < first <= end
