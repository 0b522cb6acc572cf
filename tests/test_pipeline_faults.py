"""Across ranks (issue #39): a rank that dies mid-request ends the others with one line instead of leaving
them blocked in a collective, and `od-moe serve` runs over two ranks: rank 0 serves stock mlx-lm's tokens,
/health and /metrics give one row per rank, and a rank that dies mid-stream gives the client an error
event, /health an error state and later requests a 503. The ranks are started without `mlx.launch` (which
stops every rank once one fails), so what the surviving rank does by itself is what is seen; a rank dies
through `dying_rank.py`'s hook; every wait is bounded, so a hang fails the test instead of CI."""

import json
import os
import signal
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import mlx_lm
import pytest

import od_moe
from od_moe.distributed.local_ranks import start
from od_moe.memory import backend

SCRIPT = Path(__file__).parent / "dying_rank.py"
PROMPTS = ["def fibonacci(n):", "class Stack:"]
TIMEOUT_S = 3  # the heartbeat's silence limit in these tests (OD_MOE_HEARTBEAT_TIMEOUT)


class Ranks:
    """Ranks started by `local_ranks.start`, their stderr lines collected as they come; killed at exit."""

    def __init__(self, tmp_path, args, **env):
        env = dict(DIE_RANK="1", OD_MOE_HEARTBEAT_TIMEOUT=str(TIMEOUT_S), **env)
        self.processes = start(SCRIPT, args, folder=tmp_path, env=env)
        self.lines = [[] for _ in self.processes]
        for rank, process in enumerate(self.processes):
            threading.Thread(target=self._pump, args=(rank, process), daemon=True).start()

    def _pump(self, rank, process):
        for line in process.stderr:
            self.lines[rank].append(line.rstrip("\n"))

    def wait_for(self, rank: int, text: str, timeout_s: float = 120) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            found = [line for line in self.lines[rank] if text in line]
            if found:
                return found[0]
            assert self.processes[rank].poll() is None, "\n".join(self.lines[rank][-20:])
            time.sleep(0.1)
        raise AssertionError(f"rank {rank} never said {text!r}:\n" + "\n".join(self.lines[rank][-20:]))

    def exit_code(self, rank: int, timeout_s: float) -> tuple[int, float]:
        """(rank's exit code, when it exited), or an AssertionError once `timeout_s` have passed."""
        try:
            code = self.processes[rank].wait(timeout=timeout_s)
        except Exception:
            raise AssertionError(
                f"rank {rank} still runs after {timeout_s} s:\n" + "\n".join(self.lines[rank])
            )
        return code, time.time()

    def kill(self):
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()


@pytest.fixture
def ranks(tmp_path):
    made = []
    yield lambda args, **env: made.append(Ranks(tmp_path, args, **env)) or made[-1]
    for r in made:
        r.kill()


def _died_at(r: Ranks) -> float:
    return float(r.wait_for(1, "dies at ").split("dies at ")[1])


def test_generate_ends_with_one_line_when_a_rank_stops_answering(ranks):
    """Rank 1 stops (SIGSTOP: its sockets stay open, as with a hung process or a machine gone from the
    network), so rank 0 blocks in a collective: its heartbeat ends it, code 1, one line, in bounded time."""
    args = ["generate", "--prompt", PROMPTS[0], "--ignore-chat-template", "--max-tokens", 200]
    r = ranks([*args, "--capacity", "25%"], DIE_AFTER="4", DIE_HOW="stop")
    code, ended = r.exit_code(0, timeout_s=120)
    assert code == 1, "\n".join(r.lines[0])
    assert r.lines[0][-1].startswith(
        f"od-moe: error: rank 1 of 2 is gone (it sent nothing for {TIMEOUT_S} s"
    ), r.lines[0]
    # silent for TIMEOUT_S, then GRACE_S (2 s) for the generation to end or fail by itself
    assert ended - _died_at(r) < TIMEOUT_S + 2 + 5


def _call(base, path, body=None):
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            text = response.read().decode()
            kind = response.headers.get_content_type()
            return response.status, json.loads(text) if kind == "application/json" else text
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read().decode())


def _stock_texts(prompts, max_tokens):
    model, tokenizer = mlx_lm.load(str(od_moe.DEFAULT_MODEL))
    model.set_dtype(backend.compute_dtype("auto"))
    return [
        "".join(r.text for r in mlx_lm.stream_generate(model, tokenizer, p, max_tokens=max_tokens))
        for p in prompts
    ]


def test_serve_over_two_ranks_and_a_rank_that_dies_mid_stream(ranks):
    tokens = 12
    # rank 1 is killed at the third request's fourth token (its process ends, its sockets close)
    r = ranks(["serve", "--port", 0, "--capacity", "25%"], DIE_AFTER=str(2 * tokens + 4), DIE_HOW="kill")
    stock = _stock_texts(PROMPTS, tokens)
    base = "http://" + r.wait_for(0, "od-moe serving").split("http://")[1].split()[0]
    assert "batching is off across ranks" in r.wait_for(0, "od-moe: batching")
    assert "layers 0-3" in r.wait_for(1, "follows rank 0's requests")
    for prompt, text in zip(PROMPTS, stock):
        status, body = _call(
            base, "/v1/completions", {"prompt": prompt, "max_tokens": tokens, "temperature": 0}
        )
        assert status == 200 and body["choices"][0]["text"] == text
    deadline = time.monotonic() + 30  # the other rank's figures come with its beats, every 0.5 s
    while True:
        status, health = _call(base, "/health")
        rows = health["ranks"]
        if rows[1].get("decode_lookups") == rows[0]["decode_lookups"] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 200 and health["status"] == "ok"
    assert [(row["rank"], row["layers"], row["state"]) for row in rows] == [
        (0, [4, 7], "ok"),
        (1, [0, 3], "ok"),
    ]
    for row in rows:  # each rank read its own layers' experts at 25%
        assert row["bytes_read"] > 0 and 0 < row["decode_hit_rate"] < 1
    assert rows[0]["decode_lookups"] == rows[1]["decode_lookups"]  # the same passes on 4 MoE layers each
    metrics = _call(base, "/metrics")[1]
    assert 'od_moe_rank_decode_hit_rate{rank="1"}' in metrics and 'od_moe_rank_up{rank="1"} 1.0' in metrics
    assert [row["rank"] for row in _call(base, "/dashboard/data")[1]["ranks"]] == [0, 1]

    status, events = _call(base, "/v1/completions", {"prompt": "import os", "max_tokens": 40, "stream": True})
    events = [e[len("data: ") :] for e in events.split("\n\n") if e]
    assert status == 200 and len(events) >= 2, events
    assert json.loads(events[-1])["error"]["message"].startswith("rank 1 of 2 is gone (its connection closed")
    status, health = _call(base, "/health")
    assert status == 503 and health["status"] == "error" and "rank 1 of 2 is gone" in health["last_error"]
    assert [row["state"] for row in health["ranks"]] == ["ok", "lost"]
    status, body = _call(base, "/v1/completions", {"prompt": "x", "max_tokens": 2})
    assert status == 503 and "rank 1 of 2 is gone" in body["error"]["message"]
    r.processes[0].send_signal(signal.SIGTERM)
    code, _ = r.exit_code(0, timeout_s=30)
    assert code == 1 and r.lines[0][-1].startswith("od-moe: error: rank 1 of 2 is gone"), r.lines[0][-5:]
