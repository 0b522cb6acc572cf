"""Does `od-moe serve` hold up under load? Many clients against one server, with hang-ups, bad requests
and all three generation endpoints mixed in. Every good request must complete, greedy answers must equal
the ones the same server gave sequentially, every bad request must get its 4xx JSON error, and the
server's memory must stay flat. A command, not a timed test:

    python benchmarks/soak.py [--clients 16] [--requests 20] [--max-tokens 16] [--capacity 25%] [--seed 0]

The server runs as a subprocess (`python -m od_moe serve`); its resident set size is sampled from /proc
(or `ps`) every 0.25 s. Exit status 1 if any check fails.
"""

import argparse
import json
import random
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request

PROMPTS = [
    "def fibonacci(n):",
    "import os\nimport sys\n\n",
    "class Stack:\n    def __init__(self):",
    "def quicksort(items):",
    "with open(path) as f:\n",
    "def parse_args():\n    parser = argparse.ArgumentParser(",
    "for i, line in enumerate(lines):\n",
    "async def fetch(url):",
]
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/messages")
LONE_SURROGATE = b'{"messages": [{"role": "user", "content": "\\ud800"}], "max_tokens": 4}'
BAD = [  # (path, raw body, extra headers, expected status)
    ("/v1/completions", b'{"prompt": "x", "top_k": 1000000, "temperature": 1}', {}, 400),
    ("/v1/completions", b'{"prompt": "x", "seed": -1}', {}, 400),
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN, "stream": true}', {}, 400),
    ("/v1/chat/completions", LONE_SURROGATE, {}, 400),
    ("/v1/completions", b'{"prompt": "x", "logprobs": 1}', {}, 400),
    ("/v1/completions", b'{"prompt": [1, 2', {}, 400),
    ("/v1/messages", b'{"messages": [{"role": "user", "content": "hi"}]}', {}, 400),
    ("/v1/completions", b'{"prompt": "x"}', {"Content-Type": "text/plain"}, 415),
    ("/v1/completions", b'{"prompt": "x"}', {"Host": "rebound.example"}, 403),
    ("/v1/completions", b'{"prompt": "x"}', {"Origin": "https://evil.example"}, 403),
    ("/v1/completions", json.dumps({"prompt": [5] * 2100}).encode(), {}, 400),
]


def body_for(path, prompt, max_tokens, stream, temperature=0.0, seed=None):
    if path == "/v1/completions":
        body = {"prompt": prompt}
    else:
        body = {"messages": [{"role": "user", "content": prompt}]}
    body.update(max_tokens=max_tokens, temperature=temperature, stream=stream)
    if seed is not None and path != "/v1/messages":
        body["seed"] = seed
    return body


def text_of(path, raw: str, stream: bool) -> str:
    """The generated text of a reply (streamed or whole), or an AssertionError if it did not complete."""
    if not stream:
        reply = json.loads(raw)
        if path == "/v1/messages":
            assert reply["stop_reason"] in ("max_tokens", "end_turn"), reply
            return reply["content"][0]["text"]
        choice = reply["choices"][0]
        assert choice["finish_reason"] in ("length", "stop"), reply
        return choice["message"]["content"] if "message" in choice else choice["text"]
    datas = [l[len("data: ") :] for l in raw.split("\n") if l.startswith("data: ")]
    if path == "/v1/messages":
        events = [json.loads(d) for d in datas]
        assert events[-1]["type"] == "message_stop", events[-1]
        return "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert datas[-1] == "[DONE]", datas[-2:]
    chunks = [json.loads(d) for d in datas[:-1]]
    assert all("error" not in c for c in chunks), chunks
    parts = [
        c["choices"][0].get("text") or c["choices"][0].get("delta", {}).get("content") or "" for c in chunks
    ]
    return "".join(parts)


def post(base, path, raw: bytes, headers=None):
    sent = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(base + path, data=raw, headers=sent)
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def hang_up(port, path, raw: bytes, after_s: float):
    """Send a request and close the connection after `after_s` seconds, reading nothing."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(
        b"POST %s HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
        % (path.encode(), len(raw))
        + raw
    )
    time.sleep(after_s)
    sock.close()


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            return int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) * 1024
    except OSError:
        return int(subprocess.check_output(["ps", "-o", "rss=", "-p", str(pid)]).strip()) * 1024


def start_server(capacity: str) -> tuple[subprocess.Popen, int]:
    """`od-moe serve` on a free port, as a subprocess; its port."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "od_moe", "serve", "--port", "0", "--capacity", capacity],
        stderr=subprocess.PIPE,
        text=True,
    )
    port = int(re.search(r"http://127\.0\.0\.1:(\d+)", proc.stderr.readline()).group(1))
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep the access log from blocking
    return proc, port


def greedy_answers(base: str, max_tokens: int) -> dict[tuple[str, str], str | None]:
    """(path, prompt) -> the greedy text, one request at a time (None where a request failed)."""
    answers = {}
    for path in ENDPOINTS:
        for prompt in PROMPTS:
            status, raw = post(base, path, json.dumps(body_for(path, prompt, max_tokens, False)).encode())
            answers[path, prompt] = text_of(path, raw, False) if status == 200 else None
    return answers


def one_request(kind: str, rng: random.Random, base: str, port: int, max_tokens: int, reference: dict):
    """Send one request of `kind` and check its reply: None, or the check that failed."""
    path, prompt, stream = rng.choice(ENDPOINTS), rng.choice(PROMPTS), rng.random() < 0.5
    try:
        if kind == "good":
            status, reply = post(base, path, json.dumps(body_for(path, prompt, max_tokens, stream)).encode())
            assert status == 200, reply
            got = text_of(path, reply, stream)
            assert got == reference[path, prompt], (path, prompt, got, reference[path, prompt])
        elif kind == "sampled":
            body = body_for(path, prompt, max_tokens, stream, 0.8, rng.randrange(2**31))
            status, reply = post(base, path, json.dumps(body).encode())
            assert status == 200, reply
            text_of(path, reply, stream)
        elif kind == "bad":
            path, raw, headers, expected = rng.choice(BAD)
            status, reply = post(base, path, raw, headers)
            assert status == expected, (path, raw[:60], status, reply)
            error = json.loads(reply)["error"]
            assert error["message"], reply
        else:
            raw = json.dumps(body_for(path, prompt, 200, stream)).encode()
            hang_up(port, path, raw, rng.uniform(0.0, 0.5))
    except Exception as e:  # a failed check, recorded and reported
        return f"{kind} {path}: {type(e).__name__}: {str(e)[:300]}"
    return None


def run_clients(args, base: str, port: int, reference: dict) -> tuple[dict, list[str]]:
    """`args.clients` threads of `args.requests` mixed requests each: the requests done by kind, and the
    checks that failed."""
    failures, lock = [], threading.Lock()
    counts = {"good": 0, "sampled": 0, "bad": 0, "hang-ups": 0}

    def client(index):
        rng = random.Random(args.seed * 1000 + index)
        for _ in range(args.requests):
            kind = rng.choices(["good", "sampled", "bad", "hang-ups"], [0.55, 0.1, 0.2, 0.15])[0]
            failure = one_request(kind, rng, base, port, args.max_tokens, reference)
            with lock:
                if failure is None:
                    counts[kind] += 1
                else:
                    failures.append(failure)

    clients = [threading.Thread(target=client, args=(i,)) for i in range(args.clients)]
    for t in clients:
        t.start()
    for t in clients:
        t.join()
    return counts, failures


def sample_memory(pid: int, memory: list, stop: threading.Event):
    """Append (time, resident set bytes) of process `pid` to `memory` every 0.25 s until `stop`."""
    while not stop.is_set():
        memory.append((time.perf_counter(), rss_bytes(pid)))
        stop.wait(0.25)


def health_of(base: str) -> dict:
    return json.loads(urllib.request.urlopen(base + "/health", timeout=30).read())


def wait_idle(base: str, seconds: float = 60):
    """Until the server has no request active or queued (hang-ups queued last are cancelled in turn)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        requests = health_of(base)["requests"]
        if requests["active"] == 0 and requests["queued"] == 0:
            return
        time.sleep(0.2)


def soak(args, proc: subprocess.Popen, port: int) -> dict:
    """The reference answers, the soak under memory sampling, the answers again; what the report needs."""
    base = f"http://127.0.0.1:{port}"
    t0 = time.perf_counter()
    reference = greedy_answers(base, args.max_tokens)
    assert None not in reference.values(), "a sequential greedy request failed"
    sequential_s = time.perf_counter() - t0
    memory, stop = [], threading.Event()
    sampler = threading.Thread(target=sample_memory, args=(proc.pid, memory, stop), daemon=True)
    sampler.start()
    t1 = time.perf_counter()
    counts, failures = run_clients(args, base, port, reference)
    soak_s = time.perf_counter() - t1
    wait_idle(base)
    stop.set()
    sampler.join()
    after = greedy_answers(base, args.max_tokens)  # the same answers after the soak, one at a time
    failures += [
        f"after the soak: {path} {prompt!r} differs"
        for (path, prompt), text in after.items()
        if text != reference[path, prompt]
    ]
    return dict(
        reference=reference,
        sequential_s=sequential_s,
        memory=memory,
        counts=counts,
        failures=failures,
        soak_s=soak_s,
        health=health_of(base),
    )


def report(args, run: dict, returncode: int) -> int:
    """Print what the soak found; the exit status (1 if any check failed)."""
    memory, failures, health = run["memory"], run["failures"], run["health"]
    third = max(1, len(memory) // 3)
    first, last = memory[:third], memory[-third:]
    mb = 10**6
    first_mb = sum(m for _, m in first) / len(first) / mb
    last_mb = sum(m for _, m in last) / len(last) / mb
    r = health["requests"]
    print(
        f"soak: {args.clients} clients x {args.requests} requests, max_tokens {args.max_tokens}, capacity "
        f"{args.capacity}, seed {args.seed}"
    )
    print(f"reference: {len(run['reference'])} greedy answers sequentially in {run['sequential_s']:.1f} s")
    print(
        f"soak: {run['soak_s']:.1f} s; done by kind: "
        + ", ".join(f"{k} {v}" for k, v in run["counts"].items())
    )
    print(
        f"server counters: total {r['total']}, completed {r['completed']}, cancelled {r['cancelled']}, "
        f"failed {r['failed']}, rejected {r['rejected']}; status {health['status']}; "
        f"active {r['active']}, queued {r['queued']}"
    )
    print(
        f"server RSS: first third of the soak {first_mb:.1f} MB, last third {last_mb:.1f} MB "
        f"(change {last_mb - first_mb:+.1f} MB), max {max(m for _, m in memory) / mb:.1f} MB, "
        f"{len(memory)} samples; MLX peak {health['memory'].get('peak_bytes', 0) / mb:.1f} MB"
    )
    print(f"greedy answers equal to the sequential ones, after the soak too: {not failures}")
    print(f"server process exit status after SIGTERM: {returncode}")
    for failure in failures[:20]:
        print("FAILED", failure)
    print(f"{len(failures)} failed checks" if failures else "all checks passed")
    return 1 if failures or r["failed"] or returncode != 0 else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--requests", type=int, default=20, help="requests per client")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--capacity", default="25%")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    proc, port = start_server(args.capacity)
    try:
        run = soak(args, proc, port)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return report(args, run, proc.returncode)


if __name__ == "__main__":
    sys.exit(main())
