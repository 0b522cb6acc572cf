"""Streamed HTTP clients in a process of their own, for the time-to-first-token benchmark (`first_token.py`).

Clients run in the server's process share its GIL: a client thread waiting for the interpreter while the
server's worker builds a pass adds that wait to the time it measures, and the server's request threads
wait for the clients' work in turn. A server's real clients are other processes. This file also runs as a
script (`python3 client_process.py`, started by `ClientProcess`); it imports only the standard library,
so it starts in a fraction of a second and never touches the accelerator. The script reads one JSON line
a round from stdin, {"base", "bodies", "together"}, and writes one back: each request's [seconds until its
first chunk carrying text, its whole text, its tokens, seconds until its end], the requests sent one after
another or released together.
Not here: the server (`clients.start_server`), the table (`first_token.py`).
"""

import json
import subprocess
import sys
import threading
import time
import urllib.request


def completion_request(base: str, body: dict) -> urllib.request.Request:
    """A POST of `body` as JSON to the server's `/v1/completions`."""
    return urllib.request.Request(
        base + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )


def all_at_once(client, count: int) -> float:
    """Run `client(0)` .. `client(count - 1)` on threads started together; the seconds until all ended."""
    threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - started


# (seconds until the first chunk carrying text or None, the whole text, the tokens, seconds until the end)
FirstToken = tuple[float | None, str, int, float]


def first_token_s(base: str, body: dict) -> FirstToken:
    """Send one streamed completion request and read it to its end: (seconds until the first chunk
    carrying text, None when no text came; the whole text; the tokens generated; seconds until the end)."""
    req = completion_request(base, dict(body, stream=True, stream_options={"include_usage": True}))
    started, first, text, tokens = time.perf_counter(), None, "", 0
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            piece = (chunk["choices"][0].get("text") or "") if chunk.get("choices") else ""
            if piece and first is None:
                first = time.perf_counter() - started
            text += piece
    return first, text, tokens, time.perf_counter() - started


def first_tokens(base: str, bodies: list[dict], together: bool) -> list[FirstToken | None]:
    """`first_token_s` of each request, sent one after another, or on threads released by one
    barrier (None for a request whose thread raised)."""
    if not together:
        return [first_token_s(base, body) for body in bodies]
    got: list[FirstToken | None] = [None] * len(bodies)
    barrier = threading.Barrier(len(bodies))

    def client(i):
        barrier.wait()
        got[i] = first_token_s(base, bodies[i])

    all_at_once(client, len(bodies))
    return got


class ClientProcess:
    """This file run as a client process; `first_tokens` there, one round at a time."""

    def __init__(self):
        self._process = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )

    def first_tokens(self, base: str, bodies: list[dict], together: bool) -> list[tuple]:
        self._process.stdin.write(json.dumps({"base": base, "bodies": bodies, "together": together}) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the client process ended (exit code {self._process.wait()}); see its stderr")
        return [tuple(pair) for pair in json.loads(line)]

    def close(self):
        self._process.stdin.close()
        self._process.wait(timeout=60)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def main():
    for line in sys.stdin:
        round_ = json.loads(line)
        got = first_tokens(round_["base"], round_["bodies"], round_["together"])
        print(json.dumps(got), flush=True)


if __name__ == "__main__":
    main()
